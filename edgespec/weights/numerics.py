"""The numerics a model is loaded and run in: the device's own, or a Mac's on any device.

    numerics="native"  the device's own choice (the default): dense float32 on the CPU device,
                       what Metal runs on the GPU device
    numerics="metal"   load and run the model as Metal would, on whatever device runs it: a
                       GGUF's blocks kept quantized (MLX 4-bit), a Hugging Face folder quantized
                       as `edgespec convert` would there (4-bit, groups of 64), float16 weights
                       and activations, so float16 KV caches; drafters load in float16 and `auto`
                       picks its drafter as on a Mac (edgespec.drafters.registry.auto_drafter_choice)

On the CPU device the products of float16 activations are computed as Metal's kernels compute
them, float16 in, float32 sums, float16 out, from float32 copies of the weights (MLX's CPU
backend multiplies in float16 40-100x slower than in float32: a SmolLM2 step took 25 s;
`emulate_half_products`). The values are those of the float16 weights; the summation order, as
between any two devices, is the CPU's.

The setting is read once per load (`edgespec.load(numerics=...)`, `--numerics`, else
$EDGESPEC_NUMERICS) and kept on the LoadedModel; nothing on the hot path reads it. The KV
caches follow by themselves: a cache takes the dtype of the keys and values the model computes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from edgespec.kernels import exact
from edgespec.kernels.linear import Linear, QuantizedLinear

NUMERICS = ("native", "metal")
ENV = "EDGESPEC_NUMERICS"


def resolve(numerics: str | None = None) -> str:
    """The setting for a load: `numerics` when given, else $EDGESPEC_NUMERICS, else "native".
    A value not in NUMERICS raises ValueError (one line naming the valid ones) before any load."""
    source = "numerics"
    if numerics is None:
        numerics, source = os.environ.get(ENV, "").strip() or "native", ENV
    if not isinstance(numerics, str) or numerics.strip().lower() not in NUMERICS:
        raise ValueError(f"{source} must be one of {', '.join(NUMERICS)}, got {numerics!r}")
    return numerics.strip().lower()


def computes_as(numerics: str = "native") -> str:
    """What a model loaded with the setting `numerics` computes as here: "metal" on the GPU
    device or with numerics="metal", "cpu" otherwise (the keys of RECIPES)."""
    if numerics == "metal" or mx.default_device().type == mx.DeviceType.gpu:
        return "metal"
    return "cpu"


def runs_as_metal(verifier) -> bool:
    """Whether `verifier` (an Engine, a LoadedModel) computes as Metal would: drafters load in
    its numerics, and `auto` picks its drafter for it as on a Mac."""
    loaded = getattr(verifier, "loaded", verifier)
    return computes_as(getattr(loaded, "numerics", "native")) == "metal"


@dataclass(frozen=True)
class Recipe:
    """How a model source is read in one numerics (edgespec.weights.loader)."""

    keep_quantized: bool  # a GGUF's exactly-mappable blocks kept as MLX quantized weights
    dtype: mx.Dtype  # dense weights and activations (so the KV caches)
    hf_quantize: dict | None  # a dense Hugging Face folder quantized as convert would, or kept dense


# As `edgespec convert`'s defaults would convert each source on that device
# (converters.convert.default_quantize / default_dtype): dense float32 on the CPU (MLX's CPU
# quantized product gains nothing from batching a verify pass, and float16 computes several
# times slower there); quantized weights with float16 activations on Metal. A bundle is read as
# it was written, in either.
RECIPES = {
    "cpu": Recipe(keep_quantized=False, dtype=mx.float32, hf_quantize=None),
    "metal": Recipe(keep_quantized=True, dtype=mx.float16, hf_quantize={"group_size": 64, "bits": 4}),
}


def recipe(numerics: str = "native") -> Recipe:
    return RECIPES[computes_as(numerics)]


def _f32(module: nn.Module, names: tuple[str, ...]) -> tuple:
    """float32 copies of `module`'s parameters `names` (None where absent), kept beside the
    module (outside its parameter tree) while the parameters are the ones they were taken of."""
    now = tuple(module[n] if n in module else None for n in names)
    kept = module.__dict__.get("_f32")
    if kept is None or any(a is not b for a, b in zip(kept[0], now, strict=True)):
        copies = tuple(None if a is None else a.astype(mx.float32) for a in now)
        module.__dict__["_f32"] = kept = (now, copies)
    return kept[1]


def _quantized_product(module: nn.Module, x: mx.array) -> mx.array:
    w = module["weight"]
    scales, biases = _f32(module, ("scales", "biases"))
    return mx.quantized_matmul(x.astype(mx.float32), w, scales=scales, biases=biases, transpose=True,
                               group_size=module.group_size, bits=module.bits, mode=module.mode)


class HalfLinear(Linear):
    """A float16 Linear on the CPU device: float32 sums of float16 inputs, rounded to float16."""

    def __call__(self, x: mx.array) -> mx.array:
        if x.dtype != mx.float16 or mx.default_device() != mx.cpu:
            return super().__call__(x)
        w, b = _f32(self, ("weight", "bias"))
        if exact.enabled():  # bitwise verification (kernels/exact.py), on the float32 copies
            return exact.exact_linear(x.astype(mx.float32), w, b).astype(mx.float16)
        y = x.astype(mx.float32) @ w.T
        return (y if b is None else y + b).astype(mx.float16)


class HalfQuantizedLinear(QuantizedLinear):
    """A quantized Linear with float16 scales on the CPU device, as HalfLinear."""

    def __call__(self, x: mx.array) -> mx.array:
        if x.dtype != mx.float16 or mx.default_device() != mx.cpu:
            return super().__call__(x)
        y = _quantized_product(self, x).astype(mx.float16)
        return y + self["bias"] if "bias" in self else y


class HalfEmbedding(nn.Embedding):
    """A float16 embedding whose tied output projection (`as_linear`) sums in float32 on the CPU."""

    def as_linear(self, x: mx.array) -> mx.array:
        if x.dtype != mx.float16 or mx.default_device() != mx.cpu:
            return super().as_linear(x)
        (w,) = _f32(self, ("weight",))
        return (x.astype(mx.float32) @ w.T).astype(mx.float16)


class HalfQuantizedEmbedding(nn.QuantizedEmbedding):
    """A quantized embedding with float16 scales whose `as_linear` sums in float32 on the CPU."""

    def as_linear(self, x: mx.array) -> mx.array:
        if x.dtype != mx.float16 or mx.default_device() != mx.cpu:
            return super().as_linear(x)
        return _quantized_product(self, x).astype(mx.float16)


_HALF = {Linear: HalfLinear, nn.Linear: HalfLinear, QuantizedLinear: HalfQuantizedLinear, nn.QuantizedLinear: HalfQuantizedLinear,
         nn.Embedding: HalfEmbedding, nn.QuantizedEmbedding: HalfQuantizedEmbedding}


def emulate_half_products(model: nn.Module) -> int:
    """Give `model`'s float16 layers Metal's products on the CPU device (float16 in, float32
    sums, float16 out; the classes above): for a model loaded in Metal's numerics on the CPU.
    The same parameters; on another device, or for float32 inputs, the layers compute as before.
    -> how many layers."""
    n = 0
    for _, mod in model.named_modules():
        half = _HALF.get(type(mod))
        if half is not None and ("scales" in mod or mod["weight"].dtype == mx.float16):
            mod.__class__ = half
            n += 1
    return n
