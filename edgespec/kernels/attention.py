"""Attention for long prompts on the CPU device.

`mx.fast.scaled_dot_product_attention` is the right kernel on Metal and for decoding
steps everywhere. On MLX's CPU backend a long prefill chunk is another matter: the
score matrix (H x T x S floats) goes through an elementwise `exp` about 19x slower
than numpy's vectorised one (measured here: 75M floats, 0.83 s vs 0.044 s), so
attention, not the weights, set the prefill rate of an 8k prompt (a 1,024-token chunk
at offset 7,168 took 9x the first chunk). Past `CPU_NUMPY_MIN_SCORES` scores, the CPU
computes attention with numpy on the same buffers (no copy in, one out), in float32,
in query blocks so only keys a block can see are touched (causal skip), the blocks
spread over one thread per core with BLAS held to one thread meanwhile.

Semantics are those of the fused kernel plus the optional Gemma 2 logit soft-cap:
q (B, H, T, D), k/v (B, Hk, S, D), H a multiple of Hk (grouped-query heads h use
kv head h // (H/Hk)); mask None or "causal" (new tokens are the last T slots, each
sees slots up to its own) or a boolean array broadcastable to (B, 1, T, S), True =
attend. Returns (B, H, T, D) in q's dtype.
"""

from __future__ import annotations

import functools
import os
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import numpy as np

# Below this many scores per call (H * T * S, summed over the batch) the fused kernel
# wins or the difference is noise. From 2^16 (a 128-token chunk of SmolLM2, 9 heads) the
# numpy path wins on the 2-core CPU: a 512-token prompt's prefill 2.8 -> 1.6 s, 128 tokens
# 494 -> 434 ms (the threshold was 2^22 before the blocks ran in parallel).
CPU_NUMPY_MIN_SCORES = 1 << 16
# Only prompt chunks: decoding steps and verification rounds (at most 64 new tokens)
# keep the fused kernel, the one plain decoding uses for its single-token steps.
CPU_NUMPY_MIN_QUERIES = 65
QUERY_BLOCK = 256  # query rows per block: bounds the score buffer at G*256*S floats per kv head


@functools.cache
def _workers() -> int:
    return max(1, min(os.cpu_count() or 1, 8))


@functools.cache
def _pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(_workers(), thread_name_prefix="edgespec-attention")


@functools.cache
def _blas_controller():
    from threadpoolctl import ThreadpoolController  # introspects the loaded BLAS libraries once

    return ThreadpoolController()


def use_numpy_attention(q: mx.array, k: mx.array) -> bool:
    """True where the numpy path is the faster one: the CPU device and a large score matrix."""
    B, H, T, _ = q.shape
    if T < CPU_NUMPY_MIN_QUERIES or B * H * T * k.shape[2] < CPU_NUMPY_MIN_SCORES:
        return False
    return mx.default_device() == mx.cpu


def numpy_attention(q: mx.array, k: mx.array, v: mx.array, scale: float, mask=None,
                    softcap: float | None = None) -> mx.array:
    B, H, T, D = q.shape
    Hk, S = k.shape[1], k.shape[2]
    G = H // Hk
    mx.eval(q, k, v, mask if isinstance(mask, mx.array) else [])
    qn = np.asarray(q.astype(mx.float32) if q.dtype != mx.float32 else q)
    kn = np.asarray(k.astype(mx.float32) if k.dtype != mx.float32 else k)
    vn = np.asarray(v.astype(mx.float32) if v.dtype != mx.float32 else v)
    causal = mask is None or isinstance(mask, str)
    if causal and mask is not None and mask != "causal":
        raise ValueError(f"unknown attention mask {mask!r}")
    mn = None if causal else np.broadcast_to(np.asarray(mask), (B, 1, T, S))
    out = np.empty((B, Hk, G, T, D), np.float32)
    # The scale goes on the queries (T x D numbers) rather than on the scores (T x S), and the
    # softmax's division on the output rows after P.V: two passes fewer over the score block,
    # which at long contexts costs as much as its matmuls.
    qg = qn.reshape(B, Hk, G, T, D) * np.float32(scale)

    def block(t0: int) -> None:
        t1 = min(T, t0 + qb)
        # Causal: row t sits at slot S - T + t and sees slots <= it, so the block needs
        # keys up to S - T + t1 only, and only its last t1 - t0 columns need a mask.
        end = S - T + t1 if causal else S
        scores = np.matmul(qg[:, :, :, t0:t1], kn[:, :, None, :end].swapaxes(-1, -2))  # (B,Hk,G,t,end)
        if softcap is not None:
            np.tanh(scores / softcap, out=scores)
            scores *= softcap
        if causal:
            first = S - T + t0  # columns before it are seen by every row of the block
            rows = np.arange(first, S - T + t1)[:, None]
            allowed = np.arange(first, end)[None] <= rows  # (t, t)
            scores[..., first:] += np.where(allowed, np.float32(0), np.float32(-np.inf))
        else:
            allowed = mn[:, :, None, t0:t1, :end]  # (B, 1, 1, t, end)
            scores += np.where(allowed, np.float32(0), np.float32(-np.inf))  # broadcast over heads
        top = scores.max(axis=-1, keepdims=True)
        top[~np.isfinite(top)] = 0.0  # a row that sees nothing: all -inf -> zeros below, as 0/0 is avoided
        scores -= top
        np.exp(scores, out=scores)
        total = scores.sum(axis=-1, keepdims=True)
        total[total == 0] = 1.0
        pv = np.matmul(scores, vn[:, :, None, :end])
        pv /= total
        out[:, :, :, t0:t1] = pv

    workers = _workers()
    qb = QUERY_BLOCK if workers == 1 else max(64, min(QUERY_BLOCK, -(-T // workers)))
    starts = range(0, T, qb)
    if workers == 1 or len(starts) == 1:
        for t0 in starts:
            block(t0)
    else:
        # The blocks are independent (each writes its own rows of `out`); numpy runs its
        # element-wise passes (max, exp, sum) on one core, so the blocks go to one thread
        # per core, with BLAS held to one thread meanwhile (two blocks' matmuls on 2+2
        # threads contend): a 512-query chunk against 8,190 keys 181 -> 120 ms on 2 cores.
        with _blas_controller().limit(limits=1, user_api="blas"):
            list(_pool().map(block, starts))
    result = mx.array(out.reshape(B, H, T, D))
    return result if q.dtype == mx.float32 else result.astype(q.dtype)


def attention(q: mx.array, k: mx.array, v: mx.array, scale: float, mask=None) -> mx.array:
    """Scaled dot-product attention: numpy on the CPU for long chunks, else the fused kernel."""
    if use_numpy_attention(q, k):
        return numpy_attention(q, k, v, scale, mask)
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
