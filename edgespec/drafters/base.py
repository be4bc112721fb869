"""The Drafter protocol every speculative drafter implements, and a base for MLX-model drafters.

A drafter proposes k tokens continuing the *committed* sequence (prompt plus
every token the verifier has emitted). The speculative mode verifies them and
reports back with `accept(n_accepted, next_token)`: the first n_accepted
proposals were kept and `next_token` (the verifier's correction or bonus token)
follows them. `accept` may also come without a preceding `draft` (n_accepted=0)
when the verifier stepped alone (controller fallback to plain decoding).

Optional capability: `sync(committed)` sets the committed sequence to any list
that shares a prefix with what the drafter has seen. The pipelined mode needs it
to undo a wrong guess; drafters without it run unpipelined.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import mlx.core as mx

from edgespec.cache import KVCache, cache_arrays


@dataclass
class Draft:
    tokens: list[int]  # k proposed token ids
    # (k, V) the drafter's *filtered* log-probs q (same SamplingParams transform as the
    # verifier, via sampler.logprobs); None = deterministic proposals (point mass on each token)
    logprobs: mx.array | None


@runtime_checkable
class Drafter(Protocol):
    name: str
    device: str  # "cpu" | "gpu" | "ane" | "none"
    vocab_size: int

    def begin(self, prompt: list[int]) -> None: ...

    def draft(self, k: int, sampler) -> Draft: ...

    def accept(self, n_accepted: int, next_token: int) -> None: ...

    def close(self) -> None: ...


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class CommittedSequence:
    """accept() / sync() shared by the drafters that cache what they were fed.

    State: `seq` the committed sequence, `fed` the tokens whose entries are in the
    drafter's cache (a prefix of `seq`, plus draft tokens after a draft) and
    `_last_draft`. Subclasses implement `_trim_to(n)`: keep only the first n fed
    entries (drop KV positions, or just shorten `fed` for a fixed buffer).
    """

    seq: list[int]
    fed: list[int]
    _last_draft: list[int]

    def _trim_to(self, n: int) -> None:
        raise NotImplementedError

    def _rollback(self) -> None:
        """Drop cached entries that are not on the committed path (the last token is fed later)."""
        self._trim_to(common_prefix(self.fed, self.seq[:-1]))

    def accept(self, n_accepted: int, next_token: int) -> None:
        if not 0 <= n_accepted <= len(self._last_draft):
            raise ValueError(f"n_accepted must be in 0..{len(self._last_draft)}, got {n_accepted}")
        self.sync(self.seq + self._last_draft[:n_accepted] + [int(next_token)])

    def sync(self, committed: list[int]) -> None:
        """Make `committed` the committed sequence; cached entries off that path are dropped."""
        self.seq = list(committed)
        self._last_draft = []
        self._rollback()


class ModelDrafter(CommittedSequence):
    """A drafter backed by an MLX causal LM with its own KV cache.

    State: `seq` is the committed sequence; the cache holds `cached` tokens,
    always a prefix of `seq` plus, after a draft, the draft tokens fed so far.
    The tokens of `seq` beyond the cache are fed in one pass at the next draft,
    so a fully accepted round costs no extra drafter pass.
    Subclasses set `model`, `vocab_size` and may override `_forward`.
    """

    name = "mlx"
    device = "cpu"

    def __init__(self, model, layer_ids: list[int] | None = None):
        self.model = model
        self.layer_ids = layer_ids
        self.vocab_size = model.args.vocab_size
        self.cache: list[KVCache] = []
        self.seq: list[int] = []
        self.fed: list[int] = []  # tokens whose K/V are in the cache (len == cache offset)
        self._last_draft: list[int] = []

    # -- model call: (1, T) tokens -> (T, V) logits, appending T positions to the cache
    def _forward(self, x: mx.array) -> mx.array:
        """x (1, T) int32 -> logits (T, V)."""
        return self.model(x, self.cache, layer_ids=self.layer_ids)[0]

    def _trim_to(self, n: int) -> None:
        drop = len(self.fed) - n
        if drop > 0:
            for c in self.cache:
                c.trim(drop)
            del self.fed[n:]

    def begin(self, prompt: list[int]) -> None:
        if not prompt:
            raise ValueError("the drafter needs a non-empty prompt")
        self.cache = self.model.make_cache()
        self.fed = []
        self.seq = list(prompt)
        self._last_draft = []
        # Prefill all but the last token; it is fed with the first draft step.
        from edgespec.generate import PREFILL_CHUNK

        body = self.seq[:-1]
        for start in range(0, len(body), PREFILL_CHUNK):
            piece = body[start : start + PREFILL_CHUNK]
            self._forward(mx.array(piece, dtype=mx.int32)[None])
            self.fed.extend(piece)
            mx.eval(cache_arrays(self.cache))

    def draft(self, k: int, sampler) -> Draft:
        """k tokens continuing `seq`; q (k, V) filtered with the sampler's params."""
        if k < 1:
            return Draft([], None)
        # Roll back anything not on the committed path, then feed the pending tokens.
        self._rollback()
        pending = self.seq[len(self.fed) :]
        # Build all k steps lazily (each step's sampled token feeds the next as an
        # array) and evaluate once: no host round trip between drafter steps.
        toks, rows = [], []
        feed = mx.array(pending, dtype=mx.int32)[None]  # (1, T)
        for _ in range(k):
            logits = self._forward(feed)[-1]  # (V,)
            lp = sampler.logprobs(logits)
            tok = sampler.sample(lp)
            toks.append(tok)
            rows.append(lp)
            feed = tok.reshape(1, 1).astype(mx.int32)
        q = mx.stack(rows)  # (k, V)
        toks = mx.stack(toks)
        mx.eval(toks, q)
        tokens = [int(t) for t in toks.tolist()]
        self.fed.extend(pending + tokens[:-1])
        self._last_draft = tokens
        return Draft(tokens, q)

    def close(self) -> None:
        self.cache = []
        self.fed = []
