"""LFM2-MoE (Liquid's `lfm2_moe`, e.g. LFM2-8B-A1B): LFM2's layers (models/lfm2.py: short
gated convolutions interleaved with attention) whose feed-forward is, from layer
`num_dense_layers` on, a sparse mixture of experts (the first layers keep a dense SwiGLU of
`intermediate_size`, taken as written: no LFM2 width adjustment):

    s = sigmoid(router(x));  chosen = top-k of (s + expert_bias)   (the bias selects only)
    w = s[chosen] / (sum s[chosen] + 1e-6)   (when norm_topk_prob)  * routed_scaling_factor
    y = sum over chosen e of w_e * expert_e(x)

Each expert is a gated MLP of width `moe_intermediate_size` on MLX's gathered matmuls
(models/experts.py). The convolution states are LFM2's ConvCache, so every decoding mode runs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from edgespec.models.base import DecoderLayer, LayerOptions
from edgespec.models.experts import SwitchGLU, stack_experts, top_k
from edgespec.models.lfm2 import ConvLayer
from edgespec.models.lfm2 import Model as Lfm2Model
from edgespec.models.lfm2 import ModelArgs as Lfm2Args

from edgespec.kernels.linear import Linear

# LFM2's width-adjustment fields: transformers' lfm2_moe does not read them (the dense width is
# intermediate_size as written), so neither does edgespec
IGNORED_LFM2_FIELDS = ("block_auto_adjust_ff_dim", "block_multiple_of", "block_ffn_dim_multiplier", "block_ff_dim")
EXPERT_NAMES = (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj"))


@dataclass
class ModelArgs(Lfm2Args):
    num_experts: int = 32
    num_experts_per_tok: int = 4
    moe_intermediate_size: int = 1792
    num_dense_layers: int = 2
    norm_topk_prob: bool = True
    use_expert_bias: bool = True
    routed_scaling_factor: float = 1.0

    model_types = ("lfm2_moe",)

    @classmethod
    def translate(cls, config: dict[str, Any]) -> dict[str, Any]:
        c = {k: v for k, v in config.items() if k not in IGNORED_LFM2_FIELDS}
        if "num_local_experts" in c:
            n = c.pop("num_local_experts")
            if c.get("num_experts", n) != n:
                raise ValueError(f"lfm2_moe: config gives num_experts={c['num_experts']} and num_local_experts={n}")
            c["num_experts"] = n
        c["block_auto_adjust_ff_dim"] = False
        return super().translate(c)

    def __post_init__(self):
        super().__post_init__()
        if not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"lfm2_moe: num_experts_per_tok ({self.num_experts_per_tok}) must be in 1..num_experts "
                             f"({self.num_experts})")
        if self.num_dense_layers < 0:
            raise ValueError(f"lfm2_moe: num_dense_layers must be >= 0, got {self.num_dense_layers}")

    def sparse(self, i: int) -> bool:
        return i >= self.num_dense_layers


class SigmoidMoE(nn.Module):
    """Sigmoid-scored experts; the expert bias picks them, the unbiased scores weight them."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.gate = Linear(args.hidden_size, args.num_experts, bias=False)
        self.switch_mlp = SwitchGLU(args.hidden_size, args.moe_intermediate_size, args.num_experts, args.hidden_act)
        if args.use_expert_bias:
            self.expert_bias = mx.zeros((args.num_experts,))
        self.k, self.norm, self.scale = args.num_experts_per_tok, args.norm_topk_prob, args.routed_scaling_factor

    def __call__(self, x: mx.array, inference: bool = False) -> mx.array:
        scores = mx.sigmoid(self.gate(x).astype(mx.float32))
        bias = self.get("expert_bias")
        _, idx = top_k(scores if bias is None else scores + bias.astype(mx.float32), self.k)
        weights = mx.take_along_axis(scores, idx, axis=-1)
        if self.norm:
            weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-6)
        weights = weights * self.scale
        y = self.switch_mlp(x, idx)  # (..., k, E)
        return (y * weights[..., None].astype(y.dtype)).sum(axis=-2)


class Model(Lfm2Model):
    def make_layer(self, args: ModelArgs, i: int) -> nn.Module:
        ff = SigmoidMoE if args.sparse(i) else None
        if args.blocks[i] == "conv":
            return ConvLayer(args, mlp=ff)
        return DecoderLayer(args, LayerOptions(qk_norm=True, mlp=ff))

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """LFM2's renames, then the sparse block's: `feed_forward.` -> `mlp.`, per-expert w1/w3/w2
        -> gate/up/down, experts stacked (HF per-expert or fused; mlx-community: already)."""
        out = {}
        for k, v in super().sanitize(weights).items():
            k = k.replace(".feed_forward.", ".mlp.")
            for old, new in EXPERT_NAMES:
                k = re.sub(rf"(\.experts\.\d+)\.{old}\.", rf"\1.{new}.", k)
            out[k] = v
        for i in range(self.args.num_hidden_layers):
            if self.args.sparse(i):
                out = stack_experts(out, f"model.layers.{i}.mlp", self.args.num_experts)
        return out
