"""Bitwise verification: products and attention whose rows do not depend on the pass width.

A verifier pass over T positions (a chain of drafts, a tree under its mask, a prompt chunk)
normally rounds differently from a one-token pass over the same prefix: the BLAS picks
other kernels and blockings for other row counts, and the attention reduces over a
different number of keys in a different order. A near-tie in the verifier's distribution
(two logits within ~1e-5) can then flip, and `auto` emits a token plain decoding would
not (issue 42). With bitwise mode on, each row of any pass is bitwise the row a one-token
pass gives, so speculation cannot change a single bit of the output.

How (docs/bitwise.md), on the CPU device:
- linear layers: `x @ W.T` as `W @ X.T` over tiles of exactly `TILE` rows (zero-padded),
  one BLAS call of the same shape per tile whatever T is (batched, so one MLX op). Every
  call has the same shape, so the BLAS takes the same kernels and the same reduction
  order over K; a column's result does not depend on the other columns of its tile
  (tests/test_bitwise.py checks it on every layer shape of the tiny and the default model);
- quantized linear layers: MLX's CPU `quantized_matmul` already computes each row alone
  (tests/test_bitwise.py checks it);
- attention: the native kernel in cpu_exact.c (every reduction ordered by a key's rank
  among the keys the row may see);
- norms, RoPE, embeddings, activations are row by row already (the numpy activation of
  long prompt chunks is not used in this mode).

On Metal the counterparts are the kernels `EXACT_LINEAR` and `EXACT_ATTENTION` below
(one thread an output, fixed reduction orders), run through `mx.fast.metal_kernel`, with
quantized weights dequantized first; here their sources are run through the C++
emulation (edgespec/kernels/emulate.py) in the tests, which check that rows do not depend
on the width. The mode is a process-wide setting: `EDGESPEC_BITWISE=1`,
`edgespec.load(..., bitwise=True)` or the apps' `--bitwise-verify`.
"""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from edgespec.errors import EdgespecError
from edgespec.kernels import native
from edgespec.kernels.attention import _pool, _workers
from edgespec.kernels.native import NativeBuildError
from edgespec.kernels.spec import KernelSpec, compare, metal, on_metal, prologue, usable

TILE = 8  # rows a BLAS call takes in bitwise mode (every call: N x TILE x K)
ENV = "EDGESPEC_BITWISE"

_enabled = os.environ.get(ENV, "0") not in ("", "0")


def enabled() -> bool:
    """Whether verifier passes run the width-invariant kernels (process-wide)."""
    return _enabled


def set_enabled(on: bool) -> None:
    """Turn bitwise mode on or off for the process (edgespec.load(bitwise=...), the apps).
    On the CPU device the native attention kernel is built (and checked) now, so a machine
    that cannot build it fails here (NativeBuildError), not in the middle of a reply."""
    global _enabled
    if on and not on_metal():
        try:
            kernel()
        except (NativeBuildError, OSError) as e:
            raise BitwiseUnavailableError(f"bitwise verification needs its native CPU kernel, which cannot "
                                          f"be built here: {e}") from None
    _enabled = bool(on)


class BitwiseUnavailableError(EdgespecError, RuntimeError):
    """Bitwise mode was asked for where its kernels cannot run (the message says why)."""


# ---------------------------------------------------------------- Metal sources

# Grid (N, M, 1): one thread per output y[m, n] = sum_k x[m, k] * w[n, k], k in order.
EXACT_LINEAR = KernelSpec(
    name="edgespec_exact_linear",
    inputs=("x", "w", "dims"),
    outputs=("y",),
    source=prologue("n m", "M N K") + """
    if (int(m) >= M || int(n) >= N) {
        return;
    }
    float acc = 0.0f;
    for (int k = 0; k < K; ++k) {
        acc = fma(x[size_t(m) * size_t(K) + size_t(k)], w[size_t(n) * size_t(K) + size_t(k)], acc);
    }
    y[size_t(m) * size_t(N) + size_t(n)] = acc;
""",
)

