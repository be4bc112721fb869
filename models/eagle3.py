"""EAGLE-3 draft heads (arXiv 2503.01840) in MLX: the published layouts' math, one head step per drafted token.

An EAGLE-3 head drafts from the verifier's own hidden states. Its inputs at committed position j
are the verifier's hidden states of a few layers ("aux" layers, low / mid / high: by default
2, L // 2 and L - 3 of an L-layer verifier) at position j, fused by `fc`, paired with the
embedding of the token at j + 1; its output predicts the token at j + 2. A drafted step pairs the
head's own output state with the embedding of the token it just drafted. The math, as the
`speculators` package defines it (speculators/models/eagle3/core.py `Eagle3DraftModel.forward`,
model_definitions.py `Eagle3FirstLayerMixin`, and the EAGLE authors' layer its converter reads,
convert/eagle/eagle3_legacy_model.py `Eagle3DecoderLayer`):

    g     = fc(concat_l f_l)                  the fused verifier states, (T, E); f_l the verifier's
                                              HF hidden_states[l] (the input of layer l), optionally
                                              normed first (`norm_before_fc`: one RMSNorm over the
                                              concatenation; `fc_norm`: one RMSNorm per layer)
    layer 0: e = input_layernorm(embed(x)); r = hidden_norm(g)
           h = (r if norm_before_residual else g) + o_proj(attention([e; r]))   q/k/v read 2E
           h = h + mlp(post_attention_layernorm(h))
    layers 1..: ordinary decoder layers (Llama, or Qwen3 with q/k norms)
    logits = lm_head(norm(h)) over the draft vocabulary (draft_vocab_size rows);
             draft id d is the verifier's token d + d2t[d]
    the next step reads h (or norm(h) with `norm_output`) in place of g.

Attention is causal over the head's own entries; entry j sits at RoPE position j + 1 (the
position of the token it embeds). The head's keys and values go in a `KVCache` per layer.

Configs. The EAGLE authors' layout is a Llama `config.json` (architectures
`LlamaForCausalLMEagle3`, `draft_vocab_size`, `vocab_size` the verifier's, optionally
`target_hidden_size` and `eagle_config.eagle_aux_hidden_state_layer_ids`) with weights named
`midlayer.*`, `fc.weight`, `norm.weight`, `lm_head.weight`, `d2t`, `t2d` (and sometimes
`embed_tokens.weight`). The `speculators` layout is a config with `speculators_model_type:
"eagle3"`, the decoder's config under `transformer_layer_config` (model_type llama or qwen3), the
EAGLE fields at top level and `speculators_config` (algorithm, proposal methods, the verifier's
name), with weights named `layers.{i}.*`, `fc.weight`, `norm.weight`, `lm_head.weight`, `d2t`,
`t2d`, `embed_tokens.weight` (and `input_norm.weight`, `fc_norm.{i}.weight` when configured).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from edgespec.models.base import MLP, _harmless, make_rope
from edgespec.models.base import ModelArgs as BaseArgs

from edgespec.caches.kv import KVCache
from edgespec.kernels.attention import attention
from edgespec.kernels.linear import Linear

LAYOUTS = ("eagle", "speculators")
LAYER_TYPES = ("llama", "qwen3")  # the decoder layer the head is built of (qwen3: q/k norms)
# The EAGLE fields of a speculators config (top level) and of an EAGLE authors' config.
EAGLE_FIELDS = ("draft_vocab_size", "norm_before_residual", "target_hidden_size", "eagle_aux_hidden_state_layer_ids",
                "norm_before_fc", "fc_norm", "norm_output")
# Bookkeeping of a speculators config (no effect on the head's math).
SPECULATORS_HARMLESS = ("speculators_model_type", "speculators_config", "speculators_version", "architectures",
                        "embed_requires_grad", "auto_map", "transformers_version", "torch_dtype", "dtype",
                        "has_no_defaults_at_init")


def default_layer_ids(num_target_layers: int) -> list[int]:
    """The aux layers EAGLE-3 reads when a head names none (the authors' and the speculators'
    default, speculators/models/utils.py `resolve_target_layer_ids`)."""
    return [2, num_target_layers // 2, num_target_layers - 3]


@dataclass
class ModelArgs(BaseArgs):
    draft_vocab_size: int = 0  # 0: the verifier's vocabulary (no d2t map)
    target_hidden_size: int | None = None  # the verifier's hidden size where it differs
    target_layer_ids: list[int] | None = None  # HF hidden_states indices; None: default_layer_ids
    norm_before_residual: bool = False
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_output: bool = False
    num_aux: int = 3
    layer_type: str = "llama"  # llama | qwen3
    layout: str = "eagle"  # eagle | speculators (where the config came from)

    model_types = ("eagle3",)
    activations = ("silu",)

    def __post_init__(self):
        super().__post_init__()
        if self.layer_type not in LAYER_TYPES:
            raise ValueError(f"an EAGLE-3 head of {self.layer_type!r} layers; edgespec reads {', '.join(LAYER_TYPES)}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout {self.layout!r}; known: {', '.join(LAYOUTS)}")
        if self.norm_before_fc and self.fc_norm:
            raise ValueError("norm_before_fc and fc_norm are mutually exclusive")
        if not self.draft_vocab_size:
            self.draft_vocab_size = self.vocab_size
        if not 1 <= int(self.draft_vocab_size) <= self.vocab_size:
            raise ValueError(f"draft_vocab_size {self.draft_vocab_size} must be 1..vocab_size ({self.vocab_size})")
        if self.target_layer_ids is not None:
            ids = [int(i) for i in self.target_layer_ids]
            if not ids or min(ids) < 0 or len(set(ids)) != len(ids):
                raise ValueError(f"eagle_aux_hidden_state_layer_ids must be distinct non-negative layer ids, got {ids}")
            self.target_layer_ids = ids
            self.num_aux = len(ids)
        if self.target_hidden_size is None:
            self.target_hidden_size = self.hidden_size

    @property
    def uses_draft_vocab(self) -> bool:
        return self.draft_vocab_size != self.vocab_size

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> ModelArgs:
        """From either published config.json (see the module notes)."""
        if not isinstance(config, dict):
            raise ValueError("config.json must hold an object")
        if config.get("speculators_model_type") is not None:
            return cls._from_speculators(config)
        return cls._from_eagle(config)

    @classmethod
    def _from_speculators(cls, config: dict[str, Any]) -> ModelArgs:
        if config.get("speculators_model_type") != "eagle3":
            raise ValueError(f"speculators_model_type {config.get('speculators_model_type')!r} is not an EAGLE-3 "
                             "head (eagle3)")
        layer = config.get("transformer_layer_config")
        if not isinstance(layer, dict):
            raise ValueError("a speculators EAGLE-3 config needs transformer_layer_config (an object)")
        spec = config.get("speculators_config")
        if spec is not None and (not isinstance(spec, dict) or spec.get("algorithm", "eagle3") != "eagle3"):
            raise ValueError("speculators_config must be an object whose algorithm is eagle3")
        known = set(EAGLE_FIELDS) | set(SPECULATORS_HARMLESS) | {"transformer_layer_config"}
        unknown = sorted(k for k, v in config.items() if k not in known and not _harmless(k, v)
                         and not (k == "tie_word_embeddings" and not v))
        if unknown:
            raise ValueError(f"speculators field(s) {', '.join(unknown)} not understood by edgespec's EAGLE-3 "
                             "implementation; refused rather than run with them ignored")
        cfg = dict(layer)
        cfg.update({k: config[k] for k in EAGLE_FIELDS if config.get(k) is not None})
        return cls._build(cfg, "speculators")

    @classmethod
    def _from_eagle(cls, config: dict[str, Any]) -> ModelArgs:
        cfg = dict(config)
        nested = cfg.pop("eagle_config", None) or {}
        if not isinstance(nested, dict):
            raise ValueError("eagle_config must be an object")
        if nested.get("use_aux_hidden_state") is False:
            raise ValueError("eagle_config.use_aux_hidden_state is false: an EAGLE-1/2 head, not EAGLE-3")
        nested = {k: v for k, v in nested.items() if k != "use_aux_hidden_state"}
        unknown = sorted(set(nested) - set(EAGLE_FIELDS))
        if unknown:
            raise ValueError(f"eagle_config field(s) {', '.join(unknown)} not understood by edgespec's EAGLE-3 "
                             "implementation; refused rather than run with them ignored")
        cfg.update(nested)
        if cfg.get("draft_vocab_size") is None and "LlamaForCausalLMEagle3" not in (cfg.get("architectures") or []):
            raise ValueError("not an EAGLE-3 head config (no draft_vocab_size, no LlamaForCausalLMEagle3)")
        return cls._build(cfg, "eagle")

    @classmethod
    def _build(cls, cfg: dict[str, Any], layout: str) -> ModelArgs:
        cfg["layer_type"] = cfg.get("model_type", "llama")
        cfg["model_type"] = "eagle3"
        cfg["layout"] = layout
        ids = cfg.pop("eagle_aux_hidden_state_layer_ids", None)
        if ids is not None:
            if not isinstance(ids, list):
                raise ValueError("eagle_aux_hidden_state_layer_ids must be a list of layer ids")
            cfg["target_layer_ids"] = ids
        for k in ("architectures", "pretraining_tp", "attention_dropout", "initializer_range", "use_cache",
                  "torch_dtype", "dtype", "pad_token_id", "transformers_version", "_attn_implementation"):
            cfg.pop(k, None)
        if cfg.get("head_dim") is None:
            cfg.pop("head_dim", None)
        return super().from_dict(cfg)

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        out["model_type"] = self.layer_type
        out.pop("layer_type")
        out.pop("layout")
        out.pop("num_aux")
        out["eagle_aux_hidden_state_layer_ids"] = out.pop("target_layer_ids")
        out["architectures"] = ["LlamaForCausalLMEagle3"]
        return out


class Attention(nn.Module):
    """Causal self-attention over the head's entries; layer 0 reads [embedding; state] (2E)."""

    def __init__(self, args: ModelArgs, in_dim: int):
        super().__init__()
        H, Hk, D = args.num_attention_heads, args.num_key_value_heads, args.head_dim
        self.n_heads, self.n_kv_heads, self.scale = H, Hk, D**-0.5
        self.q_proj = Linear(in_dim, H * D, bias=args.attention_bias)
        self.k_proj = Linear(in_dim, Hk * D, bias=args.attention_bias)
        self.v_proj = Linear(in_dim, Hk * D, bias=args.attention_bias)
        self.o_proj = Linear(H * D, args.hidden_size, bias=args.attention_bias)
        self.qk_norm = args.layer_type == "qwen3"
        if self.qk_norm:
            self.q_norm = nn.RMSNorm(D, eps=args.rms_norm_eps)
            self.k_norm = nn.RMSNorm(D, eps=args.rms_norm_eps)
        self.rope = make_rope(args)

    def __call__(self, x: mx.array, cache: KVCache, mask: mx.array | None = None,
                 positions: mx.array | None = None) -> mx.array:
        """mask (T, C + T) bool and positions (T,) (entry indices): a tree of drafted entries over
        the cache (edgespec.kernels.tree_mask); None: causal entries after the cache."""
        B, T, _ = x.shape
        q = self.q_proj(x).reshape(B, T, self.n_heads, -1)
        k = self.k_proj(x).reshape(B, T, self.n_kv_heads, -1)
        v = self.v_proj(x).reshape(B, T, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        C = cache.offset
        pos = None if positions is None else positions + 1
        q = self.rope(q.transpose(0, 2, 1, 3), C + 1, pos)  # entry j at position j + 1
        k = self.rope(k.transpose(0, 2, 1, 3), C + 1, pos)
        k, v = cache.update_and_fetch(k, v)
        if mask is None and T > 1:
            mask = (mx.arange(C + T)[None] <= (C + mx.arange(T))[:, None])
        out = attention(q, k, v, self.scale, mask, inference=False)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, T, -1))


