"""Every weight of an MLX model as float32 numpy (quantized modules dequantized): what the
Core ML export builds its programs from and its calibration compares against."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten


def _dense_params(model) -> dict[str, np.ndarray]:
    """Every weight of an MLX Llama `Model` as float32 numpy, dequantizing quantized modules."""
    out: dict[str, np.ndarray] = {}
    dequantized = set()
    for path, m in model.named_modules():
        if hasattr(m, "scales"):  # QuantizedLinear / QuantizedEmbedding
            w = mx.dequantize(m.weight, m.scales, getattr(m, "biases", None), m.group_size, m.bits)
            out[f"{path}.weight"] = np.array(w.astype(mx.float32))
            if "bias" in m:
                out[f"{path}.bias"] = np.array(m.bias.astype(mx.float32))
            dequantized.add(path)
    for name, v in tree_flatten(model.parameters()):
        stem, kind = name.rsplit(".", 1)
        if stem in dequantized and kind in ("weight", "scales", "biases", "bias"):
            continue  # written above (a dense module's bias, e.g. Qwen2's q/k/v, is kept below)
        out[name] = np.array(v.astype(mx.float32))
    return out
