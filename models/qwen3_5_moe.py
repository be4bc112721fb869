"""Qwen3.5-MoE (`qwen3_5_moe_text`, and the text part of `qwen3_5_moe`): the Qwen3.5 hybrid
(models/qwen3_5.py: Gated DeltaNet and gated attention interleaved) with a sparse block in
place of every layer's MLP:

    y = sum over the top-k experts e of w_e * expert_e(x)  +  sigmoid(shared_expert_gate(x)) * shared_expert(x)

The router softmaxes one logit per expert (in float32) and keeps the `num_experts_per_tok`
largest, renormalised to sum 1 (transformers always does; `norm_topk_prob: false`, which
mlx-lm reads, keeps the softmax weights). Each expert is a gated MLP of width
`moe_intermediate_size` on MLX's gathered matmuls (models/experts.py); the shared expert is a
gated MLP of width `shared_expert_intermediate_size` (0: none), gated by a sigmoid of one
logit. Every layer is sparse. The vision tower is not loaded; an `mtp.*` head loads as
Qwen3.5's (models/qwen3_5.py), its layer with this sparse block.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from edgespec.models.base import MLP
from edgespec.models.experts import stack_experts
from edgespec.models.qwen3_5 import Model as DenseModel
from edgespec.models.qwen3_5 import ModelArgs as DenseArgs
from edgespec.models.qwen3_moe import SparseMoE

from edgespec.kernels.linear import Linear

# Qwen3-MoE's layer-placement fields: harmless at the values that make every layer sparse
EVERY_LAYER_SPARSE = {"decoder_sparse_step": (None, 1), "mlp_only_layers": (None, [])}


@dataclass
class ModelArgs(DenseArgs):
    num_experts: int = 256
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 512
    norm_topk_prob: bool = True

    model_types = ("qwen3_5_moe_text", "qwen3_5_moe")

    @classmethod
    def translate(cls, config: dict[str, Any]) -> dict[str, Any]:
        c = dict(config)
        c.pop("router_aux_loss_coef", None)  # a training loss weight
        for key, allowed in EVERY_LAYER_SPARSE.items():
            if c.get(key) not in allowed:
                raise ValueError(f"qwen3_5_moe: {key}={c[key]!r} is not supported (every layer is sparse)")
            c.pop(key, None)
        # The base's intermediate_size is the shared expert's width (MLP(args) builds it);
        # Qwen3.5-MoE has no dense MLP of its own.
        shared = c.get("shared_expert_intermediate_size", 512) or 0
        if c.get("intermediate_size") not in (None, shared):
            raise ValueError(f"qwen3_5_moe: intermediate_size={c['intermediate_size']} differs from "
                             f"shared_expert_intermediate_size={shared}; the model has no dense MLP")
        c["intermediate_size"] = shared
        return super().translate(c)

    def __post_init__(self):
        super().__post_init__()
        if not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok ({self.num_experts_per_tok}) must be in 1..num_experts "
                             f"({self.num_experts})")


class SharedExpertMoE(SparseMoE):
    """Qwen3-MoE's routed experts plus a sigmoid-gated shared expert."""

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self._shared = args.shared_expert_intermediate_size > 0
        if self._shared:
            self.shared_expert = MLP(args)  # width intermediate_size = shared_expert_intermediate_size
            self.shared_expert_gate = Linear(args.hidden_size, 1, bias=False)

    def __call__(self, x: mx.array, inference: bool = False) -> mx.array:
        y = super().__call__(x, inference)
        if self._shared:
            y = y + mx.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x, inference)
        return y


class Model(DenseModel):
    feed_forward = SharedExpertMoE  # every layer's, the MTP head's layer included

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        weights = super().sanitize(weights)
        for i in range(self.args.num_hidden_layers):
            weights = stack_experts(weights, f"model.layers.{i}.mlp", self.args.num_experts)
        return weights

    def mtp_weights(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """The MTP head's layer has the sparse block too: its experts stacked as the model's."""
        for j in range(self.args.mtp_num_hidden_layers):
            weights = stack_experts(weights, f"mtp.layers.{j}.mlp", self.args.num_experts)
        return weights

