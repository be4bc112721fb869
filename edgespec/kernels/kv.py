"""Committing the accepted entries of a tree step into the KV cache.

After a step wrote T entries at `start`, only the accepted path survives: its
entries (sorted indices into the step) move to start, start+1, ... . A GPU
kernel cannot gather in place (thread j would read a slot thread j' writes),
so the kernel gathers into a fresh (B, Hk, n, D) block that is then written back.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from edgespec.kernels.spec import KernelSpec, compare, dtype_name, metal, on_metal, prologue, usable

# Grid (D, n, B*Hk): one thread per copied element; src is the whole cache
# buffer (rows of C slots), idx holds absolute slot numbers.
KV_GATHER = KernelSpec(
    name="edgespec_kv_gather",
    inputs=("src", "idx", "dims"),
    outputs=("out",),
    source=prologue("d j r", "C D n") + """
    if (int(d) >= D || int(j) >= n) {
        return;
    }
    size_t from = (size_t(r) * size_t(C) + size_t(idx[j])) * size_t(D) + size_t(d);
    out[(size_t(r) * size_t(n) + size_t(j)) * size_t(D) + size_t(d)] = src[from];
""",
)


def kv_gather_reference(src: mx.array, idx: mx.array) -> mx.array:
    """src (B, Hk, C, D), idx (n,) absolute slots -> (B, Hk, n, D)."""
    return mx.take(src, idx, axis=2)


def kv_gather(src: mx.array, idx: mx.array) -> mx.array:
    """src (B, Hk, C, D), idx (n,) absolute slots -> (B, Hk, n, D): the kernel on Metal once it
    passed its self-check at src's dtype (a Mac's caches are half), else the reference."""
    if not usable(KV_GATHER, dtype_name(src.dtype), _check, src.dtype):
        return kv_gather_reference(src, idx)
    return _kv_gather_metal(src, idx)


def _check(dtype) -> None:
    """The self-check: a small cache of `dtype` (values that exercise its every bit pattern
    class: negatives, subnormals of half, large values) gathered in a new order, bit for bit."""
    rng = np.random.default_rng(0)
    vals = rng.standard_normal((2, 3, 9, 40)).astype(np.float32) * np.float32(2.0) ** rng.integers(-20, 12, (2, 3, 9, 40))
    src = mx.array(vals).astype(dtype)
    idx = mx.array([7, 2, 5, 0], dtype=mx.int32)
    compare("kv_gather", _kv_gather_metal(src, idx), kv_gather_reference(src, idx))


def _kv_gather_metal(src: mx.array, idx: mx.array) -> mx.array:
    B, Hk, C, D = src.shape
    n = idx.shape[0]
    dims = mx.array([C, D, n], dtype=mx.int32)
    (out,) = metal(KV_GATHER)(
        inputs=[src, idx.astype(mx.int32), dims],
        grid=(D, n, B * Hk),
        threadgroup=(min(D, 256), 1, 1),
        output_shapes=[(B, Hk, n, D)],
        output_dtypes=[src.dtype],
    )
    return out


def commit_kv(caches, start: int, indices: list[int]) -> None:
    """Keep step entries `start + indices` (sorted) packed at `start`; drop the rest.

    Same effect as `KVCache.keep`, with the gather done by the kernel on Metal.
    """
    many = caches[0].keep_many if caches else None
    if many is not None:  # a batch arena's rows (edgespec.batch.arena): every layer at once
        many(caches, start, indices)
        return
    if not on_metal() or any(c.forwards_ops or c.keys is None for c in caches):
        # a distributed verifier's caches replay keep() on every rank (edgespec.distributed)
        for c in caches:
            c.keep(start, indices)
        return
    n = len(indices)
    moved = list(indices) != list(range(n))
    idx = mx.array([start + i for i in indices], dtype=mx.int32)
    for c in caches:
        if c.span_kind == "state" or c.keeps_hidden:
            # a recurrent layer's state (edgespec.caches.recurrent): recomputed; a cache with the
            # verifier's recorded states (HiddenKVCache): its rows packed with its keys
            c.keep(start, indices)
            continue
        if c.keys is not None and moved:
            c.keys[..., start : start + n, :] = kv_gather(c.keys, idx)
            c.values[..., start : start + n, :] = kv_gather(c.values, idx)
        c.offset = start + n
