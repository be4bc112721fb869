"""Shared parts of every decoder: config reading, RoPE, attention, norms, MLP, the decoder body.

An architecture file (llama.py, gemma2.py, ...) is a ModelArgs subclass that reads its
config fields plus a Model subclass that picks per-layer options; everything that does
the math lives here. Weight names follow Hugging Face (`model.layers.{i}.self_attn.q_proj
.weight`, ...), so a safetensors folder loads as is after the architecture's `sanitize`.

Shapes: B batch, T new tokens, S cached + new tokens, H query heads, Hk key/value heads,
D head dim, E hidden size, V vocabulary.

About 750 lines, on purpose: this is every decoder's math in one place (config reading, the
RoPE variants, attention, norms, MLPs, the body); split up, each architecture file would
import from half a dozen modules instead of one.
"""

from __future__ import annotations

import inspect
import math
import os
import threading
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from edgespec.models.registry import supported_model_types

from edgespec.caches.kv import HiddenKVCache, KVCache
from edgespec.kernels import base2, exact
from edgespec.kernels.activation import gated_activation
from edgespec.kernels.attention import attention, numpy_attention, use_numpy_attention
from edgespec.kernels.linear import Linear
from edgespec.kernels.spec import on_metal

# Config fields that never change the forward math of a decoder in inference (bookkeeping,
# training-only knobs, generation defaults). Every other field must be read by the
# architecture's ModelArgs, or the config is refused naming it: a field silently
# defaulted is how a checkpoint loads fine and then drifts.
HARMLESS_FIELDS = frozenset("""
    architectures model_type transformers_version torch_dtype dtype use_cache initializer_range
    id2label label2id return_dict chunk_size_feed_forward is_encoder_decoder problem_type
    pretraining_tp tokenizer_class auto_map quantization quantization_config is_llama_config
    transformers.js_config rope_interleaved tie_encoder_decoder torchscript prefix
    finetuning_task task_specific_params pruned_heads add_cross_attention is_decoder
    cross_attention_hidden_size tf_legacy_loss use_return_dict num_labels cache_implementation
    max_length min_length do_sample early_stopping num_beams num_beam_groups diversity_penalty
    temperature top_k top_p typical_p repetition_penalty length_penalty no_repeat_ngram_size
    encoder_no_repeat_ngram_size bad_words_ids num_return_sequences remove_invalid_values
    exponential_decay_length_penalty suppress_tokens begin_suppress_tokens
    original_max_position_embeddings unsloth_fixed unsloth_version max_window_layers
""".split())

# Fields harmless only at these values (anything else changes the math and is refused).
HARMLESS_AT = {"use_bidirectional_attention": (None, False), "is_causal": (None, True),
               "use_sliding_window": (None, False), "_sliding_window_pattern": None,
               "use_mrope": (None, False)}

ROPE_TYPES = ("default", "linear", "llama3", "longrope", "su")  # su: LongRoPE's old name
LAYER_TYPES = ("full_attention", "sliding_attention")


def _harmless(key: str, value: Any) -> bool:
    if key in HARMLESS_FIELDS or key.startswith("_"):
        # Leading underscore: metadata transformers writes (_name_or_path, _model_name_or_path,
        # _attn_implementation_autoset, ...), never a field of the model's math.
        return True
    if key in HARMLESS_AT:
        allowed = HARMLESS_AT[key]
        return allowed is None or value in allowed
    return (key.endswith(("_token_id", "_token_ids")) or "dropout" in key or "pdrop" in key
            or key.startswith("output_"))


def _rope_split(params: dict[str, Any], where: str) -> tuple[float | None, dict | None, float | None]:
    """One v5 rope_parameters dict -> (rope_theta, rope_scaling or None, partial_rotary_factor)."""
    if not isinstance(params, dict):
        raise ValueError(f"{where} must be an object, got {params!r}")
    params = dict(params)
    theta = params.pop("rope_theta", None)
    partial = params.pop("partial_rotary_factor", None)
    rope_type = params.get("rope_type", params.get("type", "default"))
    scaling = None if rope_type == "default" and len(params) <= 1 else params
    return theta, scaling, partial


def normalize_rope(config: dict[str, Any]) -> dict[str, Any]:
    """Fold transformers v5 `rope_parameters` into the v4 fields every ModelArgs reads.

    v5 writes {"rope_theta", "rope_type", ...scaling} (or one such dict per layer type:
    {"full_attention": ..., "sliding_attention": ...}, Gemma 3); v4 writes `rope_theta`,
    `rope_scaling` (and Gemma 3's `rope_local_base_freq`). Both given and disagreeing is
    refused: which one the checkpoint was trained with cannot be told.
    """
    rp = config.get("rope_parameters")
    if rp is None:
        return config
    out = {k: v for k, v in config.items() if k != "rope_parameters"}
    if isinstance(rp, dict) and rp and all(isinstance(v, dict) for v in rp.values()):
        unknown = sorted(set(rp) - set(LAYER_TYPES))
        if unknown:
            raise ValueError(f"rope_parameters has unknown layer type(s) {unknown}; known: {list(LAYER_TYPES)}")
        new = {}
        if "full_attention" in rp:
            new["rope_theta"], new["rope_scaling"], partial = _rope_split(
                rp["full_attention"], "rope_parameters.full_attention")
        if "sliding_attention" in rp:
            theta, scaling, partial = _rope_split(rp["sliding_attention"], "rope_parameters.sliding_attention")
            if scaling is not None:
                raise ValueError("rope_parameters.sliding_attention with rope scaling is not supported")
            new["rope_local_base_freq"] = theta
    else:
        theta, scaling, partial = _rope_split(rp, "rope_parameters")
        new = {"rope_theta": theta, "rope_scaling": scaling}
    if partial is not None:
        new["partial_rotary_factor"] = partial
    for k, v in new.items():
        if v is None:
            continue
        old = out.get(k)
        if old is not None and old != v:
            raise ValueError(f"config gives {k}={old!r} and rope_parameters gives {v!r}; refusing to guess")
        out[k] = v
    return out


