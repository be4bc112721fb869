"""Which drafter a spec names and how it is loaded: the named shortcuts, then an ordered table of
drafter kinds, each a (name, detect, load) entry; the first kind whose `detect` accepts a path
loads it.

    load_drafter(engine, None)             # the bundle's own drafter, else the model's MTP head,
                                           # else a shipped one, else none
    load_drafter(engine, "mtp")            # the verifier's multi-token-prediction head (Qwen3.5)
    load_drafter(engine, "self")           # skip-layer self-speculation (no extra weights)
    load_drafter(engine, "int8")           # the verifier's own weights in int8 (CPU device)
    load_drafter(engine, "prompt_lookup")  # n-gram lookup in the prompt
    load_drafter(engine, "path/to/drafter")
    load_drafter(engine, "none")
    attach_drafter(engine, spec)           # the same, attached to the engine (replacing any)

Adding a drafter kind is one module (a class with `caps`, a `load(path, engine)` classmethod
and a `detect(path)` function, usually reading a marker file of its folder) and one line in
KINDS below, placed before every entry whose `detect` would also accept its folders (the MLX
model folder entry accepts any folder, so it stays last). A `detect` must be cheap and must
not raise for folders of other kinds; a Core ML package's export info (its "kind") is read
once per path and shared by the package entries (`Candidate.package_kind`). DFlash, for
example (edgespec.drafters.dflash), is these two lines:

    DrafterKind("coreml-dflash", lambda c: c.package_kind == DFLASH_PACKAGE, ...),
    DrafterKind("dflash", lambda c: is_dflash_folder(c.path), lambda c, e: load_dflash(c.path, e)),
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from edgespec.drafters.assistant import AssistantDrafter, is_assistant_folder
from edgespec.drafters.base import Drafter
from edgespec.drafters.compat import check_package_vocabulary
from edgespec.drafters.coreml import CoreMLDrafter
from edgespec.drafters.coreml_assistant import KIND as ASSISTANT_PACKAGE
from edgespec.drafters.coreml_assistant import CoreMLAssistantDrafter
from edgespec.drafters.coreml_runtime import CoreMLUnavailable, open_package, require_coreml
from edgespec.drafters.dflash import DFLASH_PACKAGE, from_package, is_dflash_folder, load_dflash
from edgespec.drafters.distilled import DistilledDrafter, is_distilled_folder
from edgespec.drafters.eagle3 import is_eagle3_folder, load_eagle3
from edgespec.drafters.eagle3_coreml import EAGLE3_PACKAGE
from edgespec.drafters.eagle3_coreml import from_package as eagle3_from_package
from edgespec.drafters.feature import FeatureDrafter, is_feature_folder
from edgespec.drafters.mlx_drafter import MLXDrafter
from edgespec.drafters.mtp import MTP_PACKAGE, MTPDrafter, has_mtp
from edgespec.drafters.prompt_lookup import PromptLookupDrafter
from edgespec.drafters.quantized import QuantizedDrafter
from edgespec.drafters.quantized import available as quantized_available
from edgespec.drafters.self_spec import self_drafter
from edgespec.errors import ModelLoadError
from edgespec.weights.numerics import computes_as

DATA = Path(__file__).resolve().parent.parent / "data" / "drafters"


class Candidate:
    """A path being matched against the kinds, for one engine. A Core ML package is opened once
    (compute units, Manifest.json, export info, vocabulary against the verifier) the first time
    an entry asks for its kind."""

    def __init__(self, path: Path, engine, compute_units: str = "CPU_AND_NE"):
        self.path, self.engine, self.compute_units = path, engine, compute_units
        self.is_package = path.suffix == ".mlpackage"

    @cached_property
    def info(self) -> dict[str, Any]:
        """The package's export info ({} for a package without edgespec's), checked."""
        self.path, info = open_package(self.path, self.compute_units)
        check_package_vocabulary(info, self.engine)
        return info

    @property
    def package_kind(self) -> str | None:
        """A package's kind ("drafter" for a plain one), None for a folder."""
        return (self.info.get("kind") or "drafter") if self.is_package else None


@dataclass(frozen=True)
class DrafterKind:
    name: str
    detect: Callable[[Candidate], bool]
    load: Callable[[Candidate, Any], Drafter]


def _mtp_package(c: Candidate, engine) -> Drafter:
    require_coreml()
    return MTPDrafter.from_package(c.path, engine, c.info, c.compute_units)


def _dflash_package(c: Candidate, engine) -> Drafter:
    require_coreml()
    return from_package(c.path, engine, c.info, c.compute_units)


def _eagle3_package(c: Candidate, engine) -> Drafter:
    require_coreml()
    return eagle3_from_package(c.path, engine, c.info, c.compute_units)


