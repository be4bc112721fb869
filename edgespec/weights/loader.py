"""Load a verifier (or drafter) from a bundle, a Hugging Face folder or a GGUF file."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from edgespec.errors import ModelLoadError
from edgespec.kernels.linear import keep_transposed
from edgespec.models import model_from_config
from edgespec.models.base import quantize_as_stored
from edgespec.models.llama import Model
from edgespec.tokenizer import Tokenizer
from edgespec.weights.bundle import is_bundle, read_manifest
from edgespec.weights.formats.gguf import read_gguf
from edgespec.weights.formats.hf import read_config, read_hf, read_safetensors
from edgespec.weights.numerics import computes_as, emulate_half_products, recipe


@dataclass
class LoadedModel:
    model: Model
    tokenizer: Tokenizer
    path: Path | None
    manifest: dict[str, Any] = field(default_factory=dict)
    # The numerics setting it was loaded with (edgespec.weights.numerics): "native" or "metal".
    numerics: str = "native"

    @property
    def context_length(self) -> int:
        return int(self.model.args.max_position_embeddings)


def apply_quantization(model: nn.Module, quantization: dict[str, Any] | None) -> None:
    """Swap Linear/Embedding modules for quantized ones as recorded in the config.

    `quantization` is either {"group_size", "bits"} for all modules, optionally
    with per-module overrides keyed by module path, or per-module entries only.
    """
    if not quantization:
        return
    default = {k: quantization[k] for k in ("group_size", "bits") if k in quantization}

    def predicate(path: str, module: nn.Module):
        if not hasattr(module, "to_quantized"):
            return False
        if path in quantization:
            return dict(quantization[path])
        return dict(default) if default else False

    nn.quantize(model, class_predicate=predicate)


def build_model(config: dict[str, Any], weights: dict[str, mx.array], dtype=None) -> Model:
    """Model from an HF-style config and a complete weight dict (strict: every name must match)."""
    try:
        model = model_from_config(config)
    except ModelLoadError:
        raise
    except (TypeError, ValueError) as e:
        raise ModelLoadError(str(e)) from None
    weights = model.sanitize(weights)  # the architecture's checkpoint names -> its modules'
    if not quantize_as_stored(model, weights, config.get("quantization")):
        apply_quantization(model, config.get("quantization"))
    if dtype is not None:
        weights = {
            k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in weights.items()
        }
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise ModelLoadError(f"weights do not match the config: {e}") from None
    model.eval()
    mx.eval(model.parameters())
    keep_transposed(model)  # for inference: each product reads a kept view (kernels/linear.py)
    return model


def load_model_folder(folder: Path, dtype=None) -> Model:
    """A folder with config.json + model.safetensors (bundle or drafter sub-folder)."""
    config = read_config(folder)
    return build_model(config, read_safetensors([folder / "model.safetensors"]), dtype)


def load_bundle(folder: Path, verify_hashes: bool = True, numerics: str = "native") -> LoadedModel:
    """A bundle, read as it was written (in either numerics: a Mac reads it so too)."""
    manifest = read_manifest(folder, verify_hashes=verify_hashes)
    model = in_numerics(load_model_folder(folder), numerics)
    tokenizer = Tokenizer.from_folder(folder)
    return LoadedModel(model, tokenizer, folder, manifest, numerics=numerics)


def load_hf_folder(folder: Path, dtype=None, numerics: str = "native") -> LoadedModel:
    """A Hugging Face folder: dense float32 in the CPU's numerics; in Metal's, float16 and
    quantized as `edgespec convert` would there (an MLX-quantized folder keeps its own)."""
    how = recipe(numerics)
    config, weights = read_hf(folder)
    model = build_model(config, weights, dtype or how.dtype)
    if how.hf_quantize and not config.get("quantization"):
        quantize_dense(model, **how.hf_quantize)
    in_numerics(model, numerics)
    tokenizer = Tokenizer.from_folder(folder)
    return LoadedModel(model, tokenizer, folder, _source_manifest("hf", folder, tokenizer), numerics=numerics)


def in_numerics(model: Model, numerics: str) -> Model:
    """`model` computing in the numerics it was loaded in: in Metal's, its float16 products as
    Metal computes them also on the CPU device (edgespec.weights.numerics.emulate_half_products)."""
    if computes_as(numerics) == "metal":
        emulate_half_products(model)
    return model


def quantize_dense(model: nn.Module, group_size: int, bits: int) -> None:
    """Quantize a built model's Linear and Embedding layers as `edgespec convert --quantize`
    does (those whose input size the groups divide)."""
    nn.quantize(model, group_size=group_size, bits=bits,
                class_predicate=lambda _, m: hasattr(m, "to_quantized") and m.weight.shape[-1] % group_size == 0)
    mx.eval(model.parameters())


def load_gguf(path: Path, keep_quantized: bool = False, dtype=None, numerics: str = "native") -> LoadedModel:
    config, weights, quant, (backend, tok_config) = read_gguf(path, keep_quantized)
    if quant:
        config = {**config, "quantization": quant}
    arrays = {k: mx.array(v) for k, v in weights.items()}
    model = in_numerics(build_model(config, arrays, dtype), numerics)
    tokenizer = Tokenizer(backend, tok_config)
    return LoadedModel(model, tokenizer, path, _source_manifest("gguf", path, tokenizer), numerics=numerics)


def _source_manifest(fmt: str, path: Path, tokenizer: Tokenizer) -> dict[str, Any]:
    """What a bundle's manifest would say about a model read straight from its source: the
    format, the name (shipped drafters are found by it) and the vocabulary hash (drafter checks,
    history key)."""
    return {"source": {"format": fmt, "name": Path(path).name}, "vocab_hash": tokenizer.vocab_hash()}


def gguf_device_defaults(numerics: str = "native") -> dict[str, Any]:
    """How a GGUF is read in these numerics (edgespec.weights.numerics.RECIPES), as `edgespec
    convert`'s defaults would convert it: dense fp32 on the CPU (MLX's CPU quantized matmul gains
    nothing from batching a verify pass), its exactly-mappable blocks kept quantized with fp16
    activations on Metal or with numerics="metal"."""
    how = recipe(numerics)
    metal = computes_as(numerics) == "metal"
    return {"keep_quantized": how.keep_quantized, "dtype": how.dtype if metal else None, "numerics": numerics}


def is_gguf(path: Path) -> bool:
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def load(path: str | Path, verify_hashes: bool = True, numerics: str = "native") -> LoadedModel:
    """Load from a bundle folder, an HF folder or a GGUF file (detected by content), in the
    numerics `numerics` ("native" or "metal": edgespec.weights.numerics)."""
    path = Path(path).expanduser()
    if not path.exists():
        raise ModelLoadError(f"{path}: no such file or folder")
    if is_bundle(path):
        return load_bundle(path, verify_hashes, numerics=numerics)
    if path.is_dir() and (path / "config.json").is_file():
        return load_hf_folder(path, numerics=numerics)
    if is_gguf(path):
        return load_gguf(path, **gguf_device_defaults(numerics))
    if path.is_dir():
        raise ModelLoadError(
            f"{path}: neither an edgespec bundle (manifest.json) nor a Hugging Face folder (config.json)"
        )
    raise ModelLoadError(f"{path}: not a GGUF file (bad magic) and not a model folder")