def gated_window(config: dict[str, Any], sliding) -> dict[str, Any]:
    """Qwen2/Qwen3/SmolLM3: `sliding_window` applies only when `use_sliding_window` is true, to
    the layers `layer_types` marks (derived by `sliding(config, i) -> bool` when absent)."""
    config = dict(config)
    use = config.pop("use_sliding_window", False)
    if not use or config.get("sliding_window") is None:
        config["sliding_window"] = config["layer_types"] = None  # every layer full, as the reference
    elif config.get("layer_types") is None:
        n = config.get("num_hidden_layers") or 0
        config["layer_types"] = ["sliding_attention" if sliding(config, i) else "full_attention" for i in range(n)]
    config.pop("max_window_layers", None)
    return config


@dataclass
class ModelArgs:
    """Fields shared by every architecture; subclasses add theirs (each is read, none ignored)."""

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
    partial_rotary_factor: float = 1.0
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"
    max_position_embeddings: int = 4096
    layer_types: list[str] | None = None
    sliding_window: int | None = None
    model_type: str = "llama"
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    model_types = ("llama",)  # class-level: the model_type values this class reads
    activations = ("silu",)
    gated_windows = ()  # model_types whose window applies only with use_sliding_window (gated_window)

    def __post_init__(self):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.hidden_act not in self.activations:
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported for {self.model_type} "
                             f"(supported: {', '.join(self.activations)})")
        if self.layer_types is not None:
            bad = sorted(set(self.layer_types) - set(LAYER_TYPES))
            if bad or len(self.layer_types) != self.num_hidden_layers:
                raise ValueError(f"layer_types must list {self.num_hidden_layers} of {list(LAYER_TYPES)}; "
                                 f"got {self.layer_types}")
            if "sliding_attention" in self.layer_types and not self.sliding_window:
                raise ValueError("layer_types has sliding_attention layers but sliding_window is not set")
        rope_dims(self)  # refuses an unsupported rope type / rotary fraction by name

    @classmethod
    def translate(cls, config: dict[str, Any]) -> dict[str, Any]:
        """Architecture hook: map this architecture's own config fields onto the dataclass."""
        return config

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> ModelArgs:
        """Build from an HF `config.json` dict (transformers v4 or v5 layout)."""
        model_type = config.get("model_type", cls.model_types[0])
        if model_type not in cls.model_types:
            raise ValueError(f"unsupported architecture {model_type!r} for {cls.__module__}; edgespec "
                             f"supports {', '.join(supported_model_types())}")
        cfg = cls.translate(normalize_rope(dict(config, model_type=model_type)))
        scaling = cfg.get("rope_scaling") or {}
        if scaling.get("rope_type", scaling.get("type")) in ("longrope", "su"):
            # LongRoPE switches from short to long factors once a sequence passes the original
            # length, per forward pass in the reference, so the result would depend on how a
            # decoder chunks its steps. edgespec runs the short factors only and caps the
            # context at the original length, where both agree exactly.
            original = cfg.get("original_max_position_embeddings", cfg.get("max_position_embeddings"))
            scaling = {"original_max_position_embeddings": original, **scaling}
            original = int(scaling["original_max_position_embeddings"])
            if cfg.get("max_position_embeddings"):
                scaling.setdefault("factor", cfg["max_position_embeddings"] / original)
                cfg["max_position_embeddings"] = min(cfg["max_position_embeddings"], original)
            cfg["rope_scaling"] = scaling
        names = set(inspect.signature(cls).parameters) - {"extra"}
        refused = sorted(k for k, v in cfg.items() if k not in names and not _harmless(k, v))
        if refused:
            raise ValueError(
                f"config field(s) {', '.join(refused)} not understood by edgespec's {model_type} "
                "implementation; they may change the model's math, so it is refused rather than run "
                "with them ignored")
        required = ("hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads",
                    "vocab_size")
        missing = [k for k in required if cfg.get(k) is None]
        if missing:
            raise ValueError(f"config.json lacks required field(s): {', '.join(missing)}")
        known = {k: v for k, v in cfg.items() if k in names}
        return cls(**known, extra={k: v for k, v in cfg.items() if k not in names})

    def to_dict(self) -> dict[str, Any]:
        """The config these args read back from (a bundle's drafter/, calibration, distillation)."""
        out = {k: v for k, v in self.__dict__.items() if k != "extra"}
        if self.model_type in self.gated_windows:
            # gated_window read use_sliding_window and dropped it: without it the window
            # (and layer_types) would be switched off when this dict is read again
            out["use_sliding_window"] = self.sliding_window is not None
        return out

    def window(self, i: int) -> int | None:
        """Sliding window of layer i (None = full attention)."""
        if self.layer_types is None:
            return self.sliding_window  # Mistral / Phi-3 style: one window for every layer
        return self.sliding_window if self.layer_types[i] == "sliding_attention" else None


