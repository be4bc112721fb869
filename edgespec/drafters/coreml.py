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
import json
import platform
import sys
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from edgespec.drafters.base import CommittedSequence, Draft
from edgespec.errors import EdgespecError, ModelLoadError

METADATA_KEY = "edgespec.coreml"  # the package's user-defined metadata entry (JSON info dict)
COMPUTE_UNITS = ("CPU_AND_NE", "CPU_ONLY", "CPU_AND_GPU", "ALL")


class CoreMLUnavailable(EdgespecError):
    """Core ML cannot run here (not macOS 15+, or coremltools missing); use the MLX drafter."""


def macos_version() -> tuple[int, ...] | None:
    if sys.platform != "darwin":
        return None
    try:
        return tuple(int(x) for x in platform.mac_ver()[0].split(".") if x)
    except ValueError:
        return None


def require_coreml() -> None:
    """Raise CoreMLUnavailable unless this is macOS >= 15 (stateful models need it)."""
    ver = macos_version()
    if ver is None or ver < (15,):
        where = "macOS " + ".".join(map(str, ver)) if ver else sys.platform
        raise CoreMLUnavailable(
            f"the Core ML drafter needs macOS 15 or later (this is {where}); the MLX drafter is used instead"
        )


class CoreMLBackend:
    """Runs the package's functions with Core ML, all sharing one state (macOS 15+ only)."""

    def __init__(self, path: Path, functions: list[str], compute_units: str):
        try:
            import coremltools as ct
        except ImportError:
            raise CoreMLUnavailable(
                "coremltools is not installed; the MLX drafter is used instead"
            ) from None
        cu = getattr(ct.ComputeUnit, compute_units)
        # One MLModel per function of the same package; Core ML shares the weights,
        # and a state made by one function is accepted by the others (same state spec).
        self.models = {
            f: ct.models.MLModel(str(path), compute_units=cu, function_name=f) for f in functions
        }
        self.reset()

    def reset(self) -> None:
        self.state = self.models["decode"].make_state()

    def call(self, function: str, ids: np.ndarray, position: int) -> np.ndarray:
        """ids (1, T) int32 -> logits (T_out, V) float32."""
        out = self.models[function].predict(
            {"input_ids": ids.astype(np.int32), "position": np.array([position], np.int32)},
            state=self.state,
        )
        return logits_rows(out["logits"])


class CoreMLHiddenBackend(CoreMLBackend):
    """A package whose functions also take and return a hidden state: Qwen3.5's MTP head
    (converters/mtp_export.py; drafters/mtp.CoreMLHead drives it)."""

    def call(self, function: str, ids: np.ndarray, hidden: np.ndarray, position: int):
        """ids (1, T), hidden (T, E) -> (logits (T_out, V), hidden (T_out, E)) float32."""
        from edgespec.drafters.mtp import package_hidden, package_rows

        out = self.models[function].predict(
            {"input_ids": ids.astype(np.int32), "hidden": package_hidden(hidden),
             "position": np.array([position], np.int32)}, state=self.state)
        return package_rows(out["logits"]), package_rows(out["hidden_out"])


def logits_rows(logits: np.ndarray) -> np.ndarray:
    """Package output (1, V, 1, T) (channels-first) -> (T, V) float32."""
    lg = np.asarray(logits, dtype=np.float32)
    return lg.reshape(lg.shape[1], lg.shape[3]).T


def read_package_info(path: Path, prefer_manifest: bool = True) -> dict[str, Any]:
    """The export's info dict, from the bundle manifest or the package metadata (coremltools)."""
    manifest = path.parent / "manifest.json"
    if prefer_manifest and manifest.is_file():
        try:
            entry = (json.loads(manifest.read_text()).get("drafter") or {}).get("coreml")
        except json.JSONDecodeError:
            entry = None
        if entry and entry.get("package") == path.name:
            return entry
    try:
        import coremltools as ct
    except ImportError:
        return {}
    try:
        meta = ct.models.MLModel(str(path), skip_model_load=True).user_defined_metadata
        return json.loads(meta.get(METADATA_KEY, "{}"))
    except Exception as e:  # damaged protobuf: no common exception base
        raise ModelLoadError(
            f"{path}: cannot read the Core ML package ({type(e).__name__}: {e}); re-export it"
        ) from None


