"""Attention on the CPU device: numpy for long prompts, a grouped base-2 softmax in MLX's graph
for the rest; `attention()` picks, and every model calls it.

`mx.fast.scaled_dot_product_attention` is the right kernel on Metal. On MLX's CPU backend
its softmax's `exp` is scalar (about 21 ns an element): decoding steps and verification
rounds take `grouped_attention` (exponentials as `power(2, .)`, about 6 ns), and a long
prefill chunk is another matter again: the
score matrix (H x T x S floats) goes through an elementwise `exp` about 19x slower
than numpy's vectorised one (measured here: 75M floats, 0.83 s vs 0.044 s), so
attention, not the weights, set the prefill rate of an 8k prompt (a 1,024-token chunk
at offset 7,168 took 9x the first chunk). Past `CPU_NUMPY_MIN_SCORES` scores, the CPU
computes attention with numpy on the same buffers (no copy in, one out), in float32,
in query blocks so only keys a block can see are touched (causal skip), the blocks
spread over one thread per core with BLAS held to one thread meanwhile.

Semantics are those of the fused kernel plus, for `numpy_attention`, the optional Gemma 2
logit soft-cap: q (B, H, T, D), k/v (B, Hk, S, D), H a multiple of Hk (grouped-query heads
h use kv head h // (H/Hk)); mask "causal" (new tokens are the last T slots, each sees slots
up to its own) or a boolean array broadcastable to (B, 1, T, S), True = attend; None is
"causal" for `numpy_attention` (prompt chunks) and no mask for `grouped_attention` and
`attention` (as for the fused kernel). Returns (B, H, T, D) in q's dtype.
"""

from __future__ import annotations

import functools
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import numpy as np
from threadpoolctl import ThreadpoolController

from edgespec.kernels import base2, native

# Below this many scores per call (H * T * S, summed over the batch) the fused kernel
# wins or the difference is noise. From 2^16 (a 128-token chunk of SmolLM2, 9 heads) the
# numpy path wins on the 2-core CPU: a 512-token prompt's prefill 2.8 -> 1.6 s, 128 tokens
# 494 -> 434 ms (the threshold was 2^22 before the blocks ran in parallel).
CPU_NUMPY_MIN_SCORES = 1 << 16
# Only prompt chunks: decoding steps and verification rounds (at most 64 new tokens)
# keep the fused kernel, the one plain decoding uses for its single-token steps.
CPU_NUMPY_MIN_QUERIES = 65
BLOCK_ROWS = 384  # score rows per block (queries x the heads sharing a kv head)
FUSED = True  # False: BLAS products around the native softmax pass even where the fused kernel applies (benchmarks)
# Which of the CPU paths run, as built until this host's verdicts are applied (apply_verdicts):
# the grouped base-2 path for decoding steps and rounds, numpy's for prompt chunks.
GROUPED_KERNEL, NUMPY_KERNEL = "cpu_grouped_attention", "cpu_numpy_attention"
TAKES = {"grouped": True, "numpy": True}


@functools.cache
def _workers() -> int:
    return max(1, min(os.cpu_count() or 1, 8))


@functools.cache
def _pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(_workers(), thread_name_prefix="edgespec-attention")


@functools.cache
def _blas_controller():
    return ThreadpoolController()