# ---------------------------------------------------------------- RoPE


def rope_dims(args: ModelArgs) -> int:
    """Rotated dims of a head (partial_rotary_factor < 1 rotates the first ones only)."""
    scaling = args.rope_scaling or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope scaling type {rope_type!r} (rope_scaling / rope_parameters) is not "
                         f"supported; supported: {', '.join(ROPE_TYPES)}")
    dims = int(args.head_dim * args.partial_rotary_factor)
    if dims % 2 or not 0 < dims <= args.head_dim:
        raise ValueError(f"partial_rotary_factor {args.partial_rotary_factor} gives {dims} rotary dims "
                         f"of head_dim {args.head_dim}; must be even and positive")
    return dims


def rope_frequencies(args: ModelArgs, base: float | None = None) -> mx.array | None:
    """Per-dimension RoPE periods for `mx.fast.rope(freqs=...)`, or None for plain `base**(2i/D)`.

    Llama 3 scaling (rope_type "llama3") stretches low frequencies (long wavelengths)
    by `factor` and interpolates smoothly between `low_freq_factor` and `high_freq_factor`.
    """
    scaling = args.rope_scaling or {}
    if scaling.get("rope_type", scaling.get("type")) != "llama3":
        return None
    dims = rope_dims(args)
    base = args.rope_theta if base is None else base
    factor = scaling["factor"]
    low = scaling.get("low_freq_factor", 1.0)
    high = scaling.get("high_freq_factor", 4.0)
    old_ctx = scaling.get("original_max_position_embeddings", 8192)
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    freqs = base ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims)
    wavelens = 2 * math.pi * freqs
    freqs = mx.where(wavelens > low_wavelen, freqs * factor, freqs)
    is_medium = (wavelens > high_wavelen) & (wavelens < low_wavelen)
    smooth = (old_ctx / wavelens - low) / (high - low)
    smooth_freqs = freqs / ((1 - smooth) / factor + smooth)
    return mx.where(is_medium, smooth_freqs, freqs)


class RoPE(nn.Module):
    """Rotary embedding. `base`/`scaled` override the config (Gemma 3's local layers use
    their own base and no scaling)."""

    def __init__(self, args: ModelArgs, base: float | None = None, scaled: bool = True):
        super().__init__()
        self.dims = rope_dims(args)
        self.traditional = args.rope_traditional
        scaling = (args.rope_scaling or {}) if scaled else {}
        rope_type = scaling.get("rope_type", scaling.get("type"))
        self.scale = 1.0 / scaling["factor"] if rope_type == "linear" else 1.0
        freqs = rope_frequencies(args, base) if scaled else None
        self.base = None if freqs is not None else (args.rope_theta if base is None else base)
        self._freqs = freqs

    def __call__(self, x: mx.array, offset: int, positions: mx.array | None) -> mx.array:
        """x: (B, H, T, D). `positions` (T,) or (B, T) overrides the contiguous `offset + arange(T)`."""
        kw = dict(traditional=self.traditional, base=self.base, scale=self.scale, freqs=self._freqs)
        if positions is None:
            if x.dtype == mx.float32 and type(offset) is int and not on_metal():
                return rope_from_table(self, x, offset)
            return mx.fast.rope(x, self.dims, offset=offset, **kw)
        # Per-token positions (tree / lookahead steps, batched rows at different offsets):
        # each (row, token) becomes its own batch entry with its own offset, so one call
        # of the same kernel as the contiguous path computes it.
        B, H, T, D = x.shape
        if B == 1 and positions.ndim == 1 and type(offset) is int and offset > 0 and x.dtype == mx.float32 \
                and not on_metal():
            # A single sequence's tree over its cache: its positions lie in offset .. offset + T - 1
            # (the cache's offset plus each node's depth, kernels/tree.py), which the table covers.
            return rope_from_table(self, x, offset, positions)
        pos = positions if positions.dtype == mx.int32 else positions.astype(mx.int32)
        if B == 1 and pos.ndim == 1:  # a single sequence's tree (T,): already one offset per entry
            flat = pos
        else:
            flat = (mx.broadcast_to(pos[None], (B, T)) if pos.ndim == 1 else pos).reshape(-1)
        xt = x.transpose(0, 2, 1, 3).reshape(B * T, H, 1, D)  # (B*T, H, 1, D)
        xt = mx.fast.rope(xt, self.dims, offset=flat, **kw)
        return xt.reshape(B, T, H, D).transpose(0, 2, 1, 3)


