"""Build the drafter's Core ML (MIL) program from numpy weights: no torch involved.

One function per fixed token count T (prefill chunk, 1-token decode, K-token
decode), all reading and writing the same two states:

    key_cache, value_cache: (L, Hk, D, C) fp16     L layers, Hk kv heads, D head dim,
                                                   C context length (fixed buffer)

Inputs:  input_ids (1, T) int32, position (1,) int32 = cache slot of input_ids[0, 0].
Output:  logits (1, V, 1, T_out) fp16, T_out = T (decode) or 1 (prefill: last token).

Choices made for the Apple Neural Engine (Apple's "Deploying Transformers on
the Apple Neural Engine" guidance and its Llama-on-Core-ML follow-up):
- Activations stay in the channels-first (B, C, 1, S) layout the ANE's conv
  engine is built around; every linear layer is a 1x1 `conv`, so no transposes
  of activations are needed between layers (the last axis is the contiguous,
  64-byte aligned one on the ANE, and here it is the sequence).
- Heads are split by `reshape` of the channel axis only: q (1, H*D, 1, T) ->
  (Hk, g, D, T); the cache keeps D before C, so q^T K and V P^T are plain
  batched matmuls with a transpose flag, never a data transpose.
- Grouped-query attention uses matmul broadcasting over the g query heads of a
  kv head instead of materialising repeated K/V.
- Fixed shapes everywhere (the ANE compiles one static graph per function);
  the causal/validity mask is computed in-graph from `position`, so rolling a
  draft back is just passing a smaller position next time: stale cache slots
  beyond a query's own position are masked out and later overwritten.
- The 1/sqrt(D) attention scale is folded into q_proj so fp16 scores never
  pass through an extra multiply.
- fp16 everywhere except RMSNorm's mean of squares: SmolLM2's residual stream
  reaches ~900, so x*x overflows fp16 (max 65504); that one reduction runs in
  fp32.
- Each state is read once per call and the updated value chained through all
  layers, then written once (re-reading a state after an update gets merged
  into a stale read by a coremltools pass).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from edgespec.converters.coreml_compress import emit_weight

MASK_VALUE = -30000.0  # additive mask; exp(-3e4 + s) == 0 in fp16, and it stays finite


@dataclass(frozen=True)
class DrafterShape:
    n_layers: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    context: int
    eps: float
    tied: bool

    @property
    def groups(self) -> int:
        return self.n_heads // self.n_kv_heads

    @property
    def cache_shape(self) -> tuple[int, int, int, int]:
        return (self.n_layers, self.n_kv_heads, self.head_dim, self.context)


def rope_tables(
    head_dim: int, context: int, inv_freq: np.ndarray, scale: float
) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin tables (D/2, C) for positions 0..C-1: angle[i, p] = p * scale * inv_freq[i]."""
    pos = np.arange(context, dtype=np.float64) * scale
    ang = inv_freq.astype(np.float64)[:, None] * pos[None, :]  # (D/2, C)
    # Kept fp32 in the weight file (tiny: D/2 x C) and cast after the gather, so the
    # tables add no rounding beyond the fp16 activations they multiply.
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def _rms_norm(mb, x, weight: np.ndarray, eps: float, name: str):
    """x (1, E, 1, T) fp16 -> normalised fp16; mean of squares in fp32 (see module doc)."""
    x32 = mb.cast(x=x, dtype="fp32", name=f"{name}_x32")
    sq = mb.mul(x=x32, y=x32, name=f"{name}_sq")
    ms = mb.reduce_mean(x=sq, axes=[1], keep_dims=True, name=f"{name}_ms")
    r = mb.rsqrt(x=ms, epsilon=np.float32(eps), name=f"{name}_rsqrt")
    y = mb.cast(x=mb.mul(x=x32, y=r, name=f"{name}_norm32"), dtype="fp16", name=f"{name}_norm")
    return mb.mul(x=y, y=weight.astype(np.float16).reshape(1, -1, 1, 1), name=f"{name}_out")


