"""Drafters for speculative decoding and how an Engine gets one.

    attach_drafter(engine, None)             # the bundle's own drafter, else the model's MTP head,
                                             # else a shipped one, else none
    attach_drafter(engine, "mtp")            # the verifier's multi-token-prediction head (Qwen3.5)
    attach_drafter(engine, "self")           # skip-layer self-speculation (no extra weights)
    attach_drafter(engine, "prompt_lookup")  # n-gram lookup in the prompt
    attach_drafter(engine, "path/to/drafter")
    attach_drafter(engine, "none")
"""

from __future__ import annotations

from pathlib import Path

from edgespec.drafters.base import Draft, Drafter, ModelDrafter

__all__ = ["Draft", "Drafter", "ModelDrafter", "attach_drafter", "shipped_drafter_path", "load_drafter"]

DATA = Path(__file__).resolve().parent.parent / "data" / "drafters"


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
        from edgespec.drafters.coreml import CoreMLDrafter, CoreMLUnavailable

        try:
            return CoreMLDrafter.load(Path(path) / "drafter.mlpackage", engine)
        except CoreMLUnavailable as e:
            note = f"Core ML drafter unavailable ({e}); using its MLX copy"
            if folder.is_dir():
                engine.drafter_notes = getattr(engine, "drafter_notes", []) + [note]
    if folder.is_dir():
        return _model_drafter(folder, engine)
    return None


def load_drafter(engine, spec):
    """Resolve a drafter spec (see attach_drafter) to a Drafter or None."""
    if spec is None:
        d = _bundle_drafter(engine)
        if d is not None:
            return d
        from edgespec.drafters.mtp import MTPDrafter, has_mtp

        if has_mtp(engine.loaded.model):  # a head that ships inside the checkpoint
            return MTPDrafter.load(engine)
        shipped = shipped_drafter_path(engine)
        if shipped is not None:
            return _model_drafter(shipped, engine)
        return None
    if not isinstance(spec, (str, Path)):
        raise ValueError(f"drafter must be None, 'none', 'self', 'prompt_lookup', 'mtp' or a path, got {spec!r}")
    s = str(spec)
    if s == "none":
        return None
    if s == "self":
        from edgespec.drafters.self_spec import self_drafter

        return self_drafter(engine)
    if s == "mtp":
        from edgespec.drafters.mtp import MTPDrafter

        return MTPDrafter.load(engine)
    if s == "prompt_lookup":
        from edgespec.drafters.prompt_lookup import PromptLookupDrafter

        return PromptLookupDrafter()
    path = Path(s).expanduser()
    if not path.exists():
        from edgespec.errors import ModelLoadError

        raise ModelLoadError(f"drafter {s!r}: no such file or folder (valid: none, self, prompt_lookup, mtp, "
                             "or a path)")
    if path.suffix == ".mlpackage":
        from edgespec.drafters.coreml import CoreMLDrafter

        return CoreMLDrafter.load(path, engine)
    return _model_drafter(path, engine)


def _model_drafter(path: Path, engine):
    """MLX drafter folder: a distilled one (reduced vocab, vocab_map.json) or a plain model."""
    from edgespec.drafters.assistant import AssistantDrafter, is_assistant_folder
    from edgespec.drafters.dflash import is_dflash_folder, load_dflash
    from edgespec.drafters.distilled import DistilledDrafter, is_distilled_folder
    from edgespec.drafters.feature import FeatureDrafter, is_feature_folder

    if is_dflash_folder(path):  # a DFlash block drafter: reads the verifier's target-layer states
        return load_dflash(path, engine)
    if is_assistant_folder(path):  # Gemma 4's assistant: reads the verifier's keys and hidden state
        return AssistantDrafter.load(path, engine)
    if is_feature_folder(path):
        return FeatureDrafter.load(path, engine)
    if is_distilled_folder(path):
        return DistilledDrafter.load(path, engine)
    from edgespec.drafters.mlx_drafter import MLXDrafter

    return MLXDrafter.load(path, engine)


def attach_drafter(engine, spec=None):
    """Load the drafter named by `spec` and attach it to the engine (replacing any). Returns it."""
    old = engine.drafter
    engine.drafter = load_drafter(engine, spec)
    if old is not None and old is not engine.drafter:
        old.close()
    return engine.drafter
