"""Running an edgespec Core ML package: where Core ML runs (macOS 15+, coremltools), the export
info a package carries, the backends that call its functions with one shared state, and the
checks every package kind passes before it is loaded (`open_package`).

A backend is a small object (`call(...)`, `reset()`), so the drafting logic above it runs
here on Linux against the numpy MIL executor (tests) and on a Mac against Core ML.
"""

from __future__ import annotations

import copy
import json
import platform
import sys
from pathlib import Path
from typing import Any

import numpy as np

from edgespec.drafters.base import fork_backend
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
            # coremltools is optional (macOS, the convert extra): imported only where a package runs
            import coremltools as ct  # optional: coremltools
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
        # coremltools is optional (macOS, the convert extra): imported only where a package runs
        import coremltools as ct  # optional: coremltools
    except ImportError:
        return {}
    try:
        meta = ct.models.MLModel(str(path), skip_model_load=True).user_defined_metadata
        return json.loads(meta.get(METADATA_KEY, "{}"))
    except Exception as e:  # damaged protobuf: no common exception base
        raise ModelLoadError(
            f"{path}: cannot read the Core ML package ({type(e).__name__}: {e}); re-export it"
        ) from None


def package_hidden(rows: np.ndarray) -> np.ndarray:
    """(T, E) rows -> the package's channels-first (1, E, 1, T) fp16 input."""
    return np.ascontiguousarray(rows.T[None, :, None, :]).astype(np.float16)


def package_rows(x: np.ndarray) -> np.ndarray:
    """A package output (1, C, 1, T) -> (T, C) float32."""
    x = np.asarray(x, np.float32)
    return x.reshape(x.shape[1], x.shape[3]).T


def units_device(compute_units: str) -> str:
    """The device a package runs on under these compute units: "ane" or "cpu"."""
    return "ane" if "NE" in compute_units or compute_units == "ALL" else "cpu"


def open_package(path: str | Path, compute_units: str = "CPU_AND_NE") -> tuple[Path, dict[str, Any]]:
    """(path, export info) of a package, after the checks every package kind passes first:
    valid compute units, a real .mlpackage. The info is {} for a package without edgespec's."""
    path = Path(path).expanduser()
    if compute_units not in COMPUTE_UNITS:
        raise ValueError(
            f"compute_units must be one of {', '.join(COMPUTE_UNITS)}, got {compute_units!r}"
        )
    if not (path / "Manifest.json").is_file():
        raise ModelLoadError(f"{path}: not a Core ML .mlpackage (no Manifest.json)")
    return path, read_package_info(path)


def package_features(rows: np.ndarray) -> np.ndarray:
    """(S, F) rows -> the package's channels-first (1, F, 1, S) fp16 input."""
    return np.ascontiguousarray(rows.T[None, :, None, :]).astype(np.float16)


class CoreMLBlockBackend:
    """Runs a DFlash package's functions (edgespec.drafters.dflash) with Core ML (macOS 15+), all
    sharing one state."""

    def __init__(self, path: Path, functions: list[str], compute_units: str):
        import coremltools as ct  # optional (macOS): require_coreml ran first (drafters.registry)

        cu = getattr(ct.ComputeUnit, compute_units)
        self.models = {f: ct.models.MLModel(str(path), compute_units=cu, function_name=f) for f in functions}
        self.reset()

    def reset(self) -> None:
        self.state = self.models["feed_1"].make_state()

    def call(self, function: str, rows: np.ndarray, ids: np.ndarray, position: int):
        out = self.models[function].predict({"features": package_features(rows), "input_ids": ids,
                                             "position": np.array([position], np.int32)}, state=self.state)
        return package_rows(out["logits"]), package_rows(out["hidden_out"])


class PackageCursor:
    """A stateful package's position through a backend: a fixed buffer of `context` slots where
    rolling back is lowering `offset` (stale slots are masked). The MTP head's and the DFlash
    drafter's packages (drafters.mtp.CoreMLHead, drafters.dflash.PackageBlock) build on it."""

    def __init__(self, backend, info: dict[str, Any]):
        self.backend = backend
        self.context = int(info["context_length"])
        self.offset = 0

    def reset(self) -> None:
        self.backend.reset()
        self.offset = 0

    def fork(self):
        """For one request: the same loaded functions, a state of its own at position 0."""
        twin = copy.copy(self)
        twin.backend, twin.offset = fork_backend(self.backend), 0
        return twin

    def trim_to(self, n: int) -> None:
        self.offset = min(self.offset, n)

