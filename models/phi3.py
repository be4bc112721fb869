"""Phi-3 / Phi-4-mini: the Llama block with q, k, v fused into one `qkv_proj` and gate, up
into one `gate_up_proj` in the checkpoint (split on load by `sanitize`, so the shared
attention and MLP run them), optional partial rotary embeddings, one sliding window for
every layer when the config sets it; LongRoPE ("longrope" / "su") scaling (base.py)."""

from __future__ import annotations

import mlx.core as mx
from edgespec.models.base import Model as BaseModel
from edgespec.models.base import ModelArgs as BaseArgs


class ModelArgs(BaseArgs):
    model_types = ("phi3",)


class Model(BaseModel):
    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Split fused rows: qkv (H*D + 2*Hk*D, E) -> q, k, v; gate_up (2F, E) -> gate, up.

        Quantized tensors (weight, scales, biases) are split the same way: quantization
        groups run along the input dimension, so output rows stay whole."""
        a = self.args
        q_rows, kv_rows = a.num_attention_heads * a.head_dim, a.num_key_value_heads * a.head_dim
        out = {}
        for k, v in super().sanitize(weights).items():
            if ".self_attn.qkv_proj." in k:
                q, kk, vv = mx.split(v, [q_rows, q_rows + kv_rows], axis=0)
                for name, part in (("q_proj", q), ("k_proj", kk), ("v_proj", vv)):
                    out[k.replace("qkv_proj", name)] = part
            elif ".mlp.gate_up_proj." in k:
                gate, up = mx.split(v, 2, axis=0)
                out[k.replace("gate_up_proj", "gate_proj")] = gate
                out[k.replace("gate_up_proj", "up_proj")] = up
            else:
                out[k] = v
        return out