# On the CPU `mx.fast.rope` has no kernel: every call builds its reference graph, 29 nodes (the
# inverse frequencies, an exp, cos and sin of the positions, the rotation), and a 30-layer model
# calls it 60 times a pass. Passes of SmolLM2 at 150 keys with RoPE left out took 7.2 ms less at
# 1 token and 10.8 ms less at 4 (of 49 and 63; in pairs, a one-off script). So on the CPU RoPE
# reads cos and sin from a table and rotates with six ops: passes 3.7 / 4.8 / 4.6 ms faster at
# 1 / 4 / 8 tokens (of 41 / 45 / 49, in pairs). The table is read off `mx.fast.rope`'s own output
# for a unit input (1 where cos multiplies, 0 where sin does), so it holds exactly the values the
# reference graph computes, and the rotation is the reference's expression (x1 cos - x2 sin,
# x1 sin + x2 cos): the same bits as `mx.fast.rope`, which a batch's rows and calls without a
# cache still take (tests/test_rope_table.py). float32 only: half types keep the reference (the
# table's bits were not checked against its rounding there).
_ROPE_TABLES: dict[tuple, tuple] = {}  # settings -> rope_table's four arrays, evaluated
_ROPE_TABLE_MIN = 1024
_ROPE_MEMO = threading.local()  # this thread's last (table, offset or positions, T, full, cos rows, sin rows)


def _rope_key(rope: RoPE) -> tuple:
    key = rope.__dict__.get("_table_key")
    if key is None:
        freqs = None if rope._freqs is None else tuple(float(v) for v in rope._freqs.tolist())
        key = (rope.dims, bool(rope.traditional), rope.base, float(rope.scale), freqs)
        rope.__dict__["_table_key"] = key
    return key


def rope_table(rope: RoPE, need: int) -> tuple[mx.array, ...]:
    """(cos, sin, [cos, cos], [-sin, sin]) of positions 0..N-1 (N >= need, doubled as it
    grows; (N, dims/2) and (N, dims)) for `rope`'s settings, shared by every RoPE with the
    same ones (a model's layers, its drafter's)."""
    got = rope.__dict__.get("_table")
    if got is not None and got[0].shape[0] >= need:
        return got
    key = _rope_key(rope)
    got = _ROPE_TABLES.get(key)
    if got is None or got[0].shape[0] < need:
        n = max(_ROPE_TABLE_MIN, 1 << max(need - 1, 1).bit_length())
        h = rope.dims // 2
        one = mx.array([1.0, 0.0] * h if rope.traditional else [1.0] * h + [0.0] * h, dtype=mx.float32)
        unit = mx.broadcast_to(one.reshape(1, 1, 1, rope.dims), (n, 1, 1, rope.dims))
        out = mx.fast.rope(unit, rope.dims, traditional=rope.traditional, base=rope.base, scale=rope.scale,
                           offset=mx.arange(n, dtype=mx.int32), freqs=rope._freqs).reshape(n, rope.dims)
        cos, sin = (out[:, 0::2], out[:, 1::2]) if rope.traditional else (out[:, :h], out[:, h:])
        # The non-traditional layout rotates x as x * [cos, cos] + [x2, x1] * [-sin, sin]: the
        # same products and sums (a - b is a + (-b) in IEEE arithmetic), three ops fewer.
        got = (mx.contiguous(cos), mx.contiguous(sin), mx.concatenate([cos, cos], axis=-1),
               mx.concatenate([-sin, sin], axis=-1))
        mx.eval(*got)  # now, on this thread: other threads' passes read these arrays
        _ROPE_TABLES[key] = got
    rope.__dict__["_table"] = got
    return got


def _check_positions(positions: mx.array, rows: int) -> None:
    """With EDGESPEC_CHECK_EXACT on (the test suite): per-token positions past the table's rows
    (sized from offset + T: a tree's positions are below it) would read what is not there; a
    caller that passes such positions is told (a synchronisation, so only then)."""
    if os.environ.get("EDGESPEC_CHECK_EXACT", "").strip().lower() in ("1", "true", "on", "yes"):
        lo, hi = int(positions.min()), int(positions.max())
        if lo < 0 or hi >= rows:
            raise ValueError(f"RoPE positions {lo}..{hi} outside the table's {rows} rows")


def rope_from_table(rope: RoPE, x: mx.array, offset: int, positions: mx.array | None = None) -> mx.array:
    """`mx.fast.rope(x, rope.dims, offset=offset, ...)` for x (B, H, T, D) on the CPU, with cos
    and sin read from the table: the same bits, six ops instead of about thirty (rotary dims
    over the whole head, the usual case; nine for the traditional layout or partial dims)."""
    T = x.shape[2]
    dims = rope.dims
    table = rope_table(rope, offset + T)
    full = not rope.traditional and dims == x.shape[-1]
    where = offset if positions is None else positions
    memo = getattr(_ROPE_MEMO, "last", None)
    same = memo is not None and memo[0] is table and memo[2] == T and memo[3] == full
    if same and (memo[1] is where or (positions is None and type(memo[1]) is int and memo[1] == offset)):
        c, s = memo[4], memo[5]  # the pass's other layers: the same positions
    else:
        at = 2 if full else 0
        if positions is None:
            c, s = table[at][offset : offset + T], table[at + 1][offset : offset + T]
        else:
            _check_positions(positions, table[0].shape[0])
            c, s = table[at][positions], table[at + 1][positions]
        _ROPE_MEMO.last = (table, where, T, full, c, s)
    if full:
        h = dims // 2
        return x * c + mx.concatenate([x[..., h:], x[..., :h]], axis=-1) * s
    if rope.traditional:
        pairs = x[..., :dims].reshape(*x.shape[:-1], dims // 2, 2)
        x1, x2 = pairs[..., 0], pairs[..., 1]
        parts = [mx.stack([x1 * c - x2 * s, x1 * s + x2 * c], axis=-1).reshape(*x.shape[:-1], dims)]
    else:
        h = dims // 2
        x1, x2 = x[..., :h], x[..., h:dims]
        parts = [x1 * c - x2 * s, x1 * s + x2 * c]
    if dims < x.shape[-1]:
        parts.append(x[..., dims:])
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-1)