def _linear(mb, x, w, b: np.ndarray | None, name: str):
    """1x1 conv on (1, in, 1, T) -> (1, out, 1, T); w (out, in), or a compressed dict
    (coreml_compress.compress_linear) rebuilt by a constexpr op."""
    kw = {}
    if b is not None:
        kw["bias"] = b.astype(np.float16)
    if isinstance(w, dict):
        # coremltools is heavy and optional (the convert extra): imported only when a package is built or read
        from coremltools.converters.mil.mil import types  # optional: coremltools
        weight = emit_weight(mb, types, w, f"{name}_weight")
    else:
        weight = w.astype(np.float16)[:, :, None, None]
    return mb.conv(x=x, weight=weight, name=name, **kw)


def _rope(mb, x, cos, sin, half_axis: int, name: str):
    """Rotate-half RoPE on the D axis `half_axis`: [x1 c - x2 s, x1 s + x2 c]; cos/sin (D/2, T)."""
    x1, x2 = mb.split(x=x, num_splits=2, axis=half_axis, name=f"{name}_split")
    a = mb.sub(x=mb.mul(x=x1, y=cos), y=mb.mul(x=x2, y=sin))
    b = mb.add(x=mb.mul(x=x1, y=sin), y=mb.mul(x=x2, y=cos))
    return mb.concat(values=[a, b], axis=half_axis, name=f"{name}_out")


