"""Put a drafter into a bundle being written: OUT/drafter/ (MLX) and OUT/drafter.mlpackage (Core ML).

Called by `convert` inside its atomic temp folder, so an interrupted export
leaves nothing behind. The drafter must share the verifier's vocabulary.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from edgespec.errors import ModelLoadError


def load_drafter_source(src: Path):
    """-> (LoadedModel-like: .model, .tokenizer or None). HF folder, GGUF, bundle, or bare MLX folder."""
    from edgespec.loader import LoadedModel, is_gguf, load, load_model_folder

    src = Path(src).expanduser()
    if not src.exists():
        raise ModelLoadError(f"drafter {src}: no such file or folder")
    bare = (
        src.is_dir()
        and (src / "model.safetensors").is_file()
        and not (src / "tokenizer.json").is_file()
    )
    if bare and not is_gguf(src):  # e.g. an existing bundle's drafter/ folder: weights only
        return LoadedModel(load_model_folder(src), None, src)
    return load(src)


def write_drafter(
    folder: Path,
    src: str | Path,
    verifier_vocab: int,
    verifier_hash: str,
    dtype,
    coreml: bool = True,
    compress: str = "none",
    context_length: int = 1024,
    prefill_chunk: int = 64,
    decode_tokens: tuple[int, ...] = (1, 2),
    progress=None,
) -> dict[str, Any]:
    """Write the drafter into `folder` (the bundle's temp folder); returns the manifest's `drafter` entry.

    decode_tokens: 2 by default because after a fully accepted round the
    drafter has two unseen tokens (its last draft and the verifier's bonus).
    """
    import mlx.core as mx
    from edgespec.converters.bundle import write_model_files
    from edgespec.converters.coreml_export import COMPRESS_CHOICES, _dense_params, export_drafter

    from edgespec.drafters.mlx_drafter import check_vocabulary

    if compress not in COMPRESS_CHOICES:
        raise ValueError(
            f"--drafter-compress must be one of {', '.join(COMPRESS_CHOICES)}, got {compress!r}"
        )
    if compress != "none" and not coreml:
        raise ValueError(
            "--drafter-compress applies to the Core ML package; it cannot be used with --no-coreml"
        )
    loaded = load_drafter_source(Path(src))
    model = loaded.model
    d_hash = loaded.tokenizer.vocab_hash() if loaded.tokenizer is not None else None
    check_vocabulary(model.args.vocab_size, verifier_vocab, d_hash, verifier_hash)
    params = {k: mx.array(v).astype(dtype) for k, v in _dense_params(model).items()}
    entry = write_model_files(folder / "drafter", model.args.to_dict(), params, None)
    out = {
        "config": "drafter/" + entry["config"],
        "weights": "drafter/" + entry["weights"],
        "num_layers": model.args.num_hidden_layers,
        "vocab_hash": verifier_hash,
        "source": {"name": Path(src).name},
        "coreml": None,
    }
    if coreml:
        try:
            import coremltools  # noqa: F401
        except ImportError:
            raise ModelLoadError(
                "exporting the Core ML drafter needs coremltools (pip install 'edgespec[convert]'); "
                "or pass --no-coreml"
            ) from None
        out["coreml"] = export_drafter(
            model,
            folder / "drafter.mlpackage",
            context_length=context_length,
            prefill_chunk=prefill_chunk,
            decode_tokens=decode_tokens,
            compress=compress,
            vocab_hash=verifier_hash,
            progress=progress,
        )
    return out