class LongRoPE(RoPE):
    """LongRoPE (Phi-3 128k, Phi-3.5, Phi-4-mini; rope type "longrope" or "su") within the
    original context: periods base**(2i/d) times `short_factor`, and the rotated dims scaled by
    attention_factor (default sqrt(1 + ln(factor) / ln(original)), factor = max positions /
    original positions), as the reference scales cos and sin. The context is capped at
    original_max_position_embeddings (ModelArgs.from_dict), so `long_factor` is never due.
    """

    def __init__(self, args: ModelArgs):
        super().__init__(args, scaled=False)
        s = args.rope_scaling
        original = int(s["original_max_position_embeddings"])
        factor = s.get("factor") or 1.0
        attn = s.get("attention_factor")
        if attn is None:
            attn = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        if len(s.get("short_factor") or ()) != self.dims // 2:
            raise ValueError(f"longrope short_factor must list {self.dims // 2} numbers (rotary dims / 2)")
        periods = args.rope_theta ** (mx.arange(0, self.dims, 2, dtype=mx.float32) / self.dims)
        self.base, self._freqs = None, mx.array(s["short_factor"], dtype=mx.float32) * periods
        self._mscale = None
        if attn != 1.0:  # (D,): attn on the rotated dims, 1 on the rest
            self._mscale = mx.concatenate([mx.full((self.dims,), attn), mx.ones((args.head_dim - self.dims,))])

    def __call__(self, x: mx.array, offset: int, positions: mx.array | None) -> mx.array:
        x = super().__call__(x, offset, positions)
        return x if self._mscale is None else x * self._mscale.astype(x.dtype)


def make_rope(args: ModelArgs, base: float | None = None, scaled: bool = True) -> RoPE:
    scaling = (args.rope_scaling or {}) if scaled else {}
    if scaling.get("rope_type", scaling.get("type")) in ("longrope", "su"):
        return LongRoPE(args)
    return RoPE(args, base, scaled)


# ---------------------------------------------------------------- norms, MLP


class OffsetRMSNorm(nn.Module):
    """Gemma's RMSNorm: weight stored as w, applied as (1 + w); initialised to 0."""

    def __init__(self, dims: int, eps: float = 1e-6):
        super().__init__()
        self.weight = mx.zeros((dims,))
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        return mx.fast.rms_norm(x, 1.0 + self.weight, self.eps)