def build_function(
    mb, types, shape: DrafterShape, w: dict[str, np.ndarray], T: int, last_only: bool, opset
):
    """The MIL program of one function (T tokens per call).

    `w` holds fp16-ready numpy weights in HF names, with q_proj pre-scaled by
    1/sqrt(D) and rows arranged for rotate-half RoPE (see coreml_export.py).
    """
    L, E, Hk, g, D, C = (
        shape.n_layers,
        shape.hidden,
        shape.n_kv_heads,
        shape.groups,
        shape.head_dim,
        shape.context,
    )
    H = shape.n_heads
    specs = [
        mb.TensorSpec(shape=(1, T), dtype=types.int32),
        mb.TensorSpec(shape=(1,), dtype=types.int32),
        mb.StateTensorSpec(shape=shape.cache_shape, dtype=types.fp16),
        mb.StateTensorSpec(shape=shape.cache_shape, dtype=types.fp16),
    ]

    @mb.program(input_specs=specs, opset_version=opset)
    def prog(input_ids, position, key_cache, value_cache):
        emb_w = mb.const(val=w["model.embed_tokens.weight"].astype(np.float16), name="embed_weight")
        ids = mb.reshape(x=input_ids, shape=[T], name="ids")
        h = mb.gather(x=emb_w, indices=ids, axis=0, name="embed")  # (T, E)
        h = mb.transpose(x=h, perm=[1, 0], name="embed_t")  # (E, T): the one activation transpose
        h = mb.reshape(x=h, shape=[1, E, 1, T], name="h_in")

        # Positions of the T new tokens and the (T, C) additive mask: slot j is
        # visible to query t iff j <= position + t.
        qpos = mb.add(x=position, y=np.arange(T, dtype=np.int32), name="qpos")  # (T,)
        diff = mb.sub(
            x=np.arange(C, dtype=np.int32).reshape(1, C),
            y=mb.reshape(x=qpos, shape=[T, 1]),
            name="mask_diff",
        )
        future = mb.cast(x=mb.greater(x=diff, y=np.int32(0)), dtype="fp16", name="mask_future")
        mask = mb.mul(x=future, y=np.float16(MASK_VALUE), name="mask")  # (T, C)
        cos = mb.gather(x=w["rope_cos"], indices=qpos, axis=1, name="rope_cos32")  # (D/2, T)
        sin = mb.gather(x=w["rope_sin"], indices=qpos, axis=1, name="rope_sin32")
        cos = mb.cast(x=cos, dtype="fp16", name="rope_cos")
        sin = mb.cast(x=sin, dtype="fp16", name="rope_sin")

        kc = mb.read_state(input=key_cache, name="key_cache_in")  # (L, Hk, D, C)
        vc = mb.read_state(input=value_cache, name="value_cache_in")
        for i in range(L):
            p = f"model.layers.{i}."
            n = f"l{i}"
            x = _rms_norm(mb, h, w[p + "input_layernorm.weight"], shape.eps, f"{n}_ln1")
            q = _linear(
                mb,
                x,
                w[p + "self_attn.q_proj.weight"],
                w.get(p + "self_attn.q_proj.bias"),
                f"{n}_q",
            )
            k = _linear(
                mb,
                x,
                w[p + "self_attn.k_proj.weight"],
                w.get(p + "self_attn.k_proj.bias"),
                f"{n}_k",
            )
            v = _linear(
                mb,
                x,
                w[p + "self_attn.v_proj.weight"],
                w.get(p + "self_attn.v_proj.bias"),
                f"{n}_v",
            )
            q = _rope(mb, mb.reshape(x=q, shape=[Hk, g, D, T]), cos, sin, 2, f"{n}_qrope")
            k = _rope(mb, mb.reshape(x=k, shape=[1, Hk, D, T]), cos, sin, 2, f"{n}_krope")
            v = mb.reshape(x=v, shape=[1, Hk, D, T], name=f"{n}_v4")

            # Write the new keys/values into slots [position, position + T) of layer i.
            begin = mb.concat(
                values=[np.array([i, 0, 0], np.int32), position], axis=0, name=f"{n}_begin"
            )
            end = mb.concat(
                values=[np.array([i + 1, Hk, D], np.int32), mb.add(x=position, y=np.int32(T))],
                axis=0,
                name=f"{n}_end",
            )
            kc = mb.slice_update(x=kc, update=k, begin=begin, end=end, name=f"{n}_kc")
            vc = mb.slice_update(x=vc, update=v, begin=begin, end=end, name=f"{n}_vc")
            lo = np.array([i, 0, 0, 0], np.int32)
            hi = np.array([i + 1, Hk, D, C], np.int32)
            K = mb.slice_by_index(x=kc, begin=lo, end=hi, name=f"{n}_K")  # (1, Hk, D, C)
            V = mb.slice_by_index(x=vc, begin=lo, end=hi, name=f"{n}_V")
            K = mb.reshape(x=K, shape=[Hk, 1, D, C])
            V = mb.reshape(x=V, shape=[Hk, 1, D, C])

            s = mb.matmul(x=q, y=K, transpose_x=True, name=f"{n}_scores")  # (Hk, g, T, C)
            s = mb.add(x=s, y=mask, name=f"{n}_masked")
            a = mb.softmax(x=s, axis=-1, name=f"{n}_probs")
            o = mb.matmul(x=V, y=a, transpose_y=True, name=f"{n}_attn")  # (Hk, g, D, T)
            o = mb.reshape(x=o, shape=[1, H * D, 1, T])
            h = mb.add(
                x=h,
                y=_linear(mb, o, w[p + "self_attn.o_proj.weight"], None, f"{n}_o"),
                name=f"{n}_res1",
            )

            x = _rms_norm(mb, h, w[p + "post_attention_layernorm.weight"], shape.eps, f"{n}_ln2")
            gate = _linear(
                mb, x, w[p + "mlp.gate_proj.weight"], w.get(p + "mlp.gate_proj.bias"), f"{n}_gate"
            )
            up = _linear(
                mb, x, w[p + "mlp.up_proj.weight"], w.get(p + "mlp.up_proj.bias"), f"{n}_up"
            )
            act = mb.mul(x=mb.silu(x=gate), y=up, name=f"{n}_act")
            down = _linear(
                mb, act, w[p + "mlp.down_proj.weight"], w.get(p + "mlp.down_proj.bias"), f"{n}_down"
            )
            h = mb.add(x=h, y=down, name=f"{n}_res2")
        mb.coreml_update_state(state=key_cache, value=kc, name="key_cache_out")
        mb.coreml_update_state(state=value_cache, value=vc, name="value_cache_out")

        t_out = T
        if last_only and T > 1:
            # Prefill only needs the next-token logits of its last slot: skip T-1 head projections.
            h = mb.slice_by_index(x=h, begin=[0, 0, 0, T - 1], end=[1, E, 1, T], name="h_last")
            t_out = 1
        h = _rms_norm(mb, h, w["model.norm.weight"], shape.eps, "final_norm")
        if shape.tied:
            # Tied head reuses the embedding const (one copy in the weight file): (V, E) @ (E, T).
            hs = mb.reshape(x=h, shape=[E, t_out], name="h_flat")
            logits = mb.matmul(x=emb_w, y=hs, name="head")  # (V, T)
            return mb.reshape(x=logits, shape=[1, shape.vocab, 1, t_out], name="logits")
        logits = _linear(mb, h, w["lm_head.weight"], None, "head")
        return mb.identity(x=logits, name="logits")

    return prog
