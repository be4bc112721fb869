"""`edgespec convert`: HF folder or GGUF file -> MLX bundle (atomic)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from edgespec.converters.bundle import (
    atomic_folder,
    check_destination,
    check_overlap,
    check_replaceable,
    check_writable,
    finish_manifest,
    link_or_copy,
    write_model_files,
)
from edgespec.converters.drafter_export import write_drafter
from edgespec.converters.gguf import _open, read_gguf
from edgespec.converters.hf import read_hf
from edgespec.models import get_architecture
from mlx.utils import tree_flatten

from edgespec.drafters.assistant import is_assistant_folder
from edgespec.errors import ModelLoadError
from edgespec.progress import progress_bar
from edgespec.tokenizer import Tokenizer
from edgespec.weights.bundle import read_manifest
from edgespec.weights.loader import build_model, is_gguf

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
QUANTIZE_CHOICES = ("none", "native", "4", "8")


def default_quantize(src_is_gguf: bool) -> str:
    """Per-device default, from measurements: MLX's CPU quantized matmul costs K times one
    token for a K-token verify pass (no batching win), and dense fp32 decodes 2x faster
    than 4-bit there; on Metal quantized weights are the fast path."""
    on_gpu = mx.default_device().type == mx.DeviceType.gpu
    if on_gpu:
        return "native" if src_is_gguf else "4"
    return "none"


def default_dtype() -> str:
    # fp16 matmuls are ~3x slower than fp32 on the CPU; Metal prefers fp16.
    return "float16" if mx.default_device().type == mx.DeviceType.gpu else "float32"


def _read_source(src: Path, quantize: str, dtype, progress: bool):
    """-> (config, weights mx dict, quantization dict or None, Tokenizer, source info)."""
    if is_gguf(src):
        n = len(_open(src).tensors)
        with progress_bar(total=n, desc="reading GGUF", unit="tensor", enable=progress) as bar:
            report: dict[str, Any] = {}  # per GGUF type: exact / requantized (+ error) / dense
            config, weights, quant, (backend, tok_cfg) = read_gguf(
                src, keep_quantized=(quantize == "native"), progress=bar.update, report=report
            )
        arrays = {
            k: (mx.array(v).astype(dtype) if v.dtype.kind == "f" else mx.array(v)) for k, v in weights.items()
        }
        info = {"format": "gguf", "name": src.name, "size": src.stat().st_size, "gguf_types": report}
        return config, arrays, quant or None, Tokenizer(backend, tok_cfg), info
    if src.is_dir():
        config, weights = read_hf(src)
        own = config.pop("quantization", None)  # an MLX-quantized (mlx-community) folder's own
        if quantize == "native" and not own:
            raise ValueError("--quantize native keeps a GGUF file's or MLX folder's own quantization; "
                             "the source is neither")
        if own and quantize in ("4", "8"):
            raise ValueError(f"{src} is already MLX-quantized ({own.get('bits')}-bit, groups of "
                             f"{own.get('group_size')}): convert it with --quantize none or native to keep it")
        weights = {k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in weights.items()}
        info = {"format": "mlx" if own else "hf", "name": src.name}
        return config, weights, own, Tokenizer.from_folder(src), info
    raise ModelLoadError(f"{src}: not a GGUF file and not a Hugging Face model folder")


def quantization_error(model: nn.Module, dense: dict[str, mx.array]) -> float:
    """Largest relative error ||w' - w|| / ||w|| over the model's quantized weights."""
    worst = 0.0
    for path, m in tree_flatten(model.leaf_modules(), is_leaf=lambda x: isinstance(x, nn.Module)):
        if not hasattr(m, "scales") or f"{path}.weight" not in dense:
            continue
        w = dense[f"{path}.weight"].astype(mx.float32)
        back = mx.dequantize(m.weight, m.scales, m.biases, group_size=m.group_size, bits=m.bits)
        err = mx.linalg.norm((back - w).flatten()) / mx.maximum(mx.linalg.norm(w.flatten()), 1e-30)
        worst = max(worst, float(err))
    return worst


def convert(
    src: str | Path,
    out: str | Path,
    quantize: str | None = None,
    dtype: str | None = None,
    group_size: int = 64,
    force: bool = False,
    progress: bool = True,
    drafter: str | Path | None = None,
    drafter_options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Convert and write a bundle; returns its manifest.

    drafter: optional drafter checkpoint (HF folder, GGUF, bundle or MLX folder) written to
    drafter/ and, unless drafter_options["coreml"] is False, drafter.mlpackage (see
    converters/drafter_export.write_drafter for the other options); "mtp": the source's own
    MTP head (kept in model.safetensors in any case) exported to drafter.mlpackage
    (converters/mtp_export.py, through write_drafter).
    """
    src, out = Path(src).expanduser(), Path(out).expanduser()
    if not src.exists():
        raise ModelLoadError(f"{src}: no such file or folder")
    # Before the work: never over the source, and with force only over what edgespec wrote.
    check_destination(src, out, force)
    if drafter is None and src.is_dir():  # Gemma 4's assistant beside it, as loading the folder uses it
        if is_assistant_folder(src / "drafter"):
            drafter = src / "drafter"
    mtp = drafter is not None and str(drafter) == "mtp"  # the source's own MTP head (Qwen3.5)
    if drafter is not None and not mtp:
        check_overlap(drafter, out)  # nor over the drafter's checkpoint
    quantize = quantize or default_quantize(is_gguf(src))
    if quantize not in QUANTIZE_CHOICES:
        raise ValueError(f"--quantize must be one of {', '.join(QUANTIZE_CHOICES)}, got {quantize!r}")
    dtype = dtype or default_dtype()
    if dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    config, weights, quant, tokenizer, info = _read_source(src, quantize, DTYPES[dtype], progress)
    if quant:
        config = {**config, "quantization": quant}
    model = build_model(config, weights)  # validates names and shapes before anything is written
    requant = None
    if quantize in ("4", "8"):
        bits = int(quantize)
        dense = dict(tree_flatten(model.parameters()))
        nn.quantize(model, group_size=group_size, bits=bits)
        quant = {"group_size": group_size, "bits": bits}
        requant = {**quant, "max_rel_error": quantization_error(model, dense)}
    params = dict(tree_flatten(model.parameters()))
    config.pop("quantization", None)
    with atomic_folder(out, force=force) as tmp:
        entry = write_model_files(tmp, config, params, quant)
        tokenizer.save(tmp)
        manifest = {
            "source": info,
            "vocab_hash": tokenizer.vocab_hash(),
            "verifier": {**entry, "dtype": dtype},
        }
        if requant is not None:
            manifest["quantization"] = requant
        if drafter is not None:
            manifest["drafter"] = write_drafter(
                tmp, drafter, model.args.vocab_size, manifest["vocab_hash"], DTYPES[dtype],
                tokenizer=tokenizer, progress=progress, verifier_args=model.args, **(drafter_options or {}),
            )  # fmt: skip
        with progress_bar(total=None, desc="checksums", unit="file", enable=progress) as bar:
            finish_manifest(tmp, manifest, progress=lambda _: bar.update(1))

    return read_manifest(out, verify_hashes=False)