class MLP(nn.Module):
    """Gated MLP: down(act(gate(x)) * up(x)). inference=True (a call with a KV cache, so no
    gradient is taken) lets prompt chunks on the CPU use the numpy activation."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        E, F = args.hidden_size, args.intermediate_size
        self.gate_proj = Linear(E, F, bias=args.mlp_bias)
        self.up_proj = Linear(E, F, bias=args.mlp_bias)
        self.down_proj = Linear(F, E, bias=args.mlp_bias)
        self._act = args.hidden_act  # ModelArgs checked it against the architecture's activations

    def __call__(self, x, inference: bool = False):
        return self.down_proj(gated_activation(self._act, self.gate_proj(x), self.up_proj(x), inference))


# ---------------------------------------------------------------- attention


@dataclass
class LayerOptions:
    """What differs between the layers of the supported architectures."""

    window: int | None = None  # sliding window: a query sees keys at positions q-window+1 .. q
    rope: bool = True  # False: NoPE layer (SmolLM3)
    rope_base: float | None = None  # overrides rope_theta (Gemma 3 local layers)
    rope_scaled: bool = True  # False: plain RoPE even if the config scales it (Gemma 3 local)
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE (Qwen3, Gemma 3)
    norm: type = nn.RMSNorm  # nn.RMSNorm or OffsetRMSNorm (Gemma)
    sandwich: bool = False  # Gemma 2/3: norms before and after attention and MLP
    softcap: float | None = None  # attention logits -> cap * tanh(logits / cap) (Gemma 2)
    scale: float | None = None  # attention scale (default head_dim ** -0.5)
    output_gate: bool = False  # q_proj also gives a per-head gate: out * sigmoid(gate) (Qwen3.5)
    mlp: Any = None  # (args) -> the feed-forward module (default: the gated MLP); MoE layers


def window_mask(mask, positions, offset: int, T: int, window: int, key_slots: int | None = None):
    """Restrict `mask` (None, "causal" or bool broadcastable to (B, 1, T, S)) to the window.

    key_slots: the S keys of a batched pass (edgespec.batch.forward), where each row's cached
    slots hold positions 0, 1, ... and its T new tokens sit right after them, at the slots from
    its first new position (rows right-padded; the mask hides the padding); then each key's
    position is read from there, not from `offset`.

    Key positions are derived, not stored: cache slots before this step hold consecutive
    positions ending just before the first new token (true for plain, tree, lookahead and
    left-padded batched decoding), and the new slots hold `positions`. Returns `mask`
    itself when no query can reach past the window (the common short-context case).
    """
    if key_slots is not None and positions is not None:
        qpos = positions.astype(mx.int32)
        qpos = qpos[None] if qpos.ndim == 1 else qpos  # (B', T)
        slot = mx.arange(key_slots, dtype=mx.int32)[None]  # (1, S)
        first = qpos[:, :1]  # each row's first new token: its slot is its position
        new = mx.take_along_axis(qpos, mx.clip(slot - first, 0, T - 1), axis=1)  # (B', S)
        kpos = mx.where(slot < first, slot, new)
        near = (qpos[:, :, None] - kpos[:, None, :]) < window  # (B', T, S)
        if mask is None or isinstance(mask, str):
            mask = mx.arange(key_slots)[None] <= (key_slots - T + mx.arange(T))[:, None]
        return mask & near[:, None]
    S = offset + T
    if positions is None:
        if S <= window:
            return mask
        qpos = (offset + mx.arange(T, dtype=mx.int32))[None]  # (1, T)
    else:
        qpos = positions.astype(mx.int32)
        qpos = qpos[None] if qpos.ndim == 1 else qpos  # (B', T)
    past = qpos[:, :1] - offset + mx.arange(offset, dtype=mx.int32)[None]  # (B', offset)
    kpos = mx.concatenate([past, qpos], axis=1)  # (B', S)
    near = (qpos[:, :, None] - kpos[:, None, :]) < window  # (B', T, S)
    if mask is None and T == 1:
        return near[:, None]
    if mask is None or isinstance(mask, str):  # causal over slots
        mask = mx.arange(S)[None] <= (offset + mx.arange(T))[:, None]  # (T, S)
    return mask & near[:, None]


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, opts: LayerOptions | None = None):
        super().__init__()
        opts = opts or LayerOptions()
        E, H, Hk, D = args.hidden_size, args.num_attention_heads, args.num_key_value_heads, args.head_dim
        self.n_heads, self.n_kv_heads, self.head_dim = H, Hk, D
        self.scale = opts.scale if opts.scale is not None else D**-0.5
        self.q_proj = Linear(E, H * D * (2 if opts.output_gate else 1), bias=args.attention_bias)
        self._gated = opts.output_gate
        self.k_proj = Linear(E, Hk * D, bias=args.attention_bias)
        self.v_proj = Linear(E, Hk * D, bias=args.attention_bias)
        self.o_proj = Linear(H * D, E, bias=False)
        if opts.qk_norm:
            self.q_norm = opts.norm(D, eps=args.rms_norm_eps)
            self.k_norm = opts.norm(D, eps=args.rms_norm_eps)
        self._qk_norm = opts.qk_norm
        self.rope = make_rope(args, opts.rope_base, opts.rope_scaled) if opts.rope else None
        self.window, self.softcap = opts.window, opts.softcap

    def __call__(self, x, mask, cache: KVCache | None, positions):
        B, T, _ = x.shape
        q = self.q_proj(x).reshape(B, T, self.n_heads, -1)
        if self._gated:  # per head: [q (D), gate (D)]
            q, gate = mx.split(q, 2, axis=-1)
        k = self.k_proj(x).reshape(B, T, self.n_kv_heads, -1)
        v = self.v_proj(x).reshape(B, T, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        if self._qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3)  # (B, H, T, D), (B, Hk, T, D)
        offset = cache.offset if cache is not None else 0
        if self.rope is not None:
            q = self.rope(q, offset, positions)
            k = self.rope(k, offset, positions)
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)  # (B, Hk, S, D)
        if self.window is not None:
            slots = k.shape[2] if cache is not None and cache.slot_positions else None
            mask = window_mask(mask, positions, offset, T, self.window, slots)
        # A long prompt chunk on the CPU device: see the kernel's notes. Only calls with a cache
        # (inference) take it: numpy has no gradients, and full-sequence calls without a cache
        # (drafter training, calibration) must stay differentiable.
        if exact.enabled():  # bitwise verification: each query row as a one-token pass computes it
            out = exact.exact_attention(q, k, v, self.scale, mask, self.softcap)
        elif self.softcap is None:
            out = attention(q, k, v, self.scale, mask, inference=cache is not None)
        elif cache is not None and use_numpy_attention(q, k):
            out = numpy_attention(q, k, v, self.scale, mask, self.softcap)
        else:
            out = softcapped_attention(q, k, v, self.scale, self.softcap, mask, offset)
        out = out.transpose(0, 2, 1, 3).reshape(B, T, -1)
        if self._gated:
            out = out * base2.sigmoid(gate.reshape(B, T, -1))
        return self.o_proj(out)


def softcapped_attention(q, k, v, scale: float, cap: float, mask, offset: int) -> mx.array:
    """Attention with logits capped as cap * tanh(logits / cap) before the mask (Gemma 2).

    q (B, H, T, D), k/v (B, Hk, S, D) -> (B, H, T, D). The fused kernel cannot cap, so
    the grouped heads are spelt out: q as (B, Hk, H/Hk, T, D) against each k/v head.
    """
    B, H, T, D = q.shape
    Hk, S = k.shape[1], k.shape[2]
    qg = q.reshape(B, Hk, H // Hk, T, D)
    scores = (qg * scale) @ k[:, :, None].swapaxes(-1, -2)  # (B, Hk, H/Hk, T, S)
    scores = mx.tanh(scores / cap) * cap
    if isinstance(mask, str) or (mask is None and T > 1):
        mask = mx.arange(S)[None] <= (offset + mx.arange(T))[:, None]
    if mask is not None:
        m = mask if mask.ndim < 4 else mask[:, :, None]  # (B, 1, T, S) -> (B, 1, 1, T, S)
        scores = mx.where(m, scores, mx.array(-mx.inf, scores.dtype))
    probs = mx.softmax(scores.astype(mx.float32), axis=-1).astype(v.dtype)
    return (probs @ v[:, :, None]).reshape(B, H, T, -1)


# ---------------------------------------------------------------- stored quantization


def quantize_as_stored(model: nn.Module, weights: dict[str, mx.array], quantization: Any) -> bool:
    """Quantize exactly the modules whose stored weights are MLX-quantized (a `.scales` tensor).

    Bits and group size come from each module's own tensors: a packed weight (out, in*bits/32)
    of uint32 and scales (out, in/group_size). So an mlx-community folder whose config
    overrides some modules (other bits, or `false` = left dense) loads as written, without
    trusting that every override was spelt the way this loader expects. Returns False
    (nothing done) when no stored weight is quantized.
    """
    if not any(k.endswith(".scales") for k in weights):
        return False
    mode = quantization.get("mode", "affine") if isinstance(quantization, dict) else "affine"

    def predicate(path: str, module: nn.Module):
        scales = weights.get(f"{path}.scales")
        if scales is None or not hasattr(module, "to_quantized"):
            return False
        in_dims = module.weight.shape[-1]
        packed = weights[f"{path}.weight"].shape[-1]
        return {"group_size": in_dims // scales.shape[-1], "bits": packed * 32 // in_dims, "mode": mode}

    nn.quantize(model, class_predicate=predicate)
    return True


# ---------------------------------------------------------------- decoder


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, opts: LayerOptions | None = None):
        super().__init__()
        opts = opts or LayerOptions()
        E, eps = args.hidden_size, args.rms_norm_eps
        self.self_attn = Attention(args, opts)
        self.mlp = opts.mlp(args) if opts.mlp is not None else MLP(args)
        self.input_layernorm = opts.norm(E, eps=eps)
        self.post_attention_layernorm = opts.norm(E, eps=eps)
        self._sandwich = opts.sandwich
        if opts.sandwich:
            self.pre_feedforward_layernorm = opts.norm(E, eps=eps)
            self.post_feedforward_layernorm = opts.norm(E, eps=eps)

    def make_cache(self) -> KVCache:
        """This layer's cache (the per-layer state protocol, edgespec.caches.kv)."""
        return KVCache()

    def __call__(self, x, mask, cache, positions):
        if self._sandwich:  # Gemma 2/3: x + norm(attn(norm(x))), then the same around the MLP
            h = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), mask, cache, positions))
            return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h), cache is not None))
        h = x + self.self_attn(self.input_layernorm(x), mask, cache, positions)
        return h + self.mlp(self.post_attention_layernorm(h), cache is not None)


