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

The head runs in MLX (`MLXHead`, the verifier's own `mtp` module) or from its Core ML package
(`CoreMLHead`: `edgespec convert SRC OUT --drafter mtp` writes drafter.mlpackage, see
converters/mtp_export.py; a fixed KV buffer where rolling back is passing a smaller position),
through a backend object (`call(function, ids, hidden, position) -> (logits, hidden)`), so the
same logic runs on a Mac against Core ML and here against the numpy MIL executor (tests).
"""

from __future__ import annotations

import copy
from dataclasses import replace
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from edgespec.drafters.base import (
    CHAIN_MODES,
    AcceptsDrafts,
    Draft,
    DrafterCaps,
    common_prefix,
)
from edgespec.drafters.coreml_runtime import (  # noqa: F401  (package_hidden/rows re-exported)
    CoreMLHiddenBackend,
    PackageCursor,
    package_hidden,
    package_rows,
    units_device,
)
from edgespec.errors import ModelLoadError

MTP_PACKAGE = "mtp"  # the export info's kind of an MTP head's Core ML package


def has_mtp(model) -> bool:
    """True if the verifier was loaded with an MTP head (a checkpoint carrying `mtp.*` weights)."""
    return getattr(model, "mtp", None) is not None


class MLXHead:
    """The head in MLX with its KV cache (entries at positions 0..offset-1)."""

    def __init__(self, verifier):
        self.verifier, self.head = verifier, verifier.mtp
        self.cache: list = []
        self.context = None  # no fixed buffer

    def reset(self) -> None:
        self.cache = self.head.make_cache()

    def fork(self) -> MLXHead:
        return MLXHead(self.verifier)

    @property
    def offset(self) -> int:
        return self.cache[0].offset if self.cache else 0

    def trim_to(self, n: int) -> None:
        for c in self.cache:
            c.trim(c.offset - n)

    def feed(self, ids: list[int] | mx.array, hidden: mx.array) -> tuple[mx.array, mx.array]:
        """Entries (ids[i], hidden[:, i]) appended -> (logits (V,) after the last, its state (1, 1, E))."""
        ids = ids if isinstance(ids, mx.array) else mx.array(ids, dtype=mx.int32)
        emb = self.verifier.embed(ids.reshape(1, -1))
        g = self.head(emb, hidden.astype(emb.dtype), self.cache)[:, -1:]
        return self.verifier.project(g)[0, -1], g


class CoreMLHead(PackageCursor):
    """The head's Core ML package (converters/mtp_export.py) through a backend; a fixed buffer of
    `context` slots where rolling back is only lowering `offset` (stale slots are masked)."""

    def __init__(self, backend, info: dict[str, Any]):
        super().__init__(backend, info)
        self.chunk = int(info["prefill_chunk"])
        self.multi = sorted(int(k) for k in info.get("decode_tokens", [1]) if int(k) > 1)

    def feed(self, ids: list[int] | mx.array, hidden: mx.array) -> tuple[mx.array, mx.array]:
        ids = np.array(ids.tolist() if isinstance(ids, mx.array) else ids, np.int32).reshape(-1)
        rows = np.array(hidden.astype(mx.float32)).reshape(len(ids), -1)  # (T, E)
        if self.offset + len(ids) > self.context:
            raise ValueError(f"{self.offset + len(ids)} entries exceed the MTP package's context of {self.context}")
        i, logits, g = 0, None, None
        while i < len(ids):  # whole prefill chunks, then the biggest K-entry decodes
            left = len(ids) - i
            k = self.chunk if left >= self.chunk else max([k for k in self.multi if k <= left], default=1)
            fn = "prefill" if k == self.chunk and left >= self.chunk else ("decode" if k == 1 else f"decode_{k}")
            logits, g = self.backend.call(fn, ids[None, i : i + k], rows[i : i + k], self.offset)
            self.offset += k
            i += k
        return mx.array(logits[-1]), mx.array(g[-1:])[None]


class MTPDrafter(AcceptsDrafts):
    """Drafter protocol (begin / draft / accept / sync / close) over the verifier's MTP head."""

    # drafts from the verifier's live cache: no pipelining, not in tree/cascade
    caps = DrafterCaps(reads="verifier_cache", forks=True, modes=CHAIN_MODES)

    def __init__(self, verifier, name: str = "mtp", head=None, device: str | None = None):
        """head: an MLXHead (default: the verifier's own MTP module) or a CoreMLHead."""
        if head is None and not has_mtp(verifier):
            raise ModelLoadError(f"the verifier ({verifier.args.model_type}) carries no MTP head (mtp.* weights)")
        if getattr(verifier, "hidden_layer", None) is None:
            raise ModelLoadError("the MTP drafter reads hidden states recorded in an attention layer's cache; "
                                 f"this verifier ({verifier.args.model_type}) records none")
        self.verifier, self.name = verifier, name
        self.head = head if head is not None else MLXHead(verifier)
        self.device = device or ("gpu" if mx.default_device().type == mx.DeviceType.gpu else "cpu")
        self.vocab_size = verifier.args.vocab_size
        verifier.keep_hidden = True  # its caches made from now on record the hidden states read here
        self.vcache = None  # the verifier's cache of the generation this drafter serves
        self.seq: list[int] = []
        self.fed = 0  # head entries built from the verifier's states on the committed path
        self._last_draft: list[int] = []

    # ------------------------------------------------------------- verifier state
    def fork(self) -> MTPDrafter:
        """For one request (see drafters.base.ModelDrafter.fork): the same head, a cache (or
        Core ML state), verifier cache binding and committed sequence of its own."""
        twin = copy.copy(self)
        twin.head = self.head.fork()
        twin.vcache, twin.seq, twin.fed, twin._last_draft = None, [], 0, []
        return twin

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
        self.head.reset()
        self.seq = list(prompt)
        self.fed = 0
        self._last_draft = []

    def draft(self, k: int, sampler) -> Draft:
        n = len(self.seq)
        self._last_draft = []
        if k < 1 or n < 2:
            return Draft([], None)
        # Re-feed at least the last entry: its output is where the draft starts.
        fed = min(self.fed, n - 2)
        if self.head.context is not None:  # a fixed buffer: entries up to position n + k - 3
            k = min(k, self.head.context - n + 2)
        rows = self._hidden_rows(fed, n - 1)
        if rows is None or k < 1:  # no verifier states (a pass that does not record them): no draft
            return Draft([], None)
        self.head.trim_to(fed)  # drop the entries made from guesses
        logits, g = self.head.feed(self.seq[fed + 1 : n], rows)  # entries (x_{j+1}, h_j), j = fed..n-2
        self.fed = n - 1
        toks, lps = [], []
        for i in range(k):
            lp = sampler.logprobs(logits)  # the shared head's logits for x_{n+i}
            t = sampler.sample(lp)
            toks.append(t)
            lps.append(lp)
            if i + 1 < k:
                logits, g = self.head.feed(t.reshape(1).astype(mx.int32), g)  # (draft, the head's own state)
        return self._finish(toks, lps)

    def sync(self, committed: list[int]) -> None:
        """Make `committed` the committed sequence; head entries off that path are dropped."""
        keep = common_prefix(self.seq, committed)
        self.seq = list(committed)
        self._last_draft = []
        # Entry j reads x_{j+1} and h_j (which depends on x_0..x_j): valid while j + 1 < keep.
        self.fed = min(self.fed, max(0, keep - 1))

    def close(self) -> None:
        self.vcache = None

    @classmethod
    def load(cls, verifier) -> MTPDrafter:
        """For an Engine (or LoadedModel, or model) whose verifier carries an MTP head."""
        loaded = getattr(verifier, "loaded", verifier)
        return cls(getattr(loaded, "model", loaded))

    @classmethod
    def from_package(cls, path: Path, verifier, info: dict[str, Any], compute_units: str) -> MTPDrafter:
        """The head's Core ML package (Core ML checked available by the caller, drafters.registry)."""
        loaded = getattr(verifier, "loaded", verifier)
        model = loaded.model
        if int(info.get("hidden_size", -1)) != model.args.hidden_size:
            raise ModelLoadError(f"{path}: the MTP package reads hidden states of width {info.get('hidden_size')}, "
                                 f"the verifier's are {model.args.hidden_size}")
        head = CoreMLHead(CoreMLHiddenBackend(path, list(info["functions"]), compute_units), info)
        drafter = cls(model, name=f"mtp-coreml:{path.name}", head=head, device=units_device(compute_units))
        drafter.caps = replace(cls.caps, runs_on="coreml")
        return drafter
