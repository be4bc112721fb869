"""DFlash block drafters (arXiv 2602.06036) in MLX: the published checkpoint layout, one forward fills a block.

A DFlash drafter proposes a whole block in one pass. Its inputs are the verifier's hidden states
of a few chosen layers (`target_layer_ids`) at every committed position but the last ("context"),
and a block of `block_size` token embeddings at the positions that follow: the last committed
token, then `mask_token_id` in every other slot. Its output at block slot i >= 1 is its guess of
the token at that slot. The math, as the published reference defines it (the `dflash` package,
dflash/model.py `DFlashDraftModel.forward`, `Qwen3DFlashAttention`, `Qwen3DFlashDecoderLayer`,
`GroupedDynamicCausalConv`, `CandidateSelector`; and dflash/model_mlx.py, the same in MLX):

    c     = hidden_norm(fc(concat_l f_l))                   fused context, (S, E); f_l the output
                                                            of target layer l (HF hidden_states[l+1])
    h_0   = embed(block) * input_embedding_scale            the verifier's own embedding table, (L, E)
    layer: x = input_layernorm(h)
           q = q_norm(q_proj(x)); k = k_norm(k_proj([c; x])); v = v_proj([c; x])
           RoPE: context at its positions, the block at the positions after them
           h = h + o_proj(attention(q, k, v))               non-causal inside the block (unless
                                                            `is_causal`); sliding layers limit both
           h = h + mlp(post_attention_layernorm(h))
    out   = norm(h); logits = lm_head(out) * output_multiplier (softcapped if configured),
            lm_head the verifier's.

DFlash2 (`architectures: ["DFlash2DraftModel"]`) wraps the attention and the MLP of every layer in
a grouped dynamic causal convolution along the block (`attention_conv`, `mlp_conv`): from its
normed input x a projection gives per position, per kernel tap and per channel group a dynamic
weight pair (pre, post); the input of the sub-block is conv(x, base[0] + pre) and its output
conv(y, base[1] + post), conv being causal over block slots (tap o reads slot t - o). And it
carries a candidate selector: the top `selector_top_k` tokens of each slot's logits, rescored by
a low-rank pair term <predecessor(prev) * proj(out_t), successor(candidate)>, picked left to right
from the last committed token.

Only the context's keys and values are cached (`KVCache` per layer, entry j at RoPE position j);
the block's are recomputed at every pass, as the reference crops its cache back after each block.

Config: a Hugging Face `config.json` (model_type qwen3 in the published folders) with the DFlash
fields at top level or under `dflash_config` (the reference reads the latter first). Weight names
are the reference's (`fc.weight`, `hidden_norm.weight`, `layers.{i}.self_attn.q_proj.weight`, ...,
`norm.weight`); the drafter ships no embedding and no output head.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from edgespec.models.base import MLP, make_rope
from edgespec.models.base import ModelArgs as BaseArgs

from edgespec.caches.kv import KVCache
from edgespec.kernels.attention import attention
from edgespec.kernels.linear import Linear

KINDS = {"DFlashDraftModel": "dflash", "DFlash2DraftModel": "dflash2"}
# Fields the reference reads from `dflash_config` before the top level (model.py `_draft_value`).
DFLASH_FIELDS = ("block_size", "target_layer_ids", "mask_token_id", "input_embedding_scale", "output_multiplier",
                 "final_logit_softcapping", "conv_kernel_size", "conv_group_size", "selector_rank",
                 "selector_top_k")


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The reference's default (model.py `build_target_layer_ids`): evenly from layer 1 to L - 3."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [round(start + i * (end - start) / (num_draft_layers - 1)) for i in range(num_draft_layers)]


@dataclass
class ModelArgs(BaseArgs):
    num_target_layers: int = 0
    block_size: int = 16
    target_layer_ids: list[int] | None = None
    mask_token_id: int | None = None
    is_causal: bool | None = None  # None: causal only in sliding layers (the reference's default)
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    conv_kernel_size: int = 0  # DFlash2's grouped dynamic convolution
    conv_group_size: int = 0
    selector_rank: int = 0  # DFlash2's candidate selector
    selector_top_k: int = 0
    kind: str = "dflash"  # "dflash" | "dflash2", from `architectures`

    model_types = ("dflash",)
    activations = ("silu",)

    def __post_init__(self):
        super().__post_init__()
        if self.kind not in KINDS.values():
            raise ValueError(f"DFlash kind {self.kind!r}; known: {', '.join(KINDS.values())}")
        if self.target_layer_ids is None:
            if self.num_target_layers < 1:
                raise ValueError("a DFlash config needs target_layer_ids (or num_target_layers)")
            self.target_layer_ids = default_target_layer_ids(self.num_target_layers, self.num_hidden_layers)
        self.target_layer_ids = [int(i) for i in self.target_layer_ids]
        if not self.target_layer_ids or min(self.target_layer_ids) < 0:
            raise ValueError(f"target_layer_ids must be non-negative layer indices, got {self.target_layer_ids}")
        if self.mask_token_id is None or int(self.mask_token_id) < 0:
            raise ValueError("a DFlash config needs a non-negative mask_token_id")
        self.mask_token_id = int(self.mask_token_id)
        if not 2 <= int(self.block_size) <= 64:
            raise ValueError(f"block_size {self.block_size}: edgespec runs blocks of 2..64 slots")
        self.block_size = int(self.block_size)
        if self.kind == "dflash2":
            K, G = self.conv_kernel_size, self.conv_group_size
            if K < 1 or G < 1 or self.hidden_size % G:
                raise ValueError(f"DFlash2 needs conv_kernel_size >= 1 and a conv_group_size dividing "
                                 f"hidden_size {self.hidden_size}; got {K}, {G}")
            if self.selector_rank < 1 or not 1 <= self.selector_top_k <= self.vocab_size:
                raise ValueError(f"DFlash2 needs selector_rank >= 1 and 1 <= selector_top_k <= vocab_size; "
                                 f"got {self.selector_rank}, {self.selector_top_k}")

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> ModelArgs:
        """From a published DFlash `config.json` (HF names; DFlash fields under `dflash_config` or at top level)."""
        cfg = dict(config)
        nested = cfg.pop("dflash_config", None) or {}
        if not isinstance(nested, dict):
            raise ValueError("dflash_config must be an object")
        unknown = sorted(set(nested) - set(DFLASH_FIELDS))
        if unknown:
            raise ValueError(f"dflash_config field(s) {', '.join(unknown)} not understood by edgespec's DFlash "
                             "implementation; refused rather than run with them ignored")
        cfg.update(nested)
        archs = [a for a in cfg.get("architectures") or [] if a in KINDS]
        cfg["kind"] = KINDS[archs[0]] if archs else cfg.get("kind", "dflash")
        cfg["model_type"] = "dflash"  # published folders say qwen3: the decoder below is DFlash's own
        cfg.pop("attention_dropout", None)  # training only
        return super().from_dict(cfg)

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        out["architectures"] = [k for k, v in KINDS.items() if v == self.kind]
        return out


class Attention(nn.Module):
    """Queries from the block; keys and values from the cached context, the new context and the block."""

    def __init__(self, args: ModelArgs, i: int):
        super().__init__()
        E, H, Hk, D = args.hidden_size, args.num_attention_heads, args.num_key_value_heads, args.head_dim
        self.n_heads, self.n_kv_heads, self.scale = H, Hk, D**-0.5
        self.q_proj = Linear(E, H * D, bias=args.attention_bias)
        self.k_proj = Linear(E, Hk * D, bias=args.attention_bias)
        self.v_proj = Linear(E, Hk * D, bias=args.attention_bias)
        self.o_proj = Linear(H * D, E, bias=args.attention_bias)
        self.q_norm = nn.RMSNorm(D, eps=args.rms_norm_eps)
        self.k_norm = nn.RMSNorm(D, eps=args.rms_norm_eps)
        self.rope = make_rope(args)
        sliding = args.window(i) is not None
        self.window = args.window(i)
        self.causal = sliding if args.is_causal is None else bool(args.is_causal)

    def _kv(self, x: mx.array, offset: int) -> tuple[mx.array, mx.array]:
        B, T, _ = x.shape
        k = self.k_norm(self.k_proj(x).reshape(B, T, self.n_kv_heads, -1)).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(B, T, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        return self.rope(k, offset, None), v

    def __call__(self, x: mx.array, ctx: mx.array | None, cache: KVCache) -> mx.array:
        """x (B, L, E) block, ctx (B, S, E) fused new context (or None) -> (B, L, E).

        The context goes into `cache` (positions offset..offset+S-1); the block sits after it."""
        B, L, _ = x.shape
        if ctx is not None and ctx.shape[1]:
            kc, vc = self._kv(ctx, cache.offset)
            kc, vc = cache.update_and_fetch(kc, vc)
        else:
            kc, vc = cache.keys[..., : cache.offset, :], cache.values[..., : cache.offset, :]
        C = cache.offset
        q = self.q_norm(self.q_proj(x).reshape(B, L, self.n_heads, -1)).transpose(0, 2, 1, 3)
        q = self.rope(q, C, None)
        kb, vb = self._kv(x, C)
        k, v = mx.concatenate([kc, kb], axis=2), mx.concatenate([vc, vb], axis=2)
        mask = block_mask(C, L, self.causal, self.window)
        out = attention(q, k, v, self.scale, mask, inference=False)  # also trained: no numpy path
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


def block_mask(C: int, L: int, causal: bool, window: int | None) -> mx.array | None:
    """(L, C + L) bool, True = attend: block slot t (position C + t) against every key (the
    reference's `_attention_mask`); None = all visible."""
    if not causal and window is None:
        return None
    q = C + mx.arange(L)[:, None]
    k = mx.arange(C + L)[None]
    visible = mx.ones((L, C + L), dtype=mx.bool_)
    if causal:
        visible = visible & (k <= q)
    if window is not None:
        visible = visible & (q - k < window)
        if not causal:
            visible = visible & (k - q < window)
    return visible


class GroupedDynamicConv(nn.Module):
    """DFlash2's grouped dynamic causal convolution over block slots (kernel K, channel groups of size g)."""

    def __init__(self, E: int, K: int, g: int):
        super().__init__()
        self.K, self.g = K, g
        self.base_kernel = mx.zeros((2, K, E))
        self.kernel_projection = Linear(E, 2 * K * (E // g), bias=False)

    def convolve(self, x: mx.array, dynamic: mx.array, base: mx.array) -> mx.array:
        """x (B, L, E); dynamic (B, L, K, G) and base (K, E) -> sum_o (base[o] + dynamic[:, :, o]) * x shifted by o."""
        B, L, E = x.shape
        G = E // self.g
        xs = x.reshape(B, L, G, self.g)
        out = mx.zeros_like(xs)
        for o in range(min(self.K, L)):
            shifted = xs if o == 0 else mx.concatenate([mx.zeros_like(xs[:, :o]), xs[:, : L - o]], axis=1)
            w = base[o].reshape(1, 1, G, self.g).astype(x.dtype) + dynamic[:, :, o, :, None]
            out = out + w * shifted
        return out.reshape(B, L, E)

    def prepare(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """x (B, L, E) -> (the sub-block's input, the dynamic weights of its output (B, L, K, G))."""
        B, L, E = x.shape
        dyn = self.kernel_projection(x).reshape(B, L, 2, self.K, E // self.g)
        return self.convolve(x, dyn[:, :, 0], self.base_kernel[0]), dyn[:, :, 1]

    def finish(self, y: mx.array, dynamic: mx.array) -> mx.array:
        return self.convolve(y, dynamic, self.base_kernel[1])


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, i: int):
        super().__init__()
        E, eps = args.hidden_size, args.rms_norm_eps
        self.self_attn = Attention(args, i)
        self.mlp = MLP(args)
        self.input_layernorm = nn.RMSNorm(E, eps=eps)
        self.post_attention_layernorm = nn.RMSNorm(E, eps=eps)
        self._conv = args.kind == "dflash2"
        if self._conv:
            self.attention_conv = GroupedDynamicConv(E, args.conv_kernel_size, args.conv_group_size)
            self.mlp_conv = GroupedDynamicConv(E, args.conv_kernel_size, args.conv_group_size)

    def __call__(self, h: mx.array, ctx: mx.array | None, cache: KVCache) -> mx.array:
        x = self.input_layernorm(h)
        if self._conv:
            x, post = self.attention_conv.prepare(x)
            h = h + self.attention_conv.finish(self.self_attn(x, ctx, cache), post)
            x, post = self.mlp_conv.prepare(self.post_attention_layernorm(h))
            return h + self.mlp_conv.finish(self.mlp(x), post)
        h = h + self.self_attn(x, ctx, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class CandidateSelector(nn.Module):
    """DFlash2's rescoring of each slot's top candidates by the token picked before it."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.top_k = args.selector_top_k
        self.predecessor_codebook = nn.Embedding(args.vocab_size, args.selector_rank)
        self.successor_codebook = nn.Embedding(args.vocab_size, args.selector_rank)
        self.hidden_projection = Linear(args.hidden_size, args.selector_rank, bias=False)

    def candidates(self, logits: mx.array) -> tuple[mx.array, mx.array]:
        """logits (L, V) -> (the top_k ids (L, k), their logits (L, k)); order within a row is free."""
        ids = mx.argpartition(logits, -self.top_k, axis=-1)[..., -self.top_k :]
        return ids, mx.take_along_axis(logits, ids, axis=-1)

    def scores(self, proj: mx.array, prev: mx.array, cand: mx.array, unary: mx.array) -> mx.array:
        """One slot: proj (R,) = hidden_projection(out_t), prev () the token before, cand/unary (k,) -> (k,)."""
        a = self.predecessor_codebook(prev.reshape(1))[0] * proj  # (R,)
        return unary + self.successor_codebook(cand) @ a


class Model(nn.Module):
    """The drafter's own weights: fc, hidden_norm, layers, norm (and DFlash2's selector)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        E = args.hidden_size
        self.fc = Linear(len(args.target_layer_ids) * E, E, bias=False)
        self.hidden_norm = nn.RMSNorm(E, eps=args.rms_norm_eps)
        self.layers = [DecoderLayer(args, i) for i in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(E, eps=args.rms_norm_eps)
        if args.kind == "dflash2":
            self.candidate_selector = CandidateSelector(args)

    def make_cache(self) -> list[KVCache]:
        return [KVCache() for _ in self.layers]

    def fuse(self, features: mx.array) -> mx.array:
        """Target-layer features (B, S, n*E), concatenated in target_layer_ids order -> context (B, S, E)."""
        return self.hidden_norm(self.fc(features))

    def __call__(self, emb: mx.array, features: mx.array | None, cache: list[KVCache]) -> mx.array:
        """emb (B, L, E) block embeddings (already scaled), features (B, S, n*E) of the S context
        positions not yet in `cache` (or None) -> final-norm block states (B, L, E)."""
        ctx = self.fuse(features.astype(emb.dtype)) if features is not None and features.shape[1] else None
        h = emb
        for layer, c in zip(self.layers, cache, strict=True):
            h = layer(h, ctx, c)
        return self.norm(h)

    def scale_logits(self, logits: mx.array) -> mx.array:
        """The verifier head's logits -> the drafter's (output_multiplier, then the softcap)."""
        if self.args.output_multiplier != 1.0:
            logits = logits * self.args.output_multiplier
        cap = self.args.final_logit_softcapping
        if cap is not None and cap > 0:
            logits = mx.tanh(logits / cap) * cap
        return logits

    @staticmethod
    def sanitize(weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Published names -> this module's: the selector's codebooks are stored without `.weight`
        (the reference maps them the same way), RoPE buffers dropped, a `model.` prefix stripped."""
        out = {}
        for k, v in weights.items():
            if "rotary_emb.inv_freq" in k:
                continue
            if k.startswith("model."):
                k = k[len("model.") :]
            if k in ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook"):
                k = f"{k}.weight"
            out[k] = v
        return out