class FirstLayer(nn.Module):
    """EAGLE-3's layer 0: [input_layernorm(embedding); hidden_norm(state)] into attention."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        E, eps = args.hidden_size, args.rms_norm_eps
        self.norm_before_residual = args.norm_before_residual
        self.self_attn = Attention(args, 2 * E)
        self.mlp = MLP(args)
        self.input_layernorm = nn.RMSNorm(E, eps=eps)
        self.hidden_norm = nn.RMSNorm(E, eps=eps)
        self.post_attention_layernorm = nn.RMSNorm(E, eps=eps)

    def __call__(self, emb: mx.array, g: mx.array, cache: KVCache, mask=None, positions=None) -> mx.array:
        r = self.hidden_norm(g)
        x = mx.concatenate([self.input_layernorm(emb), r], axis=-1)
        h = (r if self.norm_before_residual else g) + self.self_attn(x, cache, mask, positions)
        return h + self.mlp(self.post_attention_layernorm(h))


class Layer(nn.Module):
    """Layers 1..: an ordinary pre-norm decoder layer."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        E, eps = args.hidden_size, args.rms_norm_eps
        self.self_attn = Attention(args, E)
        self.mlp = MLP(args)
        self.input_layernorm = nn.RMSNorm(E, eps=eps)
        self.post_attention_layernorm = nn.RMSNorm(E, eps=eps)

    def __call__(self, h: mx.array, cache: KVCache, mask=None, positions=None) -> mx.array:
        h = h + self.self_attn(self.input_layernorm(h), cache, mask, positions)
        return h + self.mlp(self.post_attention_layernorm(h))


