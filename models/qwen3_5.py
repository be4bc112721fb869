"""Qwen3.5 (dense text model; `qwen3_5_text`, and the text part of `qwen3_5`).

Gated DeltaNet layers (linear attention) interleaved with gated full attention:
- linear_attention: in_proj_qkv -> depthwise causal conv (width linear_conv_kernel_dim) ->
  SiLU -> q, k (L2-normed, q scaled by Dk^-0.5), v; decay g = -exp(A_log) softplus(a +
  dt_bias), beta = sigmoid(b); the gated delta rule (edgespec.recurrent: recurrent form for
  decode and verify passes, chunked form for long prompt chunks; per-branch in tree passes);
  output RMSNorm(o) * silu(z), out_proj. Its state is an edgespec.recurrent.DeltaCache.
- full_attention: q_proj gives q and a per-head output gate, (1 + w) RMSNorm over heads of
  q and k, RoPE on the first partial_rotary_factor of each head (text positions: the
  multimodal RoPE sections coincide), out * sigmoid(gate) before o_proj.
Norms are (1 + w) RMSNorms, except the delta rule's gated output norm (w). The vision tower
and the multi-token-prediction (`mtp.*`) weights of a `qwen3_5` checkpoint are not loaded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from edgespec.models.base import MLP, DecoderLayer, LayerOptions, OffsetRMSNorm
from edgespec.models.base import Model as BaseModel
from edgespec.models.base import ModelArgs as BaseArgs

from edgespec.kernels.linear import Linear
from edgespec.recurrent import (
    RECURRENT_MAX,
    DeltaCache,
    conv_windows,
    delta_chunked,
    delta_recurrent,
    depthwise,
    tree_parents,
)

KINDS = ("linear_attention", "full_attention")
NOTE_SKIPPED = "qwen3_5: vision tower and MTP weights are not loaded (text model only)"


@dataclass
class ModelArgs(BaseArgs):
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    blocks: list[str] | None = None  # per layer: "linear_attention" or "full_attention"

    model_types = ("qwen3_5_text", "qwen3_5")

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> ModelArgs:
        c = dict(config)
        if c.get("model_type") == "qwen3_5":  # the multimodal wrapper: its text model
            text = dict(c.get("text_config") or {})
            text["tie_word_embeddings"] = c.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
            c = {**text, "model_type": "qwen3_5"}
        rp = c.get("rope_parameters")
        if isinstance(rp, dict):  # text positions: the multimodal sections all coincide
            c["rope_parameters"] = {k: v for k, v in rp.items() if k not in ("mrope_section", "mrope_interleaved")}
        return super().from_dict(c)

    @classmethod
    def translate(cls, config: dict[str, Any]) -> dict[str, Any]:
        c = dict(config)
        c.setdefault("partial_rotary_factor", 0.25)
        c.setdefault("rms_norm_eps", 1e-6)
        n = c.get("num_hidden_layers") or 0
        every = c.pop("full_attention_interval", 4)
        kinds = c.pop("layer_types", None)
        c["blocks"] = kinds if kinds is not None else [
            "linear_attention" if (i + 1) % every else "full_attention" for i in range(n)]
        for k in ("mtp_num_hidden_layers", "mtp_use_dedicated_embeddings"):
            c.pop(k, None)  # the MTP head is not loaded; the main model's math is unchanged
        return c

    def __post_init__(self):
        super().__post_init__()
        if self.blocks is None or len(self.blocks) != self.num_hidden_layers or set(self.blocks) - set(KINDS):
            raise ValueError(f"qwen3_5 layer_types must list {self.num_hidden_layers} of {list(KINDS)}; "
                             f"got {self.blocks}")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError("linear_num_value_heads must be a multiple of linear_num_key_heads")


def l2norm(x: mx.array, eps: float = 1e-6) -> mx.array:
    return x * mx.rsqrt((x * x).sum(axis=-1, keepdims=True) + eps)


class GatedDeltaNet(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        E = args.hidden_size
        self.Hk, self.Hv = args.linear_num_key_heads, args.linear_num_value_heads
        self.Dk, self.Dv = args.linear_key_head_dim, args.linear_value_head_dim
        self.K = args.linear_conv_kernel_dim
        C = 2 * self.Hk * self.Dk + self.Hv * self.Dv
        self.in_proj_qkv = Linear(E, C, bias=False)
        self.in_proj_z = Linear(E, self.Hv * self.Dv, bias=False)
        self.in_proj_b = Linear(E, self.Hv, bias=False)
        self.in_proj_a = Linear(E, self.Hv, bias=False)
        self.conv1d = nn.Module()
        self.conv1d.weight = mx.zeros((C, 1, self.K))  # Hugging Face's (C, 1, K)
        self.dt_bias = mx.ones((self.Hv,))
        self.A_log = mx.zeros((self.Hv,))
        self.norm = nn.RMSNorm(self.Dv, eps=args.rms_norm_eps)
        self.out_proj = Linear(self.Hv * self.Dv, E, bias=False)

    def __call__(self, x, mask, cache: DeltaCache | None):
        B, T, _ = x.shape
        qkv = self.in_proj_qkv(x)
        z = self.in_proj_z(x).reshape(B, T, self.Hv, self.Dv)
        state = cache.state if cache is not None else None
        if state is None:
            state = (mx.zeros((B, self.K - 1, qkv.shape[-1]), qkv.dtype),
                     mx.zeros((B, self.Hv, self.Dk, self.Dv), mx.float32))
        parents = tree_parents(mask, cache.offset, T) if cache is not None else None
        win, last = conv_windows(qkv, state[0], parents)
        mixed = nn.silu(depthwise(win, self.conv1d.weight, None)).astype(mx.float32)
        kd = self.Hk * self.Dk
        r = self.Hv // self.Hk  # each q/k head serves r consecutive value heads
        q = mx.repeat(l2norm(mixed[..., :kd].reshape(B, T, self.Hk, self.Dk)), r, axis=2) * self.Dk**-0.5
        k = mx.repeat(l2norm(mixed[..., kd : 2 * kd].reshape(B, T, self.Hk, self.Dk)), r, axis=2)
        v = mixed[..., 2 * kd :].reshape(B, T, self.Hv, self.Dv)
        beta = mx.sigmoid(self.in_proj_b(x).astype(mx.float32))
        a = self.in_proj_a(x).astype(mx.float32)
        g = -mx.exp(self.A_log.astype(mx.float32)) * nn.softplus(a + self.dt_bias.astype(mx.float32))
        if parents is None and T > RECURRENT_MAX:
            out, S = delta_chunked(q, k, v, g, beta, state[1])
        else:
            out, S = delta_recurrent(q, k, v, g, beta, state[1], parents)
        if cache is not None:
            cache.write((qkv, k, v, g, beta), (last, S), parents, state)
        out = self.norm(out.astype(x.dtype)) * nn.silu(z.astype(mx.float32)).astype(x.dtype)
        return self.out_proj(out.reshape(B, T, -1))


class DeltaLayer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.linear_attn = GatedDeltaNet(args)
        self.mlp = MLP(args)
        self.input_layernorm = OffsetRMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = OffsetRMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def make_cache(self) -> DeltaCache:
        return DeltaCache()

    def __call__(self, x, mask, cache, positions):
        h = x + self.linear_attn(self.input_layernorm(x), mask, cache)
        return h + self.mlp(self.post_attention_layernorm(h), cache is not None)


class Model(BaseModel):
    norm = OffsetRMSNorm

    def make_layer(self, args: ModelArgs, i: int) -> nn.Module:
        if args.blocks[i] == "linear_attention":
            return DeltaLayer(args)
        return DecoderLayer(args, LayerOptions(qk_norm=True, norm=OffsetRMSNorm, output_gate=True))

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        out = {}
        for k, v in super().sanitize(weights).items():
            if k.startswith(("model.visual.", "visual.", "mtp.", "model.mtp.")):
                continue
            k = k.replace("model.language_model.", "model.")
            if k.endswith("conv1d.weight") and v.ndim == 3 and v.shape[1] != 1:
                v = v.swapaxes(1, 2)  # mlx-community folders store (C, K, 1)
            out[k] = v
        return out