# Grid (D, rows, BH): one thread per output element out[bh, r, d], r = t * G + g a query row
# (query-major, G heads sharing a key/value head), bh = b * Hk + kv head. Three passes over
# the keys the row may see, in slot order, each reduction in that order: max, sum of
# exp(s - max), sum of exp(s - max) * v[., d]. Keys the row may not see are skipped, never
# added as zeros, so the order of the ones it sees is the order of a one-token pass.
# mask: (B', T, S) bytes (B' = 1 or B) when dims[6] is 1; else causal, row t seeing slots
# <= S - T + t. A row that sees nothing gives 0.
EXACT_ATTENTION = KernelSpec(
    name="edgespec_exact_attention",
    inputs=("q", "k", "v", "mask", "dims", "params"),
    outputs=("out",),
    source=prologue("d r bh", "D R G S Hk BH masked mask_batch") + """
    if (int(d) >= D || int(r) >= R || int(bh) >= BH) {
        return;
    }
    float scale = params[0];
    float cap = params[1];
    int T = R / G;
    int t = int(r) / G;
    int b = int(bh) / Hk;
    size_t qrow = (size_t(bh) * size_t(R) + size_t(r)) * size_t(D);
    size_t kv0 = size_t(bh) * size_t(S) * size_t(D);
    size_t mrow = (size_t(mask_batch > 1 ? b : 0) * size_t(T) + size_t(t)) * size_t(S);
    int end = masked != 0 ? S : min(S, S - T + t + 1);
    float m = -INFINITY;
    for (int j = 0; j < end; ++j) {
        if (masked != 0 && mask[mrow + size_t(j)] == 0) {
            continue;
        }
        float s = 0.0f;
        for (int e = 0; e < D; ++e) {
            s = fma(q[qrow + size_t(e)] * scale, k[kv0 + size_t(j) * size_t(D) + size_t(e)], s);
        }
        if (cap > 0.0f) {
            s = cap * tanh(s / cap);
        }
        m = max(m, s);
    }
    if (m == -INFINITY) {
        out[qrow + size_t(d)] = 0.0f;
        return;
    }
    float l = 0.0f;
    float o = 0.0f;
    for (int j = 0; j < end; ++j) {
        if (masked != 0 && mask[mrow + size_t(j)] == 0) {
            continue;
        }
        float s = 0.0f;
        for (int e = 0; e < D; ++e) {
            s = fma(q[qrow + size_t(e)] * scale, k[kv0 + size_t(j) * size_t(D) + size_t(e)], s);
        }
        if (cap > 0.0f) {
            s = cap * tanh(s / cap);
        }
        float p = exp(s - m);
        l = l + p;
        o = fma(p, v[kv0 + size_t(j) * size_t(D) + size_t(d)], o);
    }
    out[qrow + size_t(d)] = o / l;
""",
)

SPECS = (EXACT_LINEAR, EXACT_ATTENTION)


def attention_inputs(q: mx.array, k: mx.array, mask) -> tuple[mx.array, list[int], tuple[int, int]]:
    """EXACT_ATTENTION's mask bytes (B', T, S), its `dims` and the output grid's (rows, B*Hk)
    for q (B, H, T, D), k (B, Hk, S, D) and a mask None / "causal" / bool broadcastable to
    (B, 1, T, S)."""
    B, H, T, D = q.shape
    Hk, S = k.shape[1], k.shape[2]
    G = H // Hk
    if mask is None or isinstance(mask, str):
        if mask not in (None, "causal"):
            raise ValueError(f"unknown attention mask {mask!r}")
        m, masked, mb = mx.zeros((1, 1, 1), mx.uint8), 0, 1
    else:
        m4 = mask if mask.ndim == 4 else mask.reshape((1,) * (4 - mask.ndim) + mask.shape)
        mb = m4.shape[0]
        m = mx.broadcast_to(m4[:, 0], (mb, T, S)).astype(mx.uint8)
        masked = 1
    return m, [D, T * G, G, S, Hk, B * Hk, masked, mb], (T * G, B * Hk)


