"""Qwen3-MoE: the Qwen3 block (RMSNorm over each head of q and k) with a sparse mixture of
experts in place of the MLP: a router (a linear map to one logit per expert) softmaxed,
the top `num_experts_per_tok` experts per token (their weights renormalised to sum 1 when
`norm_topk_prob`), each a gated MLP of width `moe_intermediate_size`, no shared expert.
Layer i is sparse when i is not in `mlp_only_layers` and (i + 1) % decoder_sparse_step == 0;
the others keep a dense MLP of `intermediate_size`. Experts run on gathered matmuls
(models/experts.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from edgespec.models.base import LayerOptions, gated_window
from edgespec.models.base import Model as BaseModel
from edgespec.models.base import ModelArgs as BaseArgs
from edgespec.models.experts import SwitchGLU, stack_experts, top_k

from edgespec.kernels.linear import Linear


@dataclass
class ModelArgs(BaseArgs):
    num_experts: int = 128
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 768
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)

    model_types = ("qwen3_moe",)
    gated_windows = ("qwen3_moe",)

    @classmethod
    def translate(cls, config: dict[str, Any]) -> dict[str, Any]:
        config = dict(config)
        config.pop("router_aux_loss_coef", None)  # a training loss weight
        if "num_local_experts" in config:  # transformers 5 writes num_experts under this name
            n = config.pop("num_local_experts")
            if config.get("num_experts", n) != n:
                raise ValueError(f"config gives num_experts={config['num_experts']} and num_local_experts={n}")
            config["num_experts"] = n
        if config.get("mlp_only_layers") is None:
            config["mlp_only_layers"] = []
        return gated_window(config, lambda c, i: True)  # the window, when on, is every layer's

    def __post_init__(self):
        super().__post_init__()
        if not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok ({self.num_experts_per_tok}) must be in 1..num_experts "
                             f"({self.num_experts})")
        if self.decoder_sparse_step < 1:
            raise ValueError(f"decoder_sparse_step must be >= 1, got {self.decoder_sparse_step}")

    def sparse(self, i: int) -> bool:
        return (self.num_experts > 0 and i not in self.mlp_only_layers
                and (i + 1) % self.decoder_sparse_step == 0)


class SparseMoE(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.gate = Linear(args.hidden_size, args.num_experts, bias=False)
        self.switch_mlp = SwitchGLU(args.hidden_size, args.moe_intermediate_size, args.num_experts, args.hidden_act)
        self.k, self.norm = args.num_experts_per_tok, args.norm_topk_prob

    def __call__(self, x: mx.array, inference: bool = False) -> mx.array:
        probs = mx.softmax(self.gate(x).astype(mx.float32), axis=-1)
        weights, idx = top_k(probs, self.k)  # (..., k)
        if self.norm:
            weights = weights / weights.sum(axis=-1, keepdims=True)
        y = self.switch_mlp(x, idx)  # (..., k, E)
        return (y * weights[..., None].astype(y.dtype)).sum(axis=-2)


class Model(BaseModel):
    def layer_options(self, args: ModelArgs, i: int) -> LayerOptions:
        return LayerOptions(window=args.window(i), qk_norm=True, mlp=SparseMoE if args.sparse(i) else None)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        weights = super().sanitize(weights)
        for i in range(self.args.num_hidden_layers):
            if self.args.sparse(i):
                weights = stack_experts(weights, f"model.layers.{i}.mlp", self.args.num_experts)
        return weights