# Ordered: the first kind that detects a path loads it (see the module docstring).
KINDS: tuple[DrafterKind, ...] = (
    # Core ML packages (drafter.mlpackage), by the kind their export info records
    DrafterKind("coreml-gemma4-assistant", lambda c: c.package_kind == ASSISTANT_PACKAGE,
                lambda c, e: CoreMLAssistantDrafter.load(c.path, e, c.compute_units, c.info)),
    DrafterKind("coreml-mtp", lambda c: c.package_kind == MTP_PACKAGE, _mtp_package),
    DrafterKind("coreml-dflash", lambda c: c.package_kind == DFLASH_PACKAGE, _dflash_package),
    DrafterKind("coreml-eagle3", lambda c: c.package_kind == EAGLE3_PACKAGE, _eagle3_package),
    DrafterKind("coreml", lambda c: c.is_package,
                lambda c, e: CoreMLDrafter.from_info(c.path, c.info, c.compute_units)),
    # MLX folders, by their marker files
    DrafterKind("dflash", lambda c: is_dflash_folder(c.path), lambda c, e: load_dflash(c.path, e)),
    DrafterKind("eagle3", lambda c: is_eagle3_folder(c.path), lambda c, e: load_eagle3(c.path, e)),
    DrafterKind("gemma4-assistant", lambda c: is_assistant_folder(c.path),  # reads the verifier's cache
                lambda c, e: AssistantDrafter.load(c.path, e)),
    DrafterKind("feature", lambda c: is_feature_folder(c.path), lambda c, e: FeatureDrafter.load(c.path, e)),
    DrafterKind("distilled", lambda c: is_distilled_folder(c.path), lambda c, e: DistilledDrafter.load(c.path, e)),
    DrafterKind("mlx", lambda c: True, lambda c, e: MLXDrafter.load(c.path, e)),  # any model folder: last
)

# Named drafters (no path): spec -> engine -> Drafter or None.
SHORTCUTS: dict[str, Callable[[Any], Drafter | None]] = {
    "none": lambda engine: None,
    "self": self_drafter,
    "mtp": MTPDrafter.load,
    "prompt_lookup": lambda engine: PromptLookupDrafter(),
    "int8": QuantizedDrafter.load,  # the verifier's own weights in int8 (CPU device, Llama-style)
}


def load_path(path: str | Path, engine) -> Drafter:
    """The drafter at `path` (a folder or a .mlpackage), by the first kind that detects it."""
    cand = Candidate(Path(path).expanduser(), engine)
    for kind in KINDS:
        if kind.detect(cand):
            return kind.load(cand, engine)
    raise ModelLoadError(f"{path}: not a drafter folder or package")  # unreachable: "mlx" takes any


def shipped_drafter_path(engine) -> Path | None:
    """A distilled drafter shipped with edgespec for this model (edgespec/data/drafters/<name>/)."""
    loaded = engine.loaded
    names = []
    src = (loaded.manifest or {}).get("source") or {}
    if src.get("name"):
        names.append(str(src["name"]).split(".")[0])
    if loaded.path is not None:
        names.append(Path(loaded.path).name)
    for name in names + [n.lower() for n in names]:  # shipped folders are lower-case
        for cand in (DATA / name, DATA / name.rsplit("-", 1)[0]):
            if (cand / "config.json").is_file() and (cand / "model.safetensors").is_file():
                return cand
    return None


def _bundle_drafter(engine):
    """The bundle's own drafter: Core ML (drafter.mlpackage) when it runs here, else drafter/ in MLX."""
    path = engine.loaded.path
    if path is None or not Path(path).is_dir():
        return None
    folder = Path(path) / "drafter"
    if (Path(path) / "drafter.mlpackage").exists():
        try:
            return load_path(Path(path) / "drafter.mlpackage", engine)
        except CoreMLUnavailable as e:
            if folder.is_dir():
                engine.drafter_notes.append(f"Core ML drafter unavailable ({e}); using its MLX copy")
    if folder.is_dir():
        return load_path(folder, engine)
    return None


def load_drafter(engine, spec):
    """Resolve a drafter spec (see the module docstring) to a Drafter or None."""
    if spec is None:
        d = _bundle_drafter(engine)
        if d is not None:
            return d
        if has_mtp(engine.loaded.model):  # a head that ships inside the checkpoint
            return MTPDrafter.load(engine)
        shipped = shipped_drafter_path(engine)
        return load_path(shipped, engine) if shipped is not None else None
    if not isinstance(spec, (str, Path)):
        raise ValueError(f"drafter must be None, 'none', 'self', 'int8', 'prompt_lookup', 'mtp' or a path, got {spec!r}")
    s = str(spec)
    if s in SHORTCUTS:
        return SHORTCUTS[s](engine)
    path = Path(s).expanduser()
    if not path.exists():
        raise ModelLoadError(f"drafter {s!r}: no such file or folder (valid: none, self, int8, prompt_lookup, mtp, "
                             "or a path)")
    return load_path(path, engine)


