"""The Core ML drafter: an exported `drafter.mlpackage` running on the Neural Engine (macOS 15+).

    drafter = CoreMLDrafter.load("bundle/drafter.mlpackage", engine, compute_units="CPU_AND_NE")

The package (see converters/coreml_export.py) holds a fixed KV buffer of C
slots as Core ML state and functions `prefill` (P tokens), `decode` (1) and
optional `decode_K` (K). The drafter tracks which tokens occupy the buffer
(`fed`); rolling back is only shortening that list: the next call passes a
smaller `position`, the graph masks every slot beyond each query's own
position, and new tokens overwrite the stale slots. Nothing is copied.

The Core ML runtime is reached through a small backend object (`call(function,
ids, position) -> logits`, `reset()`), so the same drafting logic runs here on
Linux against the numpy MIL executor (tests) and on a Mac against Core ML.

A reduced-vocabulary (distilled) drafter's package takes reduced ids and
outputs N logits; its info carries "reduced_vocab" and the drafter maps input
ids full -> reduced and expands q to the full vocabulary with q = 0 outside the
kept set, exactly as DistilledDrafter does (rejection sampling stays exact).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from edgespec.drafters.base import CommittedSequence, Draft, DrafterCaps, fork_backend
from edgespec.drafters.compat import check_package_map, check_package_vocabulary, package_vocab_map
from edgespec.drafters.coreml_runtime import (  # noqa: F401  (re-exported: the package runtime's names)
    COMPUTE_UNITS,
    METADATA_KEY,
    CoreMLBackend,
    CoreMLHiddenBackend,
    CoreMLUnavailable,
    logits_rows,
    macos_version,
    open_package,
    read_package_info,
    require_coreml,
    units_device,
)
from edgespec.errors import ModelLoadError


class CoreMLDrafter(CommittedSequence):
    """Drafter protocol (begin / draft / accept / sync / close) over a Core ML drafter package."""

    name = "coreml"
    caps = DrafterCaps(forks=True, runs_on="coreml", catches_up=True)

    def __init__(self, backend, info: dict[str, Any], device: str = "ane", vocab_map=None):
        """vocab_map: the `VocabMap` of a reduced-vocabulary package (required for one)."""
        self.backend = backend
        self.device = device
        self.vocab_size = int(info["vocab_size"])  # the verifier's (full) vocabulary
        if info.get("reduced_vocab") and vocab_map is None:
            raise ModelLoadError("a reduced-vocabulary Core ML drafter needs its vocab map")
        self.vocab_map = None if vocab_map is None else check_package_map(vocab_map, info, "Core ML drafter")
        self.context = int(info["context_length"])
        self.chunk = int(info["prefill_chunk"])
        self.multi = sorted(int(k) for k in info.get("decode_tokens", [1]) if int(k) > 1)
        self.seq: list[int] = []
        self.fed: list[int] = []  # tokens in buffer slots 0..len(fed)-1
        self._last_draft: list[int] = []

    @classmethod
    def load(cls, path: str | Path, verifier, compute_units: str = "CPU_AND_NE") -> CoreMLDrafter:
        """`verifier`: the Engine or LoadedModel drafted for; its vocabulary must match the package's.
        A package of another kind (Gemma 4's assistant, an MTP head) loads through
        `edgespec.drafters.load_drafter`, which picks its drafter class."""
        path, info = open_package(path, compute_units)
        check_package_vocabulary(info, verifier)
        if info.get("kind") not in (None, "drafter"):
            raise ModelLoadError(f"{path}: a {info['kind']!r} package; load it with edgespec.drafters.load_drafter")
        return cls.from_info(path, info, compute_units)

    @classmethod
    def from_info(cls, path: Path, info: dict[str, Any], compute_units: str) -> CoreMLDrafter:
        """From an opened package (`coreml_runtime.open_package`, vocabulary already checked)."""
        require_coreml()
        if not info:
            raise ModelLoadError(
                f"{path}: no edgespec export info in the package; re-export it with `edgespec convert`"
            )
        vocab_map = package_vocab_map(path, info)
        backend = CoreMLBackend(path, list(info["functions"]), compute_units)
        return cls(backend, info, device=units_device(compute_units), vocab_map=vocab_map)

    def fork(self) -> CoreMLDrafter:
        """For one request (see drafters.base.ModelDrafter.fork): the same package, a Core ML
        state and committed sequence of its own."""
        twin = copy.copy(self)
        twin.backend = fork_backend(self.backend)
        twin.seq, twin.fed, twin._last_draft = [], [], []
        return twin

    # ---- buffer bookkeeping ----------------------------------------------------
    def _feed(self, tokens: list[int]) -> np.ndarray:
        """Write `tokens` after `fed` and return the logits (V,) following the last one.

        Whole prefill chunks first; a remainder longer than the biggest K-token
        decode is done as one prefill window ending at the last token (its
        first slots recompute entries already there, identically), the rest with
        decode_K / decode calls: few calls, as each Core ML call has a fixed cost.
        """
        seq = self.fed + tokens
        end, i, P = len(seq), len(self.fed), self.chunk
        kmax = self.multi[-1] if self.multi else 1
        if end > self.context:
            raise ValueError(
                f"sequence of {end} tokens exceeds the drafter's context of {self.context}"
            )
        logits = None
        while i < end:
            left = end - i
            if left >= P or (left > kmax and end >= P):
                s = i if left >= P else end - P
                logits = self.backend.call("prefill", self._ids(seq[s : s + P]), s)[-1]
                i = s + P
            else:
                k = max([k for k in self.multi if k <= left], default=1)
                fn = "decode" if k == 1 else f"decode_{k}"
                logits = self.backend.call(fn, self._ids(seq[i : i + k]), i)[-1]
                i += k
        self.fed = seq
        return logits if self.vocab_map is None else self.vocab_map.expand_logits(logits)

    def _ids(self, tokens: list[int]) -> np.ndarray:
        """(1, T) int32 package input; full ids become reduced ones (outside the set: "other")."""
        ids = np.array([tokens], np.int32)
        return ids if self.vocab_map is None else self.vocab_map.to_reduced[ids]

    def _trim_to(self, n: int) -> None:
        del self.fed[n:]  # a fixed buffer: the slots beyond n just become stale

    # ---- Drafter protocol --------------------------------------------------------
    def begin(self, prompt: list[int]) -> None:
        if not prompt:
            raise ValueError("the drafter needs a non-empty prompt")
        self.backend.reset()
        self.seq, self.fed, self._last_draft = list(prompt), [], []
        body = self.seq[:-1]
        if body and len(body) < self.context:
            self._feed(body)  # the last prompt token is fed by the first draft

    def draft(self, k: int, sampler) -> Draft:
        """Up to k tokens continuing `seq` with q (k, V); fewer (maybe none) near the context end."""
        self._rollback()
        k = min(k, self.context - len(self.seq) + 1)  # the k-th token itself needs no slot
        if k < 1:
            return Draft([], None)
        logits = self._feed(self.seq[len(self.fed) :])
        tokens, rows = [], []
        for j in range(k):
            lp = sampler.logprobs(mx.array(logits))
            tok = int(sampler.sample(lp))
            tokens.append(tok)
            rows.append(lp)
            if j < k - 1:
                logits = self._feed([tok])
        self._last_draft = tokens
        return Draft(tokens, mx.stack(rows))

    def close(self) -> None:
        self.seq, self.fed = [], []
