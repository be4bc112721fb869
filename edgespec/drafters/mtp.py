"""Qwen3.5's multi-token-prediction (MTP) head as a drafter: drafts from the verifier's hidden states.

The head ships inside the checkpoint (`mtp.*` weights, models/qwen3_5.MTPHead) and is loaded
with the verifier, so `auto` and `speculative` draft with it unasked (drafters.load_drafter).

State, with seq the committed sequence x_0..x_{n-1}: the verifier's cache holds positions
0..n-2 (every mode that drafts with it keeps that invariant: the last committed token is fed
with the next verification), and, once this drafter is attached, its first attention layer's
cache records the final-norm hidden state h_j of each of them (models/qwen3_5.Model,
`keep_hidden`); the speculative and adaptive modes hand that cache over with
`bind_verifier_cache`. The head's own KV cache holds entry j = (x_{j+1}, h_j) at RoPE position
j. Entries made from the verifier's states on the committed path are kept across rounds
(`fed` of them); a draft appends entries made from the head's own output (its normed hidden
state stands in for the verifier's), and those are trimmed at the next draft, where the
verifier's true states replace them. So a partially accepted chain rolls back exactly.

It drafts in the modes that keep the verifier's cache of the committed tokens (speculative,
auto/adaptive); tree and cascade refuse it by name (`reads_verifier`), and pipelined drafting
is off with it.
"""

from __future__ import annotations

import mlx.core as mx

from edgespec.drafters.base import Draft, common_prefix
from edgespec.errors import ModelLoadError


def has_mtp(model) -> bool:
    """True if the verifier was loaded with an MTP head (a checkpoint carrying `mtp.*` weights)."""
    return getattr(model, "mtp", None) is not None


class MTPDrafter:
    """Drafter protocol (begin / draft / accept / sync / close) over the verifier's MTP head."""

    reads_verifier = True  # drafts from the verifier's live cache: no pipelining, not in tree/cascade

    def __init__(self, verifier, name: str = "mtp"):
        if not has_mtp(verifier):
            raise ModelLoadError(f"the verifier ({verifier.args.model_type}) carries no MTP head (mtp.* weights)")
        if getattr(verifier, "hidden_layer", None) is None:
            raise ModelLoadError("the MTP drafter reads hidden states recorded in an attention layer's cache; "
                                 "this verifier has no full-attention layer")
        self.verifier, self.head, self.name = verifier, verifier.mtp, name
        self.device = "gpu" if mx.default_device().type == mx.DeviceType.gpu else "cpu"
        self.vocab_size = verifier.args.vocab_size
        verifier.keep_hidden = True  # its caches made from now on record the hidden states read here
        self.vcache = None  # the verifier's cache of the generation this drafter serves
        self.cache: list = []  # the head's own KV cache
        self.seq: list[int] = []
        self.fed = 0  # head entries built from the verifier's states on the committed path
        self._last_draft: list[int] = []

    # ------------------------------------------------------------- verifier state
    def bind_verifier_cache(self, cache) -> None:
        self.vcache = cache

    def _hidden_rows(self, start: int, stop: int) -> mx.array | None:
        """(1, stop - start, E) verifier hidden states of positions start..stop-1, or None."""
        if self.vcache is None:
            return None
        store = self.vcache[self.verifier.hidden_layer]
        hidden = getattr(store, "hidden", None)
        if hidden is None or store.offset < stop or hidden.shape[1] < stop:
            return None
        return hidden[:, start:stop]

    # ------------------------------------------------------------- protocol
    def begin(self, prompt: list[int]) -> None:
        if not prompt:
            raise ValueError("the drafter needs a non-empty prompt")
        self.cache = self.head.make_cache()
        self.seq = list(prompt)
        self.fed = 0
        self._last_draft = []

    def _step(self, toks: list[int] | mx.array, hidden: mx.array) -> mx.array:
        """Entries (toks[i], hidden[:, i]) appended to the head's cache -> its output rows (1, T, E)."""
        ids = toks if isinstance(toks, mx.array) else mx.array(toks, dtype=mx.int32)
        emb = self.verifier.embed(ids.reshape(1, -1))
        return self.head(emb, hidden.astype(emb.dtype), self.cache)

    def draft(self, k: int, sampler) -> Draft:
        n = len(self.seq)
        self._last_draft = []
        if k < 1 or n < 2:
            return Draft([], None)
        # Re-feed at least the last entry: its output is where the draft starts.
        fed = min(self.fed, n - 2)
        rows = self._hidden_rows(fed, n - 1)
        if rows is None:  # no verifier states (a pass that does not record them): no draft
            return Draft([], None)
        drop = self.cache[0].offset - fed if self.cache else 0
        if drop > 0:
            for c in self.cache:
                c.trim(drop)
        g = self._step(self.seq[fed + 1 : n], rows)[:, -1:]  # entries (x_{j+1}, h_j), j = fed..n-2
        self.fed = n - 1
        toks, lps = [], []
        for i in range(k):
            lp = sampler.logprobs(self.verifier.project(g)[0, -1])  # the shared head: x_{n+i}
            t = sampler.sample(lp)
            toks.append(t)
            lps.append(lp)
            if i + 1 < k:
                g = self._step(t.reshape(1).astype(mx.int32), g)  # (draft, the head's own state)
        q = mx.stack(lps)
        toks = mx.stack(toks)
        mx.eval(toks, q)
        self._last_draft = [int(t) for t in toks.tolist()]
        return Draft(list(self._last_draft), q)

    def accept(self, n_accepted: int, next_token: int) -> None:
        if not 0 <= n_accepted <= len(self._last_draft):
            raise ValueError(f"n_accepted must be in 0..{len(self._last_draft)}, got {n_accepted}")
        self.sync(self.seq + self._last_draft[:n_accepted] + [int(next_token)])

    def sync(self, committed: list[int]) -> None:
        """Make `committed` the committed sequence; head entries off that path are dropped."""
        keep = common_prefix(self.seq, committed)
        self.seq = list(committed)
        self._last_draft = []
        # Entry j reads x_{j+1} and h_j (which depends on x_0..x_j): valid while j + 1 < keep.
        self.fed = min(self.fed, max(0, keep - 1))

    def close(self) -> None:
        self.vcache = None
        self.cache = []

    @classmethod
    def load(cls, verifier) -> MTPDrafter:
        """For an Engine (or LoadedModel, or model) whose verifier carries an MTP head."""
        loaded = getattr(verifier, "loaded", verifier)
        return cls(getattr(loaded, "model", loaded))