# What mode `auto` drafts with when no drafter is named at load, per the numerics the verifier
# computes in ("cpu" or "metal": edgespec.weights.numerics.computes_as; a Mac's GPU and
# numerics="metal" on any device are "metal"): the candidates in order, the first that applies
# is chosen.
#   bundle   the bundle's own drafter (drafter.mlpackage on the Neural Engine, or drafter/)
#   mtp      the model's multi-token-prediction head
#   int8     the verifier's own weights in int8 (edgespec.drafters.quantized)
#   shipped  the distilled drafter edgespec ships for this model (edgespec/data/drafters)
AUTO_DRAFTERS: dict[str, tuple[str, ...]] = {
    "cpu": ("bundle", "mtp", "int8", "shipped"),
    "metal": ("bundle", "mtp", "shipped", "int8"),
}
# Candidates a numerics never takes, whatever the model, and the one line that says why.
NEVER: dict[tuple[str, str], str] = {
    ("metal", "int8"): "it drafts on the CPU device only (its native pass reads dense weights and float32 caches; "
                       "on Metal the verifier is 4-bit with float16 caches, and MLX's quantized products are the tool)",
}


def _int8_off() -> bool:
    return os.environ.get("EDGESPEC_INT8_DRAFTER", "on").strip().lower() in ("0", "off", "false", "no")


def _why_not(name: str, engine) -> str | None:
    """Why candidate `name` cannot draft for `engine` (None: it can). Cheap: loads nothing."""
    model = engine.loaded.model
    if name == "bundle":
        return None if _bundle_has_drafter(engine) else "the model is not a bundle with a drafter of its own"
    if name == "mtp":
        return None if has_mtp(model) else "the model has no multi-token-prediction head"
    if name == "int8":
        if _int8_off():
            return "turned off (EDGESPEC_INT8_DRAFTER=off)"
        return quantized_available(model)
    if name == "shipped":
        return None if shipped_drafter_path(engine) is not None else "edgespec ships no distilled drafter for this model"
    raise ValueError(f"unknown auto drafter candidate {name!r}")


def auto_drafter_choice(engine) -> tuple[str | None, dict[str, str]]:
    """What mode `auto` drafts with for `engine` when no drafter was named at load, and why it
    passed over each other candidate, from the table AUTO_DRAFTERS for the numerics its
    verifier computes in (a Mac's GPU or numerics="metal": "metal"; else "cpu").

    auto_drafter_choice(engine) -> (chosen, passed)
        chosen: "bundle", "mtp", "int8", "shipped" (see AUTO_DRAFTERS), or None when auto drafts
                from weight-free sources only (context n-grams, history, the Jacobi window)
        passed: {candidate: one-line reason} for every other candidate of the table's row

    Loads nothing (a `doctor` report can call it). A drafter named at load
    (`edgespec.load(drafter=...)`, `--drafter`) or a memory budget it does not fit overrides it.
    """
    numerics = "metal" if computes_as(getattr(engine.loaded, "numerics", "native")) == "metal" else "cpu"
    chosen, passed = None, {}
    for name in AUTO_DRAFTERS[numerics]:
        why = NEVER.get((numerics, name)) or _why_not(name, engine)
        if why is None and chosen is None:
            chosen = name
        elif why is None:
            passed[name] = f"it would draft, but {chosen} comes first on {'Metal' if numerics == 'metal' else 'the CPU'}"
        else:
            passed[name] = why
    return chosen, passed


def auto_drafter(engine):
    """The drafter mode auto drafts with when none was named at load, beside the attached one:
    the verifier itself in int8 (edgespec.drafters.quantized) where auto_drafter_choice picks it
    (the CPU's numerics, a Llama-style verifier, the kernel built, no drafter of the bundle's own
    nor an MTP head); EDGESPEC_INT8_DRAFTER=off turns it off. None: auto drafts with the attached
    drafter (the bundle's, the MTP head, the shipped one), which load_drafter(engine, None) loads."""
    chosen, _ = auto_drafter_choice(engine)
    return QuantizedDrafter.load(engine) if chosen == "int8" else None


def _bundle_has_drafter(engine) -> bool:
    path = engine.loaded.path
    return path is not None and Path(path).is_dir() and any(
        (Path(path) / name).exists() for name in ("drafter", "drafter.mlpackage"))


def attach_drafter(engine, spec=None):
    """Load the drafter named by `spec` and attach it to the engine (replacing any). Returns it."""
    old = engine.drafter
    engine.drafter = load_drafter(engine, spec)
    if spec is not None:
        engine.auto_drafter = None  # a drafter named: auto drafts with it
    if old is not None and old is not engine.drafter:
        old.close()
    folder = Path(spec).expanduser() if spec is not None and str(spec) not in SHORTCUTS else None
    engine.set_drafter_folder(folder if folder is not None and folder.is_dir() else None)
    return engine.drafter
