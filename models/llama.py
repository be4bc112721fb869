"""Llama-family decoder in MLX: Llama 2/3, Mistral, SmolLM/SmolLM2, Qwen2.

One file, pure function of weights and config. Weight names follow Hugging Face
(`model.layers.{i}.self_attn.q_proj.weight`, ...), so an HF safetensors folder
loads as is; checkpoint quirks are fixed in the converters, never here.

Shapes: B batch, T new tokens, S cached + new tokens, H query heads,
Hk key/value heads, D head dim, E hidden size, V vocabulary.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from edgespec.cache import KVCache

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "smollm", "smollm2")


@dataclass
class ModelArgs:
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    vocab_size: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    rope_traditional: bool = False
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    max_position_embeddings: int = 4096
    model_type: str = "llama"
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.model_type == "qwen2":
            # Qwen2 configs do not carry `attention_bias`; q/k/v always have biases.
            self.attention_bias = True
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> ModelArgs:
        """Build from an HF `config.json` dict; unknown keys are kept aside in `extra`."""
        model_type = config.get("model_type", "llama")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported architecture {model_type!r}; edgespec supports "
                f"{', '.join(SUPPORTED_MODEL_TYPES)} (Llama-family decoders)"
            )
        names = set(inspect.signature(cls).parameters)
        known = {k: v for k, v in config.items() if k in names and k != "extra"}
        missing = [
            k
            for k in (
                "hidden_size",
                "num_hidden_layers",
                "intermediate_size",
                "num_attention_heads",
                "vocab_size",
            )
            if k not in known
        ]
        if missing:
            raise ValueError(f"config.json lacks required field(s): {', '.join(missing)}")
        extra = {k: v for k, v in config.items() if k not in names}
        return cls(**known, extra=extra)

    def to_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if k != "extra"}
        return out


def rope_frequencies(args: ModelArgs) -> mx.array | None:
    """Per-dimension RoPE frequencies, or None for plain `base**(-2i/D)`.

    Llama 3 scaling (rope_type "llama3") stretches low frequencies by `factor`
    and interpolates smoothly between `low_freq_factor` and `high_freq_factor`.
    Returned as *periods* scale as `mx.fast.rope(freqs=...)` expects.
    """
    scaling = args.rope_scaling or {}
    rope_type = scaling.get("rope_type", scaling.get("type"))
    if rope_type in (None, "default"):
        return None
    if rope_type == "linear":
        return None  # handled by `scale`
    if rope_type != "llama3":
        raise ValueError(f"unsupported rope_scaling type {rope_type!r} (use default, linear, llama3)")
    dims = args.head_dim
    factor = scaling["factor"]
    low = scaling.get("low_freq_factor", 1.0)
    high = scaling.get("high_freq_factor", 4.0)
    old_ctx = scaling.get("original_max_position_embeddings", 8192)
    low_wavelen = old_ctx / low
    high_wavelen = old_ctx / high
    freqs = args.rope_theta ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims)
    wavelens = 2 * math.pi * freqs
    freqs = mx.where(wavelens > low_wavelen, freqs * factor, freqs)
    is_medium = (wavelens > high_wavelen) & (wavelens < low_wavelen)
    smooth = (old_ctx / wavelens - low) / (high - low)
    smooth_freqs = freqs / ((1 - smooth) / factor + smooth)
    return mx.where(is_medium, smooth_freqs, freqs)


class RoPE(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.dims = args.head_dim
        self.traditional = args.rope_traditional
        scaling = args.rope_scaling or {}
        rope_type = scaling.get("rope_type", scaling.get("type"))
        self.scale = 1.0 / scaling["factor"] if rope_type == "linear" else 1.0
        freqs = rope_frequencies(args)
        self.base = None if freqs is not None else args.rope_theta
        self._freqs = freqs

    def __call__(self, x: mx.array, offset: int, positions: mx.array | None) -> mx.array:
        """x: (B, H, T, D). `positions` (T,) or (B, T) overrides the contiguous `offset + arange(T)`."""
        kw = dict(traditional=self.traditional, base=self.base, scale=self.scale, freqs=self._freqs)
        if positions is None:
            return mx.fast.rope(x, self.dims, offset=offset, **kw)
        # Per-token positions (tree / lookahead steps, batched rows at different offsets):
        # treat each (row, token) as its own batch entry with its own offset, so one call
        # of the same kernel as the contiguous path computes it.
        B, H, T, D = x.shape
        pos = positions.astype(mx.int32)
        if pos.ndim == 1:
            pos = mx.broadcast_to(pos[None], (B, T))
        xt = x.transpose(0, 2, 1, 3).reshape(B * T, H, 1, D)  # (B*T, H, 1, D)
        xt = mx.fast.rope(xt, self.dims, offset=pos.reshape(-1), **kw)
        return xt.reshape(B, T, H, D).transpose(0, 2, 1, 3)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        E, H, Hk, D = args.hidden_size, args.num_attention_heads, args.num_key_value_heads, args.head_dim
        self.n_heads, self.n_kv_heads, self.head_dim = H, Hk, D
        self.scale = D**-0.5
        self.q_proj = nn.Linear(E, H * D, bias=args.attention_bias)
        self.k_proj = nn.Linear(E, Hk * D, bias=args.attention_bias)
        self.v_proj = nn.Linear(E, Hk * D, bias=args.attention_bias)
        self.o_proj = nn.Linear(H * D, E, bias=False)
        self.rope = RoPE(args)

    def __call__(self, x, mask, cache: KVCache | None, positions):
        B, T, _ = x.shape
        q = self.q_proj(x).reshape(B, T, self.n_heads, -1).transpose(0, 2, 1, 3)  # (B, H, T, D)
        k = self.k_proj(x).reshape(B, T, self.n_kv_heads, -1).transpose(0, 2, 1, 3)  # (B, Hk, T, D)
        v = self.v_proj(x).reshape(B, T, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        offset = cache.offset if cache is not None else 0
        q = self.rope(q, offset, positions)
        k = self.rope(k, offset, positions)
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)  # (B, Hk, S, D)
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        E, F = args.hidden_size, args.intermediate_size
        self.gate_proj = nn.Linear(E, F, bias=args.mlp_bias)
        self.up_proj = nn.Linear(E, F, bias=args.mlp_bias)
        self.down_proj = nn.Linear(F, E, bias=args.mlp_bias)

    def __call__(self, x):
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.self_attn = Attention(args)
        self.mlp = MLP(args)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x, mask, cache, positions):
        h = x + self.self_attn(self.input_layernorm(x), mask, cache, positions)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaBody(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [DecoderLayer(args) for _ in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)


class Model(nn.Module):
    """Causal LM. `model(tokens, cache)` -> logits (B, T, V)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model = LlamaBody(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    @property
    def layers(self) -> list[DecoderLayer]:
        return self.model.layers

    def make_cache(self) -> list[KVCache]:
        return [KVCache() for _ in self.model.layers]

    def embed(self, inputs: mx.array) -> mx.array:
        """Token ids (B, T) -> input embeddings (B, T, E)."""
        return self.model.embed_tokens(inputs)

    def head(self, h: mx.array) -> mx.array:
        """Final norm and output projection: hidden (B, T, E) -> logits (B, T, V)."""
        return self.project(self.model.norm(h))

    def project(self, h: mx.array) -> mx.array:
        """Output projection of final-norm hidden states (B, T, E) -> logits (B, T, V)."""
        if self.args.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(h)
        return self.lm_head(h)

    def __call__(
        self,
        inputs: mx.array,
        cache: list[KVCache] | None = None,
        mask: mx.array | str | None = None,
        positions: mx.array | None = None,
        layer_ids: list[int] | None = None,
        return_hidden: bool = False,
    ) -> mx.array | tuple[mx.array, mx.array]:
        """Forward pass.

        inputs: (B, T) token ids. mask: None means causal over cache + new tokens;
        an explicit boolean mask (True = attend) of shape (T, S) or broadcastable to
        (B, 1, T, S) serves tree/lookahead steps and batches of rows at different
        offsets (left padding is masked out; a padded query row should still attend
        to itself so no row is all-False). `positions` (T,) or (B, T) gives each new
        token's RoPE position (default: cache offset + arange(T)). `layer_ids` runs only those
        layers (self-speculative drafting); `cache` must then hold one entry per
        model layer, and only the listed ones are touched. `return_hidden` also
        returns the final-norm hidden states (B, T, E), the features a feature
        drafter reads: (logits, hidden).
        """
        h = self.embed(inputs)
        if mask is None:
            mask = "causal" if inputs.shape[1] > 1 else None
        ids = range(len(self.layers)) if layer_ids is None else layer_ids
        for i in ids:
            h = self.layers[i](h, mask, cache[i] if cache is not None else None, positions)
        if return_hidden:
            h = self.model.norm(h)
            return self.project(h), h
        return self.head(h)