class Model(nn.Module):
    """The head's own weights: fc (and its norms), the layers, norm, lm_head, d2t."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        E, eps, n = args.hidden_size, args.rms_norm_eps, args.num_aux
        Et = args.target_hidden_size
        self.fc = Linear(n * Et, E, bias=False)
        if args.norm_before_fc:
            self.input_norm = nn.RMSNorm(n * Et, eps=eps)
        if args.fc_norm:
            self.fc_norm = [nn.RMSNorm(Et, eps=eps) for _ in range(n)]
        self.layers = [FirstLayer(args)] + [Layer(args) for _ in range(1, args.num_hidden_layers)]
        self.norm = nn.RMSNorm(E, eps=eps)
        self.lm_head = Linear(E, args.draft_vocab_size, bias=False)
        if args.uses_draft_vocab:
            self.d2t = mx.zeros((args.draft_vocab_size,), dtype=mx.int32)

    def make_cache(self) -> list[KVCache]:
        return [KVCache() for _ in self.layers]

    def fuse(self, features: mx.array) -> mx.array:
        """The verifier's aux-layer states (B, T, n*Et), concatenated in layer-id order -> (B, T, E)."""
        if self.args.norm_before_fc:
            features = self.input_norm(features)
        elif self.args.fc_norm:
            parts = mx.split(features, self.args.num_aux, axis=-1)
            features = mx.concatenate([norm(p) for norm, p in zip(self.fc_norm, parts, strict=True)], axis=-1)
        return self.fc(features)

    def __call__(self, emb: mx.array, g: mx.array, cache: list[KVCache], mask=None, positions=None) -> mx.array:
        """emb (B, T, E) the embedded tokens, g (B, T, E) the states they pair with (fused verifier
        states or the head's own) -> the last layer's output (B, T, E), before the final norm.
        mask, positions: the entries are tree nodes over the cache (see Attention)."""
        h = self.layers[0](emb, g, cache[0], mask, positions)
        for layer, c in zip(self.layers[1:], cache[1:], strict=True):
            h = layer(h, c, mask, positions)
        return h

    def logits(self, h: mx.array) -> mx.array:
        """Layer output (..., E) -> logits over the draft vocabulary (..., draft_vocab_size)."""
        return self.lm_head(self.norm(h))

    def feedback(self, h: mx.array) -> mx.array:
        """The state the next drafted step reads (norm_output: the normed one)."""
        return self.norm(h) if self.args.norm_output else h

    def target_ids(self) -> mx.array:
        """(draft_vocab_size,) the verifier's token of each draft id (d + d2t[d])."""
        d = mx.arange(self.args.draft_vocab_size, dtype=mx.int32)
        return d + self.d2t.astype(mx.int32) if self.args.uses_draft_vocab else d

    @staticmethod
    def sanitize(weights: dict[str, mx.array]) -> tuple[dict[str, mx.array], mx.array | None]:
        """Published names -> this module's, and the folder's own embedding table (or None): the
        authors' `midlayer.` is layer 0, `t2d` (implied by d2t) and the verifier's copies dropped,
        a `model.` prefix stripped."""
        out, embed = {}, None
        for k, v in weights.items():
            if k.startswith("model."):
                k = k[len("model.") :]
            if k.startswith("midlayer."):
                k = "layers.0." + k[len("midlayer.") :]
            if "rotary_emb.inv_freq" in k or k in ("t2d", "verifier_lm_head.weight", "verifier_norm.weight"):
                continue
            if k == "embed_tokens.weight":
                embed = v
                continue
            out[k] = v
        return out, embed
