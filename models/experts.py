"""Mixture-of-experts parts shared by the MoE architectures (Qwen3-MoE, Gemma 4's MoE block).

The experts of a layer are stored stacked, one (experts, out, in) weight per projection
(`switch_mlp.gate_proj.weight`, ... as mlx-community folders name them), and applied
with MLX's gathered matmuls: `mx.gather_mm` (dense) or `mx.gather_qmm` (quantized)
multiply each token's row by only the k experts the router picked, with no per-expert
Python loop and no dense product over every expert.

Shapes: N tokens (any leading dims), k experts per token, E hidden, F expert width.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from edgespec.kernels.activation import gated_activation
from edgespec.kernels.experts import expert_glu_metal, kernel_applies
from edgespec.kernels.spec import on_metal

SORT_MIN = 64  # (token, expert) pairs from which SwitchGLU sorts them by expert


class SwitchLinear(nn.Module):
    """`experts` stacked linear maps (weight (experts, out, in)); row i of x goes through
    the experts `indices[i]` only."""

    def __init__(self, experts: int, in_dims: int, out_dims: int):
        super().__init__()
        scale = in_dims**-0.5
        self.weight = mx.random.uniform(-scale, scale, (experts, out_dims, in_dims))

    @property
    def experts(self) -> int:
        return self.weight.shape[0]

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        """x (..., 1 or k, 1, in), indices (..., k) -> (..., k, 1, out)."""
        return mx.gather_mm(x, self["weight"].swapaxes(-1, -2), rhs_indices=indices, sorted_indices=sorted_indices)

    def kernel_params(self) -> dict:
        """The weights as edgespec.kernels.experts takes them."""
        return {"weight": self["weight"]}

    def to_quantized(self, group_size: int | None = None, bits: int | None = None, mode: str = "affine",
                     **_) -> QuantizedSwitchLinear:
        return QuantizedSwitchLinear.from_switch(self, group_size or 64, bits or 4, mode)


class QuantizedSwitchLinear(nn.Module):
    """SwitchLinear with MLX-quantized weights (per expert, the same layout as QuantizedLinear)."""

    def __init__(self, experts: int, in_dims: int, out_dims: int, group_size: int = 64, bits: int = 4,
                 mode: str = "affine"):
        super().__init__()
        self.group_size, self.bits, self.mode = group_size, bits, mode
        w = mx.zeros((experts, out_dims, in_dims))
        self.weight, self.scales, *rest = mx.quantize(w, group_size, bits, mode=mode)
        if rest and rest[0] is not None:
            self.biases = rest[0]
        self.freeze()

    @classmethod
    def from_switch(cls, layer: SwitchLinear, group_size: int, bits: int, mode: str) -> QuantizedSwitchLinear:
        experts, out_dims, in_dims = layer.weight.shape
        q = cls(experts, in_dims, out_dims, group_size, bits, mode)
        q.weight, q.scales, *rest = mx.quantize(layer.weight, group_size, bits, mode=mode)
        if rest and rest[0] is not None:
            q.biases = rest[0]
        return q

    def kernel_params(self) -> dict:
        return {"weight": self["weight"], "scales": self["scales"], "biases": self.get("biases"),
                "group_size": self.group_size, "bits": self.bits, "mode": self.mode}

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        return mx.gather_qmm(x, self["weight"], self["scales"], self.get("biases"), rhs_indices=indices,
                             transpose=True, group_size=self.group_size, bits=self.bits, mode=self.mode,
                             sorted_indices=sorted_indices)


class SwitchGLU(nn.Module):
    """The experts' gated MLPs: down(act(gate(x)) * up(x)) through each token's k experts."""

    def __init__(self, hidden: int, width: int, experts: int, activation: str):
        super().__init__()
        self.gate_proj = SwitchLinear(experts, hidden, width)
        self.up_proj = SwitchLinear(experts, hidden, width)
        self.down_proj = SwitchLinear(experts, width, hidden)
        self._act = activation

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        """x (..., E), indices (..., k) -> each chosen expert's output (..., k, E).

        From SORT_MIN (token, expert) pairs on (prompt chunks, verification rounds) the pairs
        are sorted by expert first, so each expert's rows are multiplied together
        (benchmarks/moe_gather.py: 25-30% faster from 16 tokens on the CPU); a decoding step's
        few pairs go as they are. Each row's product is the same either way. On an Apple GPU,
        up to edgespec.kernels.experts.MAX_TOKENS tokens (decoding steps, verify passes) go
        through its fused kernels (gate and up read once, the activation in registers)."""
        if on_metal():
            projs = [p.kernel_params() for p in (self.gate_proj, self.up_proj, self.down_proj)]
            if kernel_applies(indices, *projs, self._act):  # a few tokens: the fused kernels
                k, E = indices.shape[-1], x.shape[-1]
                y = expert_glu_metal(x.reshape(-1, E), indices.reshape(-1, k), *projs, self._act)
                return y.reshape(*indices.shape, E)
        if indices.size < SORT_MIN:
            x = x[..., None, None, :]  # (..., 1, 1, E): one row, shared by the k experts
            h = gated_activation(self._act, self.gate_proj(x, indices), self.up_proj(x, indices))
            return self.down_proj(h, indices).squeeze(-2)
        k, E = indices.shape[-1], x.shape[-1]
        flat = indices.reshape(-1)
        order = mx.argsort(flat)
        rows = x.reshape(-1, E)[order // k][:, None, :]  # (pairs, 1, E), grouped by expert
        e = flat[order]
        h = gated_activation(self._act, self.gate_proj(rows, e, True), self.up_proj(rows, e, True))
        y = self.down_proj(h, e, True)[:, 0]  # (pairs, E)
        return y[mx.argsort(order)].reshape(*indices.shape, E)


def top_k(probs: mx.array, k: int) -> tuple[mx.array, mx.array]:
    """The k largest of each row (any order): (values, indices), both (..., k)."""
    idx = mx.argpartition(-probs, kth=k - 1, axis=-1)[..., :k]
    return mx.take_along_axis(probs, idx, axis=-1), idx


def stack_experts(weights: dict[str, mx.array], prefix: str, experts: int, names=("gate_proj", "up_proj", "down_proj"),
                  into: str = "switch_mlp") -> dict[str, mx.array]:
    """Checkpoint expert layouts -> `{prefix}.{into}.{name}.weight` (experts, out, in).

    Hugging Face folders hold one matrix per expert (`{prefix}.experts.{e}.gate_proj.weight`)
    or, as transformers 5 keeps them in memory, fused 3-D tensors (`{prefix}.experts.gate_up_proj`
    (experts, 2F, E), `{prefix}.experts.down_proj` (experts, E, F)); mlx-community folders are
    already stacked. Quantized tensors (.scales, .biases) stack the same way."""
    out = dict(weights)
    for name in names:
        for suffix in ("weight", "scales", "biases"):
            keys = [f"{prefix}.experts.{e}.{name}.{suffix}" for e in range(experts)]
            if keys[0] in out:
                missing = [k for k in keys if k not in out]
                if missing:
                    raise ValueError(f"checkpoint lacks {missing[0]} (the layer has {experts} experts)")
                out[f"{prefix}.{into}.{name}.{suffix}"] = mx.stack([out.pop(k) for k in keys])
    fused = out.pop(f"{prefix}.experts.gate_up_proj", None)
    if fused is not None:
        F = fused.shape[1] // 2
        out[f"{prefix}.{into}.gate_proj.weight"] = fused[:, :F]
        out[f"{prefix}.{into}.up_proj.weight"] = fused[:, F:]
    down = out.pop(f"{prefix}.experts.down_proj", None)
    if down is not None:
        out[f"{prefix}.{into}.down_proj.weight"] = down
    return out