def _is_drafter_file(name: str) -> bool:
    return name.startswith(("drafter/", "drafter.mlpackage/"))


def add_drafter(
    bundle: str | Path,
    drafter: str | Path,
    force: bool = False,
    progress: bool = True,
    drafter_options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Add (or with force, replace) the drafter of an existing bundle; returns the new manifest.

    Atomic like `convert`: a new bundle folder is assembled beside the old one
    (the verifier's files hard-linked, not copied; their recorded checksums kept),
    the drafter written into it (vocabulary checked first: a drafter for another
    tokenizer is refused), the manifest rewritten, and only then swapped into
    place. An error or interrupt leaves the old bundle as it was. A bundle holding
    files edgespec did not write (a notes.txt dropped into it) is refused, before any work
    and again at the swap: replacing it would delete them.
    """
    bundle = Path(bundle).expanduser()
    manifest = read_manifest(bundle, verify_hashes=False)  # sizes checked: no truncated file carried over
    check_replaceable(bundle, force=True, label="BUNDLE")
    check_writable(bundle, label="BUNDLE")
    if manifest.get("drafter") and not force:
        raise FileExistsError(
            f"{bundle} already has a drafter ({manifest['drafter'].get('source', {}).get('name', 'drafter/')}); "
            "pass --force to replace it"
        )
    verifier = manifest.get("verifier") or {}
    config = json.loads((bundle / verifier.get("config", "config.json")).read_text())
    vocab_size = int(config.get("vocab_size", -1))
    try:  # the verifier's args: Gemma 4's assistant is checked against them and its package shaped by them
        arch = get_architecture(config.get("model_type"))
        verifier_args = arch.ModelArgs.from_dict(config)
    except (ModelLoadError, TypeError, ValueError):
        verifier_args = None
    dtype = DTYPES.get(verifier.get("dtype") or default_dtype(), mx.float32)
    carried = {n: e for n, e in manifest["files"].items() if not _is_drafter_file(n)}
    with atomic_folder(bundle, force=True, label="BUNDLE") as tmp:
        for name in carried:
            link_or_copy(bundle / name, tmp / name)
        entry = write_drafter(tmp, drafter, vocab_size, manifest["vocab_hash"], dtype,
                              progress=progress,
                              tokenizer=Tokenizer.from_folder(bundle) if (drafter_options or {}).get("calibrate") else None,
                              verifier_tokenizer=Tokenizer.from_folder(bundle), verifier_args=verifier_args,
                              **(drafter_options or {}))  # fmt: skip
        new = {k: v for k, v in manifest.items() if k not in ("format", "format_version", "files")}
        new["drafter"] = entry
        with progress_bar(total=None, desc="checksums", unit="file", enable=progress) as bar:
            finish_manifest(tmp, new, progress=lambda _: bar.update(1), known=carried)
    return read_manifest(bundle, verify_hashes=False)