def package_vocab_map(path: Path, info: dict[str, Any]):
    """The VocabMap of a reduced-vocabulary package (None for a full-vocabulary one).

    Its ids come from the info itself (package metadata), else from the bundle's
    drafter/vocab_map.json beside the package, else from the package metadata;
    the recorded digest must match, so a swapped map is refused.
    """
    from edgespec.drafters.distilled import VocabMap, is_distilled_folder

    rv = info.get("reduced_vocab")
    if not rv:
        return None
    ids = rv.get("ids")
    if ids is not None:
        vmap = VocabMap(ids, int(info["vocab_size"]))
    elif is_distilled_folder(path.parent / "drafter"):
        vmap = VocabMap.load(path.parent / "drafter")
    else:
        ids = (read_package_info(path, prefer_manifest=False).get("reduced_vocab") or {}).get("ids")
        if not ids:
            raise ModelLoadError(f"{path}: a reduced-vocabulary package without its vocab map; re-export it")
        vmap = VocabMap(ids, int(info["vocab_size"]))
    return check_vocab_map(vmap, info, path)


def check_vocab_map(vmap, info: dict[str, Any], where) -> Any:
    rv = info.get("reduced_vocab") or {}
    if (
        vmap.size != int(rv.get("size", -1))
        or vmap.full_vocab_size != int(info["vocab_size"])
        or (rv.get("sha256") and vmap.digest() != rv["sha256"])
    ):
        raise ModelLoadError(
            f"{where}: the reduced-vocabulary map does not match the one the package was exported with; "
            "re-export the drafter"
        )
    return vmap


class CoreMLDrafter(CommittedSequence):
    """Drafter protocol (begin / draft / accept / sync / close) over a Core ML drafter package."""

    name = "coreml"

    def __init__(self, backend, info: dict[str, Any], device: str = "ane", vocab_map=None):
        """vocab_map: the `VocabMap` of a reduced-vocabulary package (required for one)."""
        self.backend = backend
        self.device = device
        self.vocab_size = int(info["vocab_size"])  # the verifier's (full) vocabulary
        if info.get("reduced_vocab") and vocab_map is None:
            raise ModelLoadError("a reduced-vocabulary Core ML drafter needs its vocab map")
        self.vocab_map = None if vocab_map is None else check_vocab_map(vocab_map, info, "Core ML drafter")
        self.context = int(info["context_length"])
        self.chunk = int(info["prefill_chunk"])
        self.multi = sorted(int(k) for k in info.get("decode_tokens", [1]) if int(k) > 1)
        self.seq: list[int] = []
        self.fed: list[int] = []  # tokens in buffer slots 0..len(fed)-1
        self._last_draft: list[int] = []

    @classmethod
    def load(cls, path: str | Path, verifier, compute_units: str = "CPU_AND_NE") -> CoreMLDrafter:
        """`verifier`: the Engine or LoadedModel drafted for; its vocabulary must match the package's."""
        from edgespec.drafters.mlx_drafter import check_vocabulary

        path = Path(path).expanduser()
        if compute_units not in COMPUTE_UNITS:
            raise ValueError(
                f"compute_units must be one of {', '.join(COMPUTE_UNITS)}, got {compute_units!r}"
            )
        if not (path / "Manifest.json").is_file():
            raise ModelLoadError(f"{path}: not a Core ML .mlpackage (no Manifest.json)")
        info = read_package_info(path)
        model = verifier.model
        tok = getattr(verifier, "tokenizer", None)
        if info:
            check_vocabulary(
                int(info["vocab_size"]),
                model.args.vocab_size,
                info.get("vocab_hash"),
                tok.vocab_hash() if tok is not None else None,
                what="Core ML drafter",
            )
        if info.get("kind") == "gemma4_assistant":  # Gemma 4's assistant: its own drafter (reads the verifier)
            from edgespec.drafters.coreml_assistant import CoreMLAssistantDrafter

            return CoreMLAssistantDrafter.load(path, verifier, compute_units, info)
        require_coreml()
        if not info:
            raise ModelLoadError(
                f"{path}: no edgespec export info in the package; re-export it with `edgespec convert`"
            )
        if info.get("kind") == "dflash":  # a DFlash block drafter: the package in place of its MLX layers
            from edgespec.drafters.dflash import from_package

            return from_package(path, verifier, info, compute_units)
        if info.get("kind") == "mtp":  # Qwen3.5's MTP head: drafts from the verifier's hidden states
            from edgespec.drafters.mtp import MTPDrafter

            return MTPDrafter.from_package(path, verifier, info, compute_units)
        vocab_map = package_vocab_map(path, info)
        backend = CoreMLBackend(path, list(info["functions"]), compute_units)
        return cls(
            backend,
            info,
            device="ane" if "NE" in compute_units or compute_units == "ALL" else "cpu",
            vocab_map=vocab_map,
        )

    def fork(self) -> CoreMLDrafter:
        """For one request (see drafters.base.ModelDrafter.fork): the same package, a Core ML
        state and committed sequence of its own."""
        from edgespec.drafters.base import fork_backend

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
