"""LFM2 (Liquid): short gated convolution blocks interleaved with attention layers.

A conv block is in_proj -> (b, c, x); y = c * conv(b * x) over a depthwise causal
convolution of width conv_L_cache; out_proj. Attention layers are Llama's with an RMSNorm
over each head of q and k. Every layer has a SwiGLU feed-forward (w1/w3/w2, its width
adjusted as the config says); the final norm is `embedding_norm`. The convolution's state
is an edgespec.caches.recurrent.ConvCache (checkpointed per verified position, rolled back by
recomputation), so every decoding mode runs on it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from edgespec.models.base import MLP, DecoderLayer, LayerOptions
from edgespec.models.base import Model as BaseModel
from edgespec.models.base import ModelArgs as BaseArgs

from edgespec.caches.recurrent import ConvCache, conv_windows, depthwise, tree_parents
from edgespec.kernels.linear import Linear

KINDS = ("conv", "full_attention")

# HF names -> the shared base's (idempotent: a converted bundle already has the base's)
RENAMES = (("self_attn.out_proj.", "self_attn.o_proj."), ("self_attn.q_layernorm.", "self_attn.q_norm."),
           ("self_attn.k_layernorm.", "self_attn.k_norm."), ("feed_forward.w1.", "mlp.gate_proj."),
           ("feed_forward.w3.", "mlp.up_proj."), ("feed_forward.w2.", "mlp.down_proj."),
           ("operator_norm.", "input_layernorm."), ("ffn_norm.", "post_attention_layernorm."),
           ("model.embedding_norm.", "model.norm."))


@dataclass
class ModelArgs(BaseArgs):
    conv_bias: bool = False
    conv_L_cache: int = 3
    blocks: list[str] | None = None  # per layer: "conv" or "full_attention"

    model_types = ("lfm2",)

    @classmethod
    def translate(cls, config: dict[str, Any]) -> dict[str, Any]:
        c = dict(config)
        c["rms_norm_eps"] = c.pop("norm_eps", 1e-5)
        c["tie_word_embeddings"] = c.pop("tie_embedding", c.get("tie_word_embeddings", True))
        if "block_ff_dim" in c:
            c["intermediate_size"] = c.pop("block_ff_dim")
        c.setdefault("rope_theta", 1_000_000.0)
        F = c.get("intermediate_size")
        multiple = c.pop("block_multiple_of", 256)
        mult = c.pop("block_ffn_dim_multiplier", 1.0)
        if c.pop("block_auto_adjust_ff_dim", True) and F is not None:
            F = int(2 * F / 3)
            if mult is not None:
                F = multiple * ((int(mult * F) + multiple - 1) // multiple)
            c["intermediate_size"] = F
        n = c.get("num_hidden_layers") or 0
        kinds = c.pop("layer_types", None)
        full = c.pop("full_attn_idxs", None)
        if kinds is None:
            full = list(range(n)) if full is None else full
            kinds = ["full_attention" if i in full else "conv" for i in range(n)]
        c["blocks"] = kinds
        for k in ("conv_use_xavier_init", "conv_dim", "conv_dim_out", "block_use_swiglu", "block_norm_eps",
                  "block_mlp_init_scale", "block_out_init_scale", "block_use_xavier_init", "block_dim",
                  "block_ff_dim_in"):
            c.pop(k, None)  # training-time (initialisation) fields of the original config
        return c

    def __post_init__(self):
        super().__post_init__()
        if self.blocks is None or len(self.blocks) != self.num_hidden_layers or set(self.blocks) - set(KINDS):
            raise ValueError(f"lfm2 layer_types must list {self.num_hidden_layers} of {list(KINDS)}; "
                             f"got {self.blocks}")
        if self.conv_L_cache < 1:
            raise ValueError(f"conv_L_cache must be >= 1, got {self.conv_L_cache}")


class ShortConv(nn.Module):
    """y = out_proj(c * conv(b * x)), (b, c, x) = in_proj(h) split in three."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        E, K = args.hidden_size, args.conv_L_cache
        self.in_proj = Linear(E, 3 * E, bias=args.conv_bias)
        self.out_proj = Linear(E, E, bias=args.conv_bias)
        self.conv = nn.Module()
        self.conv.weight = mx.zeros((E, 1, K))  # (C, 1, K), Hugging Face's layout
        if args.conv_bias:
            self.conv.bias = mx.zeros((E,))
        self.K = K

    def __call__(self, x, mask, cache: ConvCache | None):
        B, T, E = x.shape
        b, c, h = mx.split(self.in_proj(x), 3, axis=-1)
        bx = b * h
        state = cache.state if cache is not None else None
        state = state[0] if state is not None else mx.zeros((B, self.K - 1, E), bx.dtype)
        parents = tree_parents(mask, cache.offset, T) if cache is not None else None
        win, last = conv_windows(bx, state, parents)
        y = depthwise(win, self.conv.weight, self.conv.get("bias"))
        if cache is not None:
            cache.write((bx,), (last,), parents, (state,))
        return self.out_proj(c * y)


class ConvLayer(nn.Module):
    def __init__(self, args: ModelArgs, mlp=None):
        super().__init__()
        self.conv = ShortConv(args)
        self.mlp = mlp(args) if mlp is not None else MLP(args)  # mlp: LFM2-MoE's sparse block
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def make_cache(self) -> ConvCache:
        return ConvCache()

    def __call__(self, x, mask, cache, positions):
        h = x + self.conv(self.input_layernorm(x), mask, cache)
        return h + self.mlp(self.post_attention_layernorm(h), cache is not None)


class Model(BaseModel):
    def make_layer(self, args: ModelArgs, i: int) -> nn.Module:
        if args.blocks[i] == "conv":
            return ConvLayer(args)
        return DecoderLayer(args, LayerOptions(qk_norm=True))

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        out = {}
        for k, v in super().sanitize(weights).items():
            for old, new in RENAMES:
                k = k.replace(old, new)
            if k.endswith(".conv.conv.weight") and v.ndim == 3 and v.shape[1] != 1:
                v = v.swapaxes(1, 2)  # mlx-community folders store (C, K, 1)
            out[k] = v
        return out