class Body(nn.Module):
    def __init__(self, args: ModelArgs, make_layer, norm: type):
        super().__init__()
        # Built in this order (embeddings, layers, norm): a model made after mx.random.seed(s)
        # has the same random weights as before layers could be of mixed kinds.
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [make_layer(args, i) for i in range(args.num_hidden_layers)]
        self.norm = norm(args.hidden_size, eps=args.rms_norm_eps)


class Model(nn.Module):
    """Causal LM (the model contract). `model(tokens, cache)` -> logits (B, T, V).

    Subclasses set `norm` / `embed_scale` / `final_softcap` and override `layer_options`
    and `sanitize`; the forward pass is shared.
    """

    norm: type = nn.RMSNorm
    embed_scale: bool = False  # Gemma: embeddings times sqrt(E)
    # Set by record_hidden (a DFlash drafter): the layers whose outputs every pass with a cache
    # records, and the layer whose cache keeps them. An architecture whose own __call__ does not
    # go through this one's loop declares records_layers = False.
    records_layers: bool = True
    record_layers: tuple[int, ...] | None = None
    record_tap: int | None = None

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model = Body(args, self.make_layer, self.norm)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self._final_softcap = self.final_softcap(args)

    def layer_options(self, args: ModelArgs, i: int) -> LayerOptions:
        return LayerOptions(window=args.window(i), norm=self.norm)

    def make_layer(self, args: ModelArgs, i: int) -> nn.Module:
        """Layer i: a DecoderLayer with `layer_options` unless the architecture mixes in other
        kinds (each declares its own cache with make_cache and is called like DecoderLayer)."""
        return DecoderLayer(args, self.layer_options(args, i))

    def final_softcap(self, args: ModelArgs) -> float | None:
        return None

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """HF checkpoint names -> this model's: drop RoPE buffers, a tied head's copy."""
        out = {k: v for k, v in weights.items() if "rotary_emb.inv_freq" not in k}
        if self.args.tie_word_embeddings:
            for suffix in ("weight", "scales", "biases"):
                out.pop(f"lm_head.{suffix}", None)
        return out

    @property
    def layers(self) -> list[DecoderLayer]:
        return self.model.layers

    def make_cache(self) -> list:
        caches = [layer.make_cache() for layer in self.model.layers]
        if self.record_tap is not None:
            caches[self.record_tap] = HiddenKVCache()
        return caches

    def record_hidden(self, layer_ids: list[int]) -> int | None:
        """Make the caches made from now on record, on every pass over them (prefill, steps,
        verification), the outputs of layers `layer_ids` concatenated in that order, (B, T, n*E),
        in the first layer cache that holds one entry per position (a plain KVCache: its trims and
        keeps follow the sequence). Returns that layer's index; None (and nothing recorded) when
        the architecture cannot (`records_layers`) or no layer keeps such a cache."""
        if not self.records_layers:
            return None
        tap = next((i for i, layer in enumerate(self.model.layers) if type(layer.make_cache()) is KVCache), None)
        if tap is None:
            return None
        # object's setattr: nn.Module would file a tuple among the parameters
        object.__setattr__(self, "record_layers", tuple(int(i) for i in layer_ids))
        self.record_tap = tap
        return tap

    def stop_recording(self) -> None:
        """Undo record_hidden (its drafter was replaced): caches made from now on record nothing."""
        object.__setattr__(self, "record_layers", None)
        self.record_tap = None

    def _put_recorded(self, cache: list, outs: dict[int, mx.array]) -> None:
        """Hand a pass's recorded layer outputs to the tap cache (or, in a batched pass over
        gathered rows, edgespec.batch.forward, to each row's own)."""
        feats = mx.concatenate([outs[i] for i in self.record_layers], axis=-1)
        tap = cache[self.record_tap]
        if isinstance(tap, HiddenKVCache):
            tap.put_hidden(feats)
            return
        rows = getattr(tap, "caches", None)  # a batched pass: one cache per row, `lengths` new tokens each
        for b, (c, t) in enumerate(zip(rows or (), getattr(tap, "lengths", ()), strict=False)):
            if isinstance(c, HiddenKVCache):
                c.put_hidden(feats[b : b + 1, :t])

    def embed(self, inputs: mx.array) -> mx.array:
        """Token ids (B, T) -> input embeddings (B, T, E)."""
        h = self.model.embed_tokens(inputs)
        if self.embed_scale:  # the scale rounded to the activation dtype, as the reference does
            h = h * mx.array(self.args.hidden_size**0.5, dtype=h.dtype)
        return h

    def head(self, h: mx.array) -> mx.array:
        """Final norm and output projection: hidden (B, T, E) -> logits (B, T, V)."""
        return self.project(self.model.norm(h))

    def project(self, h: mx.array) -> mx.array:
        """Output projection of final-norm hidden states (B, T, E) -> logits (B, T, V)."""
        if exact.enabled():  # bitwise verification (edgespec/kernels/exact.py)
            out = exact.output_projection(self.model.embed_tokens if self.args.tie_word_embeddings else self.lm_head, h)
        elif self.args.tie_word_embeddings:
            out = self.model.embed_tokens.as_linear(h)
        else:
            out = self.lm_head(h)
        if self._final_softcap is not None:
            cap = self._final_softcap
            out = mx.tanh(out / cap) * cap
        return out

    def __call__(
        self,
        inputs: mx.array,
        cache: list[KVCache] | None = None,
        mask: mx.array | str | None = None,
        positions: mx.array | None = None,
        layer_ids: list[int] | None = None,
        return_hidden: bool = False,
        last_only: bool = False,
    ) -> mx.array | tuple[mx.array, mx.array]:
        """Forward pass.

        inputs: (B, T) token ids. mask: None means causal over cache + new tokens;
        an explicit boolean mask (True = attend) of shape (T, S) or broadcastable to
        (B, 1, T, S) serves tree/lookahead steps and batches of rows at different
        offsets (left padding is masked out; a padded query row should still attend
        to itself so no row is all-False). `positions` (T,) or (B, T) gives each new
        token's RoPE position (default: cache offset + arange(T)). Sliding-window
        layers narrow the mask themselves. `layer_ids` runs only those layers
        (self-speculative drafting); `cache` must then hold one entry per model
        layer, and only the listed ones are touched. `return_hidden` also returns
        the final-norm hidden states (B, T, E), the features a feature drafter
        reads: (logits, hidden). `last_only` projects only the last position (logits
        (B, 1, V)): a prompt's prefill needs no other, and the output projection of a
        large vocabulary is a fifth of a small model's arithmetic per token.
        """
        h = self.embed(inputs)
        if mask is None:
            mask = "causal" if inputs.shape[1] > 1 else None
        ids = range(len(self.layers)) if layer_ids is None else layer_ids
        rec = self.record_layers if layer_ids is None and cache is not None and self.record_tap is not None else None
        outs: dict[int, mx.array] = {}
        for i in ids:
            h = self.layers[i](h, mask, cache[i] if cache is not None else None, positions)
            if rec is not None and i in rec:
                outs[i] = h
        if rec is not None and len(outs) == len(set(rec)):
            self._put_recorded(cache, outs)
        if return_hidden:
            h = self.model.norm(h)
            return self.project(h[:, -1:] if last_only else h), h
        return self.head(h[:, -1:] if last_only else h)