def _group_queries(q: mx.array, Hk: int) -> mx.array:
    """q (B, H, T, D) -> (B*Hk, T*G, D): rows of the G heads sharing a kv head, query-major."""
    B, H, T, D = q.shape
    G = H // Hk
    return q.reshape(B, Hk, G, T, D).transpose(0, 1, 3, 2, 4).reshape(B * Hk, T * G, D)


def _ungroup(out: mx.array, B: int, H: int, T: int, D: int, Hk: int) -> mx.array:
    G = H // Hk
    return out.reshape(B, Hk, T, G, D).transpose(0, 1, 3, 2, 4).reshape(B, H, T, D)


# ---------------------------------------------------------------- dispatchers


def exact_linear(x: mx.array, weight: mx.array, bias: mx.array | None = None) -> mx.array:
    """x (..., K) @ weight (N, K).T (+ bias) -> (..., N), each row bitwise independent of the others."""
    K = x.shape[-1]
    lead = x.shape[:-1]
    X = x.reshape(-1, K)
    M = X.shape[0]
    if usable(EXACT_LINEAR, "float32", _check_linear):  # (on Metal; any dtype is given as float32)
        y = _exact_linear_metal(X, weight).astype(x.dtype)
    else:  # off Metal, or the kernel failed its self-check: same-shape tiles (below)
        tiles = -(-M // TILE)
        if tiles * TILE != M:
            X = mx.concatenate([X, mx.zeros((tiles * TILE - M, K), X.dtype)])
        # (tiles, K, TILE): each tile one product W (N, K) @ (K, TILE) of the same shape
        y = (weight @ X.reshape(tiles, TILE, K).swapaxes(1, 2)).swapaxes(1, 2).reshape(tiles * TILE, -1)[:M]
    y = y.reshape(*lead, -1)
    return y + bias if bias is not None else y


def _exact_linear_metal(X: mx.array, weight: mx.array) -> mx.array:
    M, K = X.shape
    return metal(EXACT_LINEAR)(inputs=[X.astype(mx.float32), weight.astype(mx.float32),
                                       mx.array([M, weight.shape[0], K], dtype=mx.int32)],
                               grid=(weight.shape[0], M, 1), threadgroup=(32, 1, 1),
                               output_shapes=[(M, weight.shape[0])], output_dtypes=[mx.float32])[0]


def _check_linear() -> None:
    """The self-check: a few rows against float64, and every row equal to itself computed alone."""
    rng = np.random.default_rng(0)
    X = rng.standard_normal((5, 48)).astype(np.float32)
    W = rng.standard_normal((7, 48)).astype(np.float32)
    y = _exact_linear_metal(mx.array(X), mx.array(W))
    compare("exact_linear", y, (X.astype(np.float64) @ W.T.astype(np.float64)).astype(np.float32), tol=1e-5)
    for m in range(X.shape[0]):
        compare("exact_linear row alone", y[m : m + 1], _exact_linear_metal(mx.array(X[m : m + 1]), mx.array(W)))


def exact_quantized_linear(x: mx.array, layer) -> mx.array:
    """A QuantizedLinear's (or QuantizedEmbedding's) product on Metal with rows independent of
    the pass width: the weight dequantized, then EXACT_LINEAR. (MLX's CPU product is row by
    row already: the CPU never comes here.)"""
    w = mx.dequantize(layer["weight"], layer["scales"], layer.get("biases"), layer.group_size, layer.bits,
                      **({"mode": layer.mode} if hasattr(layer, "mode") else {}))
    return exact_linear(x, w, layer.get("bias"))


def output_projection(layer, h: mx.array) -> mx.array:
    """The output projection by `layer`: an Embedding used as a linear (tied), a Linear or a
    quantized one of either, in bitwise mode. h (..., E) -> (..., V)."""
    if isinstance(layer, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
        if not on_metal():
            return layer.as_linear(h) if isinstance(layer, nn.QuantizedEmbedding) else layer(h)
        return exact_quantized_linear(h, layer)
    return exact_linear(h, layer["weight"], layer["bias"] if "bias" in layer else None)


def exact_attention(q: mx.array, k: mx.array, v: mx.array, scale: float, mask=None,
                    softcap: float | None = None) -> mx.array:
    """Attention whose every query row is bitwise what a one-query call over the keys it sees
    gives. q (B, H, T, D), k/v (B, Hk, S, D), mask None / "causal" / bool broadcastable to
    (B, 1, T, S) (True = attend) -> (B, H, T, D) in q's dtype."""
    B, H, T, D = q.shape
    Hk = k.shape[1]
    m, dims, _ = attention_inputs(q, k, mask)
    qg = _group_queries(q.astype(mx.float32), Hk)
    if usable(EXACT_ATTENTION, "float32", _check_attention):  # (on Metal; given as float32)
        out = _exact_attention_metal(qg, k, v, m, dims, scale, softcap)
    else:  # off Metal, or the kernel failed its self-check: the native CPU kernel (same semantics)
        if on_metal():
            try:
                kernel()
            except (NativeBuildError, OSError) as e:
                raise BitwiseUnavailableError(f"bitwise verification: the Metal kernel failed its self-check and "
                                              f"the native CPU kernel cannot be built here: {e}") from None
        out = _cpu_attention(qg, k.astype(mx.float32), v.astype(mx.float32), m, dims, scale, softcap)
    return _ungroup(out, B, H, T, D, Hk).astype(q.dtype)


def _exact_attention_metal(qg, k, v, m, dims, scale, softcap) -> mx.array:
    B, Hk, S, D = k.shape
    rows, bh = dims[1], dims[5]
    kf, vf = k.astype(mx.float32).reshape(B * Hk, S, D), v.astype(mx.float32).reshape(B * Hk, S, D)
    return metal(EXACT_ATTENTION)(
        inputs=[qg, kf, vf, m, mx.array(dims, dtype=mx.int32), mx.array([scale, softcap or 0.0], dtype=mx.float32)],
        grid=(D, rows, bh), threadgroup=(min(D, 32), 1, 1), output_shapes=[(bh, rows, D)],
        output_dtypes=[mx.float32])[0]


def _check_attention() -> None:
    """The self-check: causal and masked calls (grouped heads, a softcap) against float64 numpy."""
    rng = np.random.default_rng(0)
    B, H, Hk, T, S, D = 1, 4, 2, 3, 11, 16
    q = rng.standard_normal((B, H, T, D)).astype(np.float32)
    k, v = (rng.standard_normal((B, Hk, S, D)).astype(np.float32) for _ in range(2))
    tree = np.ones((1, 1, T, S), bool)
    tree[0, 0, 2, S - 2] = False  # the last node does not see the middle one (a tree step)
    for mask, cap in ((None, None), (tree, 30.0)):
        mm, dims, _ = attention_inputs(mx.array(q), mx.array(k), None if mask is None else mx.array(mask))
        qg = _group_queries(mx.array(q), Hk)
        out = _ungroup(_exact_attention_metal(qg, mx.array(k), mx.array(v), mm, dims, 0.25, cap), B, H, T, D, Hk)
        compare("exact_attention", out, reference_attention(q, k, v, 0.25, mask, cap), tol=1e-5)


# Below this many multiply-adds a call (rows x keys x D, all heads) the heads run one after
# another on the calling thread: handing a decoding step's few heads to the pool costs more
# than it saves, most of all on a loaded machine.
POOL_MIN_WORK = 1 << 22


def _cpu_attention(qg, k, v, m, dims, scale, softcap) -> mx.array:
    """The native kernel per (batch, kv head): qg (B*Hk, rows, D); k, v (B, Hk, S, D) as the
    cache hands them (a view of its buffer: read in place, each head's rows contiguous)."""
    fn = kernel()
    D, R, G, S, Hk, BH, masked, mb = dims
    T = R // G
    mx.eval(qg, k, v, m)
    qn = np.ascontiguousarray(np.asarray(qg))  # a view of q may keep its rows apart
    kn, vn = np.asarray(k), np.asarray(v)
    if kn.strides[-1] != 4 or vn.strides[-1] != 4:
        kn, vn = np.ascontiguousarray(kn), np.ascontiguousarray(vn)
    mn = np.ascontiguousarray(np.asarray(m)) if masked else None
    out = np.empty((BH, R, D), np.float32)

    def job(i: int) -> None:
        b, h = divmod(i, Hk)
        kh, vh = kn[b, h], vn[b, h]
        mask_ptr = None if mn is None else mn[b if mb > 1 else 0].ctypes.data
        if fn(qn[i].ctypes.data, R, G, kh.ctypes.data, kh.strides[0] // 4, vh.ctypes.data, vh.strides[0] // 4,
              S, D, mask_ptr, S - T, float(scale), float(softcap or 0.0), out[i].ctypes.data) != 0:
            raise MemoryError("bitwise attention: no memory for the native kernel's scratch")

    if BH == 1 or _workers() == 1 or R * S * D * BH < POOL_MIN_WORK:
        for i in range(BH):
            job(i)
    else:
        list(_pool().map(job, range(BH)))
    return mx.array(out)


def reference_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float, mask: np.ndarray | None,
                        softcap: float | None = None) -> np.ndarray:
    """float64 numpy attention (B, H, T, D) with the same semantics, for checks and tests;
    mask None = causal, else bool (B', 1, T, S)."""
    B, H, T, D = q.shape
    Hk, S = k.shape[1], k.shape[2]
    G = H // Hk
    kk = np.repeat(k.astype(np.float64), G, axis=1)
    vv = np.repeat(v.astype(np.float64), G, axis=1)
    s = (q.astype(np.float64) * scale) @ kk.swapaxes(-1, -2)
    if softcap:
        s = softcap * np.tanh(s / softcap)
    see = (np.arange(S)[None] <= (S - T + np.arange(T))[:, None]) if mask is None else np.asarray(mask, bool)
    s = np.where(see, s, -np.inf)
    top = s.max(axis=-1, keepdims=True)
    top[~np.isfinite(top)] = 0.0
    p = np.exp(s - top)
    total = p.sum(axis=-1, keepdims=True)
    total[total == 0] = 1.0
    return ((p / total) @ vv).astype(np.float32)


@functools.cache
def kernel():
    """The native kernel of cpu_exact.c, built on first use and checked against numpy."""
    path = native.build(source=Path(__file__).with_name("cpu_exact.c"), stem="libedgespec_exact",
                        extra_flags=("-ffp-contract=off",))
    fn = ctypes.CDLL(str(path)).edgespec_exact_attention
    fn.restype = ctypes.c_int
    fn.argtypes = ([ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                    ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                    ctypes.c_int64, ctypes.c_float, ctypes.c_float, ctypes.c_void_p])
    rng = np.random.default_rng(0)
    for T, S, D, G, cap in ((3, 20, 16, 2, 0.0), (5, 37, 64, 3, 0.0), (4, 9, 8, 1, 20.0)):
        q = rng.standard_normal((T * G, D)).astype(np.float32)
        k, v = (rng.standard_normal((S, D)).astype(np.float32) for _ in range(2))
        out = np.full((T * G, D), np.nan, np.float32)
        if fn(q.ctypes.data, T * G, G, k.ctypes.data, D, v.ctypes.data, D, S, D, None, S - T, 0.3, cap,
              out.ctypes.data) != 0:
            raise native.NativeBuildError(f"{path}: no memory for the kernel's scratch")
        qh = q.reshape(T, G, D).transpose(1, 0, 2)[None]
        want = reference_attention(qh, k[None, None], v[None, None], 0.3, None, cap or None)
        err = float(np.abs(out.reshape(T, G, D).transpose(1, 0, 2)[None] - want).max())
        if not err < 1e-5:
            raise native.NativeBuildError(f"{path}: wrong results (max error {err:.2e} against numpy)")
    return fn