def use_numpy_attention(q: mx.array, k: mx.array) -> bool:
    """True where the numpy path is the faster one: the CPU device and a large score matrix."""
    B, H, T, _ = q.shape
    if not TAKES["numpy"] or T < CPU_NUMPY_MIN_QUERIES or B * H * T * k.shape[2] < CPU_NUMPY_MIN_SCORES:
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
    # Queries grouped by kv head, query-major: rows t0:t1 of every head sharing a kv head are
    # one contiguous (t*G, D) matrix, so a block is one matmul of G*t rows against the keys
    # (BLAS runs a 768-row product 1.4x faster per flop than three 256-row ones here). The
    # scale goes on the queries (T x D numbers) rather than on the scores (T x S).
    qg = np.empty((B, Hk, T, G, D), np.float32)
    np.multiply(qn.reshape(B, Hk, G, T, D).transpose(0, 1, 3, 2, 4), np.float32(scale), out=qg)
    out = np.empty((B, Hk, T, G, D), np.float32)
    neg = np.float32(-np.inf)
    kernel = native.softmax_rows() if native.ENABLED else None  # None: numpy's passes
    # The fused kernel (scores, softmax and P.V tile by tile in cache) where it applies: the
    # causal mask, no soft-cap, D a multiple of 16 (its products go 16 lanes at a time).
    fused = (native.attention_rows() if FUSED and native.ENABLED and mn is None and softcap is None and D % 16 == 0
             else None)
    if fused is not None:
        heads = [(b, h) for b in range(B) for h in range(Hk)]  # keys packed once a call, heads in parallel
        packed = dict(zip(heads, _pool().map(lambda bh: native.pack_keys(kn[bh]), heads), strict=True))
        if vn.strides[-1] != vn.itemsize:
            vn = np.ascontiguousarray(vn)

    def block(job: tuple[int, int, int]) -> None:
        b, h, t0 = job
        t1 = min(T, t0 + qb)
        t = t1 - t0
        # Causal: row t sits at slot S - T + t and sees slots <= it, so the block needs
        # keys up to S - T + t1 only, and only its last t1 - t0 columns need a mask.
        end = S - T + t1 if causal else S
        if fused is not None:
            vh = vn[b, h]
            if fused(qg[b, h, t0].ctypes.data, t * G, D, packed[b, h].ctypes.data, vh.ctypes.data,
                     vh.strides[0] // vh.itemsize, end, D, S - T + t0 if causal else -1, G,
                     out[b, h, t0].ctypes.data, D) != 0:
                raise MemoryError("attention: no memory for the native kernel's scratch")
            return
        scores = qg[b, h, t0:t1].reshape(t * G, D) @ kn[b, h, :end].T  # (t*G, end)
        if softcap is not None:
            np.tanh(scores / softcap, out=scores)
            scores *= softcap
        first = S - T + t0  # causal: columns before it are seen by every row of the block
        if not causal:
            by_row = scores.reshape(t, G, end)  # a view: the mask broadcasts over the G heads
            by_row += np.where(mn[b, 0, t0:t1, :end], np.float32(0), neg)[:, None]
        total = np.empty(t * G, np.float32)
        if kernel is not None:  # causal limit, max, subtract, exp and sum: two passes a row, in cache
            kernel(scores.ctypes.data, t * G, end, end, first if causal else -1, G, total.ctypes.data)
        else:
            if causal:
                slots = np.arange(first, end)
                by_row = scores.reshape(t, G, end)
                by_row[:, :, first:] += np.where(slots[None] <= slots[:, None], np.float32(0), neg)[:, None]
            top = scores.max(axis=-1, keepdims=True)
            top[~np.isfinite(top)] = 0.0  # a row that sees nothing: all -inf -> zeros below, as 0/0 is avoided
            scores -= top
            np.exp(scores, out=scores)
            scores.sum(axis=-1, out=total)
        rows = out[b, h, t0:t1].reshape(t * G, D)  # a view: out's blocks are contiguous
        np.matmul(scores, vn[b, h, :end], out=rows)  # weighted values; the totals divide them after
        total[total == 0] = 1.0  # a row that sees nothing: zeros, not 0/0
        rows /= total[:, None]

    workers = _workers()
    # Query rows per block: BLOCK_ROWS score rows (queries x grouped heads), fewer where that
    # leaves a core idle; the score block is BLOCK_ROWS x S floats per thread.
    qb = max(1, BLOCK_ROWS // G)
    if B * Hk * -(-T // qb) < workers:  # too few blocks: split each head's queries in `pieces`
        pieces = -(-workers // (B * Hk))
        qb = max(1, -(-T // pieces))
    jobs = [(b, h, t0) for b in range(B) for h in range(Hk) for t0 in range(0, T, qb)]
    if causal:
        # Longest first (a block's work is its rows times the keys it sees, which grow with
        # t0): the pool hands jobs out in order as threads free up, so short blocks fill in
        # at the end rather than one thread finishing a long block alone.
        jobs.sort(key=lambda j: -(min(T, j[2] + qb) - j[2]) * (S - T + min(T, j[2] + qb)))
    if workers == 1 or len(jobs) == 1:
        for job in jobs:
            block(job)
    else:
        # The blocks are independent (each writes its own rows of `out`); numpy runs its
        # element-wise passes (max, exp) on one core, so the blocks go to one thread per
        # core, with BLAS held to one thread meanwhile (two blocks' matmuls on 2+2 threads
        # contend): a 512-query chunk against 8,190 keys 181 -> 120 ms on 2 cores.
        with _blas_controller().limit(limits=1, user_api="blas"):
            list(_pool().map(block, jobs))
    result = mx.array(out.transpose(0, 1, 3, 2, 4).reshape(B, H, T, D))
    return result if q.dtype == mx.float32 else result.astype(q.dtype)


_FLOAT32_LOWEST = -3.4028234663852886e38
# (the mask, or (T, S) for "causal"; its bias), per thread: an array is built on its thread's
# stream, and another thread cannot evaluate it (a batcher worker restarted after a crash met
# "There is no Stream(cpu, N) in current thread" on its predecessor's bias).
_last_bias = threading.local()


def _mask_bias(mask, T: int, S: int) -> mx.array | None | bool:
    """An additive mask (0 where a query may attend, -inf elsewhere) shaped (b, 1, 1, T, S) or
    (T, S), for scores grouped as (B, Hk, G, T, S); None for no mask (every key visible, as in
    the fused kernel); False where the mask is of a kind the grouped path does not take
    (per-head masks, additive float masks)."""
    if mask is None:
        return None
    if isinstance(mask, str) and mask != "causal":
        raise ValueError(f"unknown attention mask {mask!r}")
    # Every layer of a pass gets the same mask: built once, not once a layer (4-5 small ops
    # each, about 1 ms a pass of SmolLM2's 30 layers).
    key = (T, S) if isinstance(mask, str) else mask
    last_key, last = getattr(_last_bias, "pair", (None, None))
    if last_key is key or (type(key) is tuple and type(last_key) is tuple and last_key == key):
        return last
    if isinstance(mask, str):  # new tokens are the last T slots; each sees the slots up to its own
        mask = mx.arange(S)[None] <= (S - T + mx.arange(T))[:, None]
    if mask.dtype != mx.bool_ or not 2 <= mask.ndim <= 4:
        return False
    m = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)  # (b, 1, T, S)
    if m.shape[1] != 1:
        return False
    bias = mx.where(m, mx.array(0.0, mx.float32), mx.array(-mx.inf, mx.float32))[:, :, None]
    _last_bias.pair = (key, bias)
    return bias


def grouped_attention(q: mx.array, k: mx.array, v: mx.array, scale: float, mask=None) -> mx.array | None:
    """Attention in MLX's graph with the softmax's exponentials as `power(2, .)`, for float32
    on the CPU device (edgespec.kernels.base2); None where it does not apply (the caller's
    kernel runs then).

    MLX's fused kernel takes its softmax with MLX's CPU `exp` (about 21 ns an element): at 8
    queries against 600 keys (SmolLM2's 9 heads) that was most of a layer's attention (1.75 ms
    of it; this path 0.97 ms), and why a verification pass grew with its width far more than
    its products did. The queries are scaled by `scale * log2(e)`, so the scores are in base 2,
    and `2 ** (s - max)` replaces `exp`. The grouped heads share one product against their key
    head (q as (B, Hk, G * T, D)). A row that sees no key gives zeros (as `numpy_attention`).
    """
    B, H, T, D = q.shape
    Hk, S = k.shape[1], k.shape[2]
    if not base2.applies(q, k, v) or H % Hk:
        return None
    bias = _mask_bias(mask, T, S)
    if bias is False:
        return None
    G = H // Hk
    # Only a boolean mask can hide every key from a row ("causal": each query sees itself).
    empty_rows = bias is not None and not isinstance(mask, str)
    s = (q * (scale * base2.LOG2E)).reshape(B, Hk, G * T, D) @ k.swapaxes(-1, -2)  # (B, Hk, G*T, S)
    if bias is not None:
        s = (s.reshape(B, Hk, G, T, S) + bias).reshape(-1, Hk, G * T, S)
    top = mx.max(s, axis=-1, keepdims=True)
    if empty_rows:
        top = mx.maximum(top, _FLOAT32_LOWEST)  # finite where a row sees nothing
    e = mx.power(2.0, s - top)
    total = mx.sum(e, axis=-1, keepdims=True)
    if empty_rows:  # each row's largest term is 2**0 = 1: a total below 1 means no key seen, zeros
        total = mx.maximum(total, 1.0)
    return ((e @ v) / total).reshape(-1, H, T, D)


def attention(q: mx.array, k: mx.array, v: mx.array, scale: float, mask=None, inference: bool = True) -> mx.array:
    """Scaled dot-product attention with the fused kernel's semantics (mask None: every key
    visible; "causal": the new queries are the last T slots; bool, True = attend): numpy on the
    CPU for long chunks of an inference call (numpy has no gradients), the grouped base-2 path
    for the other float32 calls on the CPU, else (Metal, other dtypes) the fused kernel."""
    if inference and mask is not None and use_numpy_attention(q, k):
        return numpy_attention(q, k, v, scale, mask)
    out = grouped_attention(q, k, v, scale, mask) if TAKES["grouped"] else None  # None off the CPU, ...
    if out is not None:
        return out
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)


def apply_verdicts() -> dict[str, bool]:
    """Which CPU attention paths run in this process (TAKES), each timed once per machine against
    what it replaces, the verdicts kept (edgespec.kernels.verdicts): the grouped base-2 path against
    MLX's fused kernel at a decoding step and an 8-token round over 600 keys, then numpy's path
    against the one decoding uses at a 256-token prompt chunk after 256 cached positions; shapes
    of SmolLM2 (9 query heads on 3 key heads of 64). Off the CPU device or with checks off: as
    built. Call after base2.apply_verdicts (the grouped path needs the base-2 forms)."""
    from edgespec.kernels import verdicts

    if mx.default_device() != mx.cpu or not verdicts.checks_on():
        return dict(TAKES)
    keys = mx.random.split(mx.random.key(11), 3)
    H, Hk, D, scale = 9, 3, 64, 0.125

    def qkv(T: int, S: int):
        q = mx.random.normal((1, H, T, D), key=keys[0])
        k, v = (mx.random.normal((1, Hk, S, D), key=kk) for kk in keys[1:])
        mx.eval(q, k, v)
        return q, k, v

    steps = [qkv(1, 600), qkv(8, 600)]
    if base2.applies(*steps[0]):
        def grouped_check():
            return verdicts.race(
                GROUPED_KERNEL, "", lambda: mx.eval([grouped_attention(*a, scale, "causal") for a in steps * 4]),
                lambda: mx.eval([mx.fast.scaled_dot_product_attention(*a, scale=scale, mask="causal")
                                 for a in steps * 4]), what="MLX's fused kernel")
        TAKES["grouped"] = verdicts.decide(GROUPED_KERNEL, "", grouped_check).used
    chunk = qkv(256, 512)
    grouped = TAKES["grouped"] and base2.applies(*chunk)
    variant = f"against={'grouped' if grouped else 'fused'}"

    def replaced():
        out = grouped_attention(*chunk, scale, "causal") if grouped else None
        mx.eval(out if out is not None else mx.fast.scaled_dot_product_attention(*chunk, scale=scale, mask="causal"))

    def numpy_check():
        return verdicts.race(NUMPY_KERNEL, variant, lambda: mx.eval(numpy_attention(*chunk, scale, "causal")),
                             replaced, what="the grouped path" if grouped else "MLX's fused kernel")
    TAKES["numpy"] = verdicts.decide(NUMPY_KERNEL, variant, numpy_check).used
    return dict(TAKES)
