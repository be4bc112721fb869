"""The Gemma 4 architecture (text; `gemma4_text`, and the language model of `gemma4`).

What differs from Gemma 3:
- norms multiply by w (not 1 + w); values get a scale-free RMSNorm too; attention scale 1
  (q and k are RMS-normalised per head) and no soft-capping inside attention;
- full-attention layers may have their own head size and key/value heads (`per_layer_config`,
  or the older `global_head_dim` / `num_global_key_value_heads`), with "proportional" RoPE:
  the first partial_rotary_factor of each half of the head rotated with periods of the whole
  head size, the rest unrotated; `attention_k_eq_v`: those layers' values are their keys'
  projection (before k's norm);
- the last `num_kv_shared_layers` layers compute no keys or values: each reads those of the
  last earlier layer of its own type (the "store" layers, whose keys and values Gemma 4's
  assistant drafter also reads); with `use_double_wide_mlp` their MLP is twice as wide;
- per-layer inputs (PLE) when hidden_size_per_layer_input > 0: a second embedding table
  (one slice per layer) mixed with a projection of the token embedding, gated into each
  layer's output;
- `enable_moe_block`: a routed mixture of experts beside the dense MLP of every layer;
- every layer's output times a stored `layer_scalar`.

About 480 lines: one architecture, with each difference above written where it applies.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from edgespec.models.base import Model as BaseModel
from edgespec.models.base import ModelArgs as BaseArgs
from edgespec.models.base import RoPE, window_mask
from edgespec.models.experts import SwitchGLU, stack_experts, top_k

from edgespec.caches.kv import HiddenKVCache, KVCache, LayerCache
from edgespec.kernels.activation import gated_activation
from edgespec.kernels.attention import attention
from edgespec.kernels.linear import Linear

ROPE_KINDS = ("default", "proportional")


@dataclass
class ModelArgs(BaseArgs):
    hidden_size_per_layer_input: int = 0
    vocab_size_per_layer_input: int = 0
    attention_k_eq_v: bool = False
    num_kv_shared_layers: int = 0
    enable_moe_block: bool = False
    use_double_wide_mlp: bool = False
    num_experts: int | None = None
    top_k_experts: int | None = None
    moe_intermediate_size: int | None = None
    final_logit_softcapping: float | None = None
    rope_local_base_freq: float = 10000.0
    full_rope_type: str = "proportional"
    full_partial_rotary_factor: float = 0.25
    full_rope_factor: float = 1.0
    layer_head_dims: list[int] | None = None
    layer_kv_heads: list[int] | None = None

    model_types = ("gemma4_text",)
    activations = ("gelu_pytorch_tanh", "gelu")

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> ModelArgs:
        if config.get("model_type") == "gemma4":  # the multimodal checkpoint: its language model
            text = config.get("text_config")
            if not isinstance(text, dict):
                raise ValueError("gemma4 config has no text_config")
            config = {"tie_word_embeddings": config.get("tie_word_embeddings", True), **text,
                      "model_type": "gemma4_text"}
        return super().from_dict(cls._read_rope(dict(config)))

    @staticmethod
    def _read_rope(config: dict[str, Any]) -> dict[str, Any]:
        """Gemma 4's per-layer-type rope_parameters -> this class's fields (the shared reader
        folds one partial_rotary_factor for every layer, which Gemma 4 does not have)."""
        rp = config.pop("rope_parameters", None)
        if rp is None:
            return config
        if not isinstance(rp, dict) or not set(rp) <= {"full_attention", "sliding_attention"}:
            raise ValueError(f"gemma4 rope_parameters must be keyed by layer type, got {rp!r}")
        local = dict(rp.get("sliding_attention") or {})
        if local.get("rope_type", "default") != "default" or local.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError(f"rope_parameters.sliding_attention {local} is not supported (plain RoPE only)")
        if "rope_theta" in local:
            config["rope_local_base_freq"] = local["rope_theta"]
        full = dict(rp.get("full_attention") or {})
        kind = full.pop("rope_type", "default")
        if kind not in ROPE_KINDS:
            raise ValueError(f"rope_parameters.full_attention rope_type {kind!r} is not supported "
                             f"(supported: {', '.join(ROPE_KINDS)})")
        config["full_rope_type"] = kind
        if "rope_theta" in full:
            config["rope_theta"] = full.pop("rope_theta")
        config["full_partial_rotary_factor"] = full.pop("partial_rotary_factor", 1.0)
        config["full_rope_factor"] = full.pop("factor", 1.0)
        if full:
            raise ValueError(f"rope_parameters.full_attention field(s) {sorted(full)} are not supported")
        return config

    @classmethod
    def translate(cls, config: dict[str, Any]) -> dict[str, Any]:
        config = dict(config)
        if "hidden_activation" in config:
            config["hidden_act"] = config.pop("hidden_activation") or config.get("hidden_act")
        config.setdefault("hidden_act", "gelu_pytorch_tanh")
        for k, v in dict(head_dim=256, sliding_window=512, rms_norm_eps=1e-6, rope_theta=1_000_000.0,
                         tie_word_embeddings=True).items():
            if config.get(k) is None:
                config[k] = v
        if config.get("use_bidirectional_attention") not in (None, False):
            raise ValueError("use_bidirectional_attention is not supported (edgespec decodes causally)")
        config.pop("use_bidirectional_attention", None)
        n = config.get("num_hidden_layers") or 0
        types = config.get("layer_types")
        if types is None:
            types = ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(n)]
        types = list(types)
        if types:
            types[-1] = "full_attention"  # as the reference forces
        config["layer_types"] = types
        # Per-layer head size and key/value heads: per_layer_config (transformers 5 writes it),
        # else the older global_head_dim / num_global_key_value_heads for full-attention layers.
        per = config.pop("per_layer_config", None)
        ghd, gkv = config.pop("global_head_dim", 512), config.pop("num_global_key_value_heads", None)
        if per is None:
            kv = gkv if config.get("attention_k_eq_v") else None
            per = {i: {"head_dim": ghd, **({"num_key_value_heads": kv} if kv else {})}
                   for i, t in enumerate(types) if t == "full_attention"}
        per = {int(k): v for k, v in per.items()}
        hd, kvh = config["head_dim"], config.get("num_key_value_heads") or config.get("num_attention_heads")
        for i, over in per.items():
            unknown = set(over) - {"head_dim", "num_key_value_heads"}
            if unknown:
                raise ValueError(f"per_layer_config[{i}] field(s) {sorted(unknown)} are not supported")
        config["layer_head_dims"] = [per.get(i, {}).get("head_dim", hd) for i in range(n)]
        config["layer_kv_heads"] = [per.get(i, {}).get("num_key_value_heads", kvh) for i in range(n)]
        return config

    def __post_init__(self):
        super().__post_init__()
        n = self.num_hidden_layers
        if not 0 <= self.num_kv_shared_layers <= n:
            raise ValueError(f"num_kv_shared_layers must be in 0..{n}, got {self.num_kv_shared_layers}")
        for i in range(n):
            if self.num_attention_heads % self.layer_kv_heads[i]:
                raise ValueError(f"layer {i}: num_attention_heads must be a multiple of its key/value heads")
        if self.enable_moe_block and not (self.num_experts and self.top_k_experts and self.moe_intermediate_size):
            raise ValueError("enable_moe_block needs num_experts, top_k_experts and moe_intermediate_size")
        if self.hidden_size_per_layer_input and not self.vocab_size_per_layer_input:
            raise ValueError("hidden_size_per_layer_input needs vocab_size_per_layer_input")

    def kv_sources(self) -> list[int | None]:
        """Per layer: None (computes its keys and values) or the layer whose it reads. With every
        layer shared (the assistant), -1: they come from outside (the verifier's store layers)."""
        n, first = self.num_hidden_layers, self.num_hidden_layers - self.num_kv_shared_layers
        if first == 0:
            return [-1] * n
        out: list[int | None] = [None] * n
        for i in range(first, n):
            before = [j for j in range(first) if self.layer_types[j] == self.layer_types[i]]
            if not before:
                raise ValueError(f"layer {i} ({self.layer_types[i]}) shares keys and values, but no earlier "
                                 "layer of its type computes them")
            out[i] = before[-1]
        return out

    def store_layers(self) -> dict[str, int]:
        """The last non-shared layer of each type: whose keys and values an assistant reads."""
        first = self.num_hidden_layers - self.num_kv_shared_layers
        return {t: max(j for j in range(first) if self.layer_types[j] == t) for t in set(self.layer_types[:first])}


def rope_for(args: ModelArgs, i: int) -> RoPE:
    """Layer i's rotary embedding over its whole head (periods per rotated pair; inf = unrotated)."""
    D = args.layer_head_dims[i]
    if args.layer_types[i] == "sliding_attention":
        periods = args.rope_local_base_freq ** (mx.arange(0, D, 2, dtype=mx.float32) / D)
    else:
        periods = args.rope_theta ** (mx.arange(0, D, 2, dtype=mx.float32) / D) * args.full_rope_factor
        if args.full_rope_type == "proportional":
            rotated = int(args.full_partial_rotary_factor * D // 2)
            periods = mx.where(mx.arange(D // 2) < rotated, periods, mx.inf)
    mx.eval(periods)  # now: a graph left pending here cannot be evaluated on another thread's stream
    rope = RoPE.__new__(RoPE)
    nn.Module.__init__(rope)
    rope.dims, rope.traditional, rope.scale, rope.base, rope._freqs = D, False, 1.0, None, periods
    return rope


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, i: int, kv_from: int | None = None):
        super().__init__()
        E, H = args.hidden_size, args.num_attention_heads
        self.layer_type = args.layer_types[i]
        D, Hk = args.layer_head_dims[i], args.layer_kv_heads[i]
        self.n_heads, self.n_kv_heads, self.head_dim = H, Hk, D
        self.kv_from = kv_from
        self.eps = args.rms_norm_eps
        self.q_proj = Linear(E, H * D, bias=args.attention_bias)
        self.q_norm = nn.RMSNorm(D, eps=args.rms_norm_eps)
        self.k_eq_v = args.attention_k_eq_v and self.layer_type != "sliding_attention"
        if kv_from is None:
            self.k_proj = Linear(E, Hk * D, bias=args.attention_bias)
            if not self.k_eq_v:
                self.v_proj = Linear(E, Hk * D, bias=args.attention_bias)
            self.k_norm = nn.RMSNorm(D, eps=args.rms_norm_eps)
        self.o_proj = Linear(H * D, E, bias=args.attention_bias)
        self.rope = rope_for(args, i)
        self.window = args.sliding_window if self.layer_type == "sliding_attention" else None

    def __call__(self, x, mask, cache: KVCache | None, positions, shared: dict, key):
        """`shared[key]` receives (keys, values, offset) of this pass, or supplies them (kv_from)."""
        B, T, _ = x.shape
        q = self.q_norm(self.q_proj(x).reshape(B, T, self.n_heads, -1)).transpose(0, 2, 1, 3)
        if self.kv_from is None:
            offset = cache.offset if cache is not None else 0
            raw = self.k_proj(x).reshape(B, T, self.n_kv_heads, -1)
            v = raw if self.k_eq_v else self.v_proj(x).reshape(B, T, self.n_kv_heads, -1)
            k = self.rope(self.k_norm(raw).transpose(0, 2, 1, 3), offset, positions)
            v = mx.fast.rms_norm(v, None, self.eps).transpose(0, 2, 1, 3)
            if cache is not None:
                k, v = cache.update_and_fetch(k, v)
            slots = k.shape[2] if cache is not None and cache.slot_positions else None  # a batched pass
            shared[key] = (k, v, offset, slots)
        else:
            k, v, offset, *rest = shared[key]
            slots = rest[0] if rest else None
        q = self.rope(q, offset, positions)
        if isinstance(mask, dict):  # per layer type, final (the assistant's cross-attention)
            mask = mask[self.layer_type]
        elif self.window is not None:
            mask = window_mask(mask, positions, offset, T, self.window, slots)
        out = attention(q, k, v, 1.0, mask, inference=cache is not None)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, hidden: int, width: int, act: str):
        super().__init__()
        self.gate_proj = Linear(hidden, width, bias=False)
        self.up_proj = Linear(hidden, width, bias=False)
        self.down_proj = Linear(width, hidden, bias=False)
        self._act = act

    def __call__(self, x, inference: bool = False):
        return self.down_proj(gated_activation(self._act, self.gate_proj(x), self.up_proj(x), inference))


class Router(nn.Module):
    """Scale-free RMSNorm, times a learnt scale and 1/sqrt(E), to one logit per expert; the
    top k softmax weights renormalised, times each chosen expert's learnt scale."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        E, N = args.hidden_size, args.num_experts
        self.proj = Linear(E, N, bias=False)
        self.scale = mx.ones((E,))
        self.per_expert_scale = mx.ones((N,))
        self.k, self.eps, self.root = args.top_k_experts, args.rms_norm_eps, E**-0.5

    def __call__(self, x):
        h = mx.fast.rms_norm(x, None, self.eps) * self.scale * self.root
        probs = mx.softmax(self.proj(h).astype(mx.float32), axis=-1)
        w, idx = top_k(probs, self.k)
        w = w / w.sum(axis=-1, keepdims=True)
        return w * self.per_expert_scale[idx], idx


class Experts(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.switch_glu = SwitchGLU(args.hidden_size, args.moe_intermediate_size, args.num_experts, args.hidden_act)

    def __call__(self, x, weights, idx):
        y = self.switch_glu(x, idx)
        return (y * weights[..., None].astype(y.dtype)).sum(axis=-2)


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, i: int, kv_from: int | None = None):
        super().__init__()
        E, eps = args.hidden_size, args.rms_norm_eps
        self.self_attn = Attention(args, i, kv_from)
        wide = args.use_double_wide_mlp and kv_from is not None
        self.mlp = MLP(E, args.intermediate_size * (2 if wide else 1), args.hidden_act)
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            setattr(self, name, nn.RMSNorm(E, eps=eps))
        self.layer_scalar = mx.ones((1,))
        self._moe = args.enable_moe_block
        if self._moe:
            self.router = Router(args)
            self.experts = Experts(args)
            self.post_feedforward_layernorm_1 = nn.RMSNorm(E, eps=eps)
            self.post_feedforward_layernorm_2 = nn.RMSNorm(E, eps=eps)
            self.pre_feedforward_layernorm_2 = nn.RMSNorm(E, eps=eps)
        self._ple = args.hidden_size_per_layer_input
        if self._ple:
            self.per_layer_input_gate = Linear(E, self._ple, bias=False)
            self.per_layer_projection = Linear(self._ple, E, bias=False)
            self.post_per_layer_input_norm = nn.RMSNorm(E, eps=eps)
        self._act = args.hidden_act
        self._index = i

    def __call__(self, x, mask, cache, positions, per_layer_input=None, shared=None):
        if self._ple and per_layer_input is None:
            raise ValueError("a Gemma 4 layer with per-layer inputs runs inside the model's forward, not alone")
        shared = {} if shared is None else shared
        key = self._index if self.self_attn.kv_from is None else self.self_attn.kv_from
        if self.self_attn.kv_from == -1:
            key = self.self_attn.layer_type
        h = x + self.post_attention_layernorm(
            self.self_attn(self.input_layernorm(x), mask, cache, positions, shared, key))
        inference = cache is not None
        m = self.mlp(self.pre_feedforward_layernorm(h), inference)
        if self._moe:
            w, idx = self.router(h)
            moe = self.experts(self.pre_feedforward_layernorm_2(h), w, idx)
            m = self.post_feedforward_layernorm_1(m) + self.post_feedforward_layernorm_2(moe)
        h = h + self.post_feedforward_layernorm(m)
        if self._ple:
            g = gated_activation(self._act, self.per_layer_input_gate(h), per_layer_input, inference)
            h = h + self.post_per_layer_input_norm(self.per_layer_projection(g))
        return h * self.layer_scalar.astype(h.dtype)


class SharedKV(LayerCache):
    """The cache entry of a layer that reads another layer's keys and values: it holds
    nothing (its source's entry holds them), so trimming and keeping are the source's."""

    span_kind = "positions"

    def __init__(self, source: KVCache):
        self.source = source

    @property
    def offset(self) -> int:
        return self.source.offset

    @property
    def keys(self):
        return None

    def trim(self, n: int) -> int:
        return min(max(n, 0), self.source.offset)

    def keep(self, start: int, indices) -> None:
        pass

    def reserve(self, positions: int) -> None:
        pass

    def export_span(self, start: int, end: int):
        return () if 0 <= start < end <= self.offset else None

    def import_span(self, parts) -> None:
        pass

    @property
    def nbytes(self) -> int:
        return 0


class Body(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        E, L, P = args.hidden_size, args.num_hidden_layers, args.hidden_size_per_layer_input
        self.embed_tokens = nn.Embedding(args.vocab_size, E)
        sources = args.kv_sources()
        self.layers = [DecoderLayer(args, i, sources[i]) for i in range(L)]
        self.norm = nn.RMSNorm(E, eps=args.rms_norm_eps)
        if P:
            self.embed_tokens_per_layer = nn.Embedding(args.vocab_size_per_layer_input, L * P)
            self.per_layer_model_projection = Linear(E, L * P, bias=False)
            self.per_layer_projection_norm = nn.RMSNorm(P, eps=args.rms_norm_eps)


class Model(BaseModel):
    embed_scale = True
    layerwise = False  # layers need the model's per-layer inputs / shared keys: no layer-by-layer calls

    def __init__(self, args: ModelArgs):
        nn.Module.__init__(self)
        self.args = args
        self.model = Body(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self._final_softcap = args.final_logit_softcapping
        self._sources = args.kv_sources()

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        out, dropped = {}, []
        for k, v in weights.items():
            if k.startswith("model.language_model."):  # gemma4 (multimodal): its language model
                k = "model." + k[len("model.language_model."):]
            elif k.startswith(("model.vision_tower.", "model.audio_tower.", "model.embed_vision.",
                               "model.embed_audio.", "vision_tower.", "audio_tower.", "multi_modal_projector.")):
                dropped.append(k)
                continue
            out[k] = v
        if dropped:  # a plain attribute (a string), not a parameter
            self.load_note = f"gemma4: {len(dropped)} vision/audio tensors skipped (edgespec runs the text model)"
        out = super().sanitize(out)
        for i, src in enumerate(self._sources):
            if src is not None:  # keys and values come from another layer: the checkpoint's are unused
                for name in ("k_proj", "v_proj", "k_norm", "v_norm"):
                    for suffix in ("weight", "scales", "biases", "bias"):
                        out.pop(f"model.layers.{i}.self_attn.{name}.{suffix}", None)
            if self.args.enable_moe_block:
                out = stack_experts(out, f"model.layers.{i}", self.args.num_experts, into="experts.switch_glu")
        return out

    keep_hidden = False  # set by an assistant drafter: layer 0's cache then records hidden states
    records_layers = False  # its own __call__ and make_cache: no target-layer recording (DFlash drafters refuse it)

    def make_cache(self) -> list:
        caches: list = []
        for i, src in enumerate(self._sources):
            if src is not None:
                caches.append(SharedKV(caches[src]))
            else:
                caches.append(HiddenKVCache() if i == 0 and self.keep_hidden else KVCache())
        return caches

    @staticmethod
    def _hidden_caches(cache) -> list | None:
        """Where this pass records its hidden states: [(HiddenKVCache, row or None, rows' length)]."""
        if cache is None:
            return None
        c0 = cache[0]
        if isinstance(c0, HiddenKVCache):
            return [(c0, None, None)]
        rows = getattr(c0, "caches", None)  # a batched pass (edgespec.batch.forward): one cache per row
        if rows is None:
            return None
        return [(c, b, t) for b, (c, t) in enumerate(zip(rows, c0.lengths, strict=True))
                if isinstance(c, HiddenKVCache)] or None

    def per_layer_inputs(self, inputs: mx.array, h: mx.array) -> mx.array | None:
        """(B, T) ids and their scaled embeddings (B, T, E) -> (B, T, L, P), or None without PLE."""
        P = self.args.hidden_size_per_layer_input
        if not P:
            return None
        B, T = inputs.shape
        L = self.args.num_hidden_layers
        tok = self.model.embed_tokens_per_layer(inputs)
        tok = (tok * mx.array(math.sqrt(P), dtype=tok.dtype)).reshape(B, T, L, P)
        proj = self.model.per_layer_model_projection(h) * mx.array(self.args.hidden_size**-0.5, dtype=h.dtype)
        proj = self.model.per_layer_projection_norm(proj.reshape(B, T, L, P))
        return (proj + tok) * mx.array(2.0**-0.5, dtype=h.dtype)

    def __call__(self, inputs, cache=None, mask=None, positions=None, layer_ids=None, return_hidden=False,
                 last_only=False):
        """As models.base.Model. `layer_ids` (self-speculative drafting) also runs the layers
        whose keys and values a listed layer reads."""
        h = self.embed(inputs)
        ple = self.per_layer_inputs(inputs, h)
        if mask is None:
            mask = "causal" if inputs.shape[1] > 1 else None
        ids = range(len(self.layers))
        if layer_ids is not None:
            ids = sorted(set(layer_ids) | {self._sources[i] for i in layer_ids if self._sources[i] is not None})
        shared: dict = {}
        if cache is not None:  # a shared layer's entry follows its source's (which may have been swapped,
            for i, src in enumerate(self._sources):  # e.g. for a quantized cache, after make_cache)
                if src is not None and isinstance(cache[i], SharedKV):
                    cache[i].source = cache[src]
        for i in ids:
            h = self.layers[i](h, mask, cache[i] if cache is not None else None, positions,
                               ple[:, :, i] if ple is not None else None, shared)
        tap = self._hidden_caches(cache) if layer_ids is None else None
        if return_hidden or tap:
            h = self.model.norm(h)
            for c, b, t in tap or ():
                c.put_hidden(h[b : b + 1, :t] if b is not None else h)
            logits = self.project(h[:, -1:] if last_only else h)
            return (logits, h) if return_hidden else logits
        return self.head(h[:, -1:] if last_only else h)
