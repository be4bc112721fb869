"""Weight compression for the Core ML drafter's linear layers, done once in numpy.

Each linear weight w (O, I) becomes the inputs of an iOS18 constexpr op that the
Core ML runtime decompresses at load (or streams, on the ANE):

    int8      per output channel, symmetric:  w ~ scale[o] * q,  q in [-127, 127]
    int4      per block of 32 inputs, asymmetric (like GGUF Q4_1):
              w ~ scale[o, b] * (q - offset[o, b]),  q in [0, 15]
    palette4  16-entry k-means palette per output channel

Measured on the first 2 layers of SmolLM2-135M (greedy agreement with fp32 over
71 tokens of text): int4 symmetric 0.92 vs asymmetric 1.00; a palette per 16
channels 0.56 vs per channel 0.86 (outlier rows need their own entries).

Doing it here (instead of coremltools' optimize API, which handles one function
at a time and needs scikit-learn for k-means) compresses each weight once, so
every function of the package references the same compressed blobs.
"""

from __future__ import annotations

import numpy as np

INT4_BLOCK = 32
PALETTE_GROUP = 1
PALETTE_ITERS = 12


def quantize_symmetric(
    w: np.ndarray, bits: int, block: int | None
) -> tuple[np.ndarray, np.ndarray]:
    """w (O, I) -> (q (O, I) int8 in [-qmax, qmax], scale (O, I // block) float32); block None = per row."""
    n_out, n_in = w.shape
    block = n_in if block is None or n_in % block else block
    qmax = 2 ** (bits - 1) - 1
    blocks = w.reshape(n_out, n_in // block, block)
    scale = np.abs(blocks).max(axis=-1) / qmax  # (O, nb)
    scale = np.where(scale == 0, 1.0, scale).astype(np.float16).astype(np.float32)  # stored as fp16
    q = np.clip(np.rint(blocks / scale[..., None]), -qmax, qmax).astype(np.int8)
    return q.reshape(n_out, n_in), scale


def quantize_asymmetric(w: np.ndarray, bits: int, block: int) -> tuple[np.ndarray, ...]:
    """w (O, I) -> (q uint8 in [0, 2**bits - 1], scale, offset (O, I // block) float32), block-wise."""
    n_out, n_in = w.shape
    block = n_in if n_in % block else block
    b = w.reshape(n_out, n_in // block, block)
    lo, hi = b.min(axis=-1), b.max(axis=-1)
    scale = (hi - lo) / (2**bits - 1)
    scale = np.where(scale == 0, 1.0, scale).astype(np.float16).astype(np.float32)
    offset = (-lo / scale).astype(np.float16).astype(np.float32)  # w = scale * (q - offset)
    q = np.clip(np.rint(b / scale[..., None] + offset[..., None]), 0, 2**bits - 1).astype(np.uint8)
    return q.reshape(n_out, n_in), scale, offset


def palettize(
    w: np.ndarray, nbits: int = 4, group: int = PALETTE_GROUP
) -> tuple[np.ndarray, np.ndarray]:
    """1-D k-means per group of `group` rows: w (O, I) -> (indices (O, I) uint8, lut (O // group, 2**nbits))."""
    n_out, n_in = w.shape
    group = n_out if n_out % group else group
    k = 2**nbits
    vals = w.reshape(n_out // group, group * n_in).astype(np.float32)  # (G, N)
    # Start from quantiles (good for bell-shaped weights), then Lloyd steps; in 1-D the
    # nearest centroid is found by binary search over the midpoints of sorted centroids.
    cent = np.quantile(vals, (np.arange(k) + 0.5) / k, axis=1).T  # (G, k)
    idx = np.zeros(vals.shape, np.int64)
    for _ in range(PALETTE_ITERS):
        cent.sort(axis=1)
        mids = (cent[:, 1:] + cent[:, :-1]) / 2
        for g in range(vals.shape[0]):
            idx[g] = np.searchsorted(mids[g], vals[g])
        sums = np.zeros_like(cent)
        counts = np.zeros_like(cent)
        rows = np.repeat(np.arange(vals.shape[0]), vals.shape[1])
        np.add.at(sums, (rows, idx.ravel()), vals.ravel())
        np.add.at(counts, (rows, idx.ravel()), 1)
        cent = np.where(counts > 0, sums / np.maximum(counts, 1), cent)
    lut = cent.astype(np.float16).astype(np.float32)
    return idx.reshape(n_out, n_in).astype(np.uint8), lut


def compress_linear(w: np.ndarray, method: str) -> dict[str, np.ndarray]:
    """The constexpr inputs for one conv weight (O, I) -> shapes for the (O, I, 1, 1) kernel."""
    if method == "int8":
        q, scale = quantize_symmetric(w, 8, None)
        return {"data": q[:, :, None, None], "scale": scale[:, :, None, None].astype(np.float16)}
    if method == "int4":
        q, scale, offset = quantize_asymmetric(w, 4, INT4_BLOCK)
        return {
            "data": q[:, :, None, None],
            "scale": scale[:, :, None, None].astype(np.float16),
            "offset": offset[:, :, None, None].astype(np.float16),
        }
    if method == "palette4":
        idx, lut = palettize(w, 4)
        return {
            "indices": idx[:, :, None, None],
            "lut": lut[:, None, None, None, :, None].astype(np.float16),
        }
    raise ValueError(f"unknown compression {method!r} (int8, int4, palette4)")


def decode_packed(packed: dict[str, np.ndarray]) -> np.ndarray:
    """The dense float32 weight (O, I) that compress_linear's constexpr inputs stand for."""
    if "lut" in packed:
        idx = packed["indices"][:, :, 0, 0].astype(np.int64)
        lut = packed["lut"].reshape(packed["lut"].shape[0], -1).astype(np.float32)
        return np.take_along_axis(np.repeat(lut, idx.shape[0] // lut.shape[0], axis=0), idx, axis=1)
    q = packed["data"][:, :, 0, 0].astype(np.float32)
    block = q.shape[1] // packed["scale"].shape[1]
    scale = np.repeat(packed["scale"][:, :, 0, 0].astype(np.float32), block, axis=1)
    if "offset" in packed:
        return scale * (q - np.repeat(packed["offset"][:, :, 0, 0].astype(np.float32), block, axis=1))
    return scale * q


def emit_weight(mb, types, packed: dict[str, np.ndarray], name: str):
    """The constexpr op that rebuilds an fp16 (O, I, 1, 1) conv kernel from `packed`."""
    if "lut" in packed:
        idx = packed["indices"].astype(types.np_uint4_dtype)
        return mb.constexpr_lut_to_dense(indices=idx, lut=packed["lut"], name=name)
    data = packed["data"]
    if "offset" in packed:  # int4 asymmetric: unsigned 4-bit codes with an fp16 offset
        return mb.constexpr_blockwise_shift_scale(
            data=data.astype(types.np_uint4_dtype),
            scale=packed["scale"],
            offset=packed["offset"],
            name=name,
        )
    return mb.constexpr_blockwise_shift_scale(data=data, scale=packed["scale"], name=name)
