"""GGUF tensor types -> MLX: kept quantized where the mapping is exact, else dequantized.

MLX affine quantization stores, per group of `group_size` consecutive columns, a
scale s and a bias b; an element is w = s * q + b with q an unsigned `bits`-bit
integer, packed LSB-first as one bit stream per row into uint32 words.

Exact mappings (group size 32; every product below has at most 22 significant
bits, so float32 holds it exactly and s*q + b rounds once, as gguf's `d*q - m` does):
    Q4_0  w = d*(q-8)          -> bits 4, s = d,        b = -8d
    Q4_1  w = d*q + m          -> bits 4, s = d,        b = m
    Q5_0  w = d*(q-16)         -> bits 5, s = d,        b = -16d
    Q5_1  w = d*q + m          -> bits 5, s = d,        b = m
    Q8_0  w = d*q (q signed)   -> bits 8, s = d,        b = -128d, q + 128
    Q4_K  w = d*sc*q - dmin*mn -> bits 4, s = d*sc,     b = -dmin*mn   (8 sub-blocks of 32)
    Q5_K  same with 5-bit q    -> bits 5
Not exact: Q2_K, Q3_K and Q6_K scale sub-blocks of 16 columns, and MLX's smallest
group is 32; they are dequantized (gguf's own dequantizer) and, when the caller
keeps weights quantized, re-quantized with MLX to the nearest bit width (2, 3, 6)
in groups of 32, the relative error measured and reported.
"""

from __future__ import annotations

from typing import Any

import gguf
import mlx.core as mx
import numpy as np

from edgespec.errors import ModelLoadError

GROUP = 32  # the group size of every exact mapping
EXACT_BITS = {"Q4_0": 4, "Q4_1": 4, "Q5_0": 5, "Q5_1": 5, "Q8_0": 8, "Q4_K": 4, "Q5_K": 5}
REQUANT_BITS = {"Q2_K": 2, "Q3_K": 3, "Q6_K": 6}
DENSE = ("F32", "F16", "BF16")
SUPPORTED = tuple(DENSE) + tuple(EXACT_BITS) + tuple(REQUANT_BITS)


def _f16(blocks: np.ndarray, offset: int) -> np.ndarray:
    """The fp16 field at byte `offset` of every block, as float32 (rows, n_blocks)."""
    return blocks[..., offset : offset + 2].copy().view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """(..., n) bytes -> (..., 2n): the n low nibbles, then the n high nibbles (ggml's order)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _bits_of(words: np.ndarray, n: int) -> np.ndarray:
    """(...,) uint32 -> (..., n) bits, bit i of the word at position i."""
    return ((words[..., None] >> np.arange(n, dtype=np.uint32)) & 1).astype(np.uint8)


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 scale bytes -> 8 six-bit scales and 8 six-bit mins per super-block.

    Bytes 0-3 hold scales 0-3 (low 6 bits) and the top 2 bits of scales 4-7; bytes 4-7
    the same for the mins; bytes 8-11 the low 4 bits of scales 4-7 (low nibble) and of
    mins 4-7 (high nibble)."""
    a, b, c = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = np.concatenate([a & 63, (c & 15) | ((a >> 6) << 4)], axis=-1)
    mn = np.concatenate([b & 63, (c >> 4) | ((b >> 6) << 4)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _blocks(raw: np.ndarray, type_name: str) -> np.ndarray:
    """A tensor's raw bytes (rows, row_bytes) -> (rows, n_blocks, block_bytes)."""
    _, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]]
    raw = np.asarray(raw).view(np.uint8)
    return raw.reshape(raw.shape[0], -1, block_bytes)


def affine(type_name: str, raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Exact MLX form of an EXACT_BITS tensor: (q uint8 (rows, cols), scales, biases (rows, cols/32))."""
    b = _blocks(raw, type_name)
    rows, nb = b.shape[:2]
    if type_name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"):  # blocks of 32: one group each
        d = _f16(b, 0)
        if type_name == "Q8_0":
            q = b[..., 2:].view(np.int8).astype(np.int16) + 128
            bias = -128.0 * d
        elif type_name == "Q4_0":
            q, bias = _nibbles(b[..., 2:]), -8.0 * d
        elif type_name == "Q4_1":
            q, bias = _nibbles(b[..., 4:]), _f16(b, 2)
        else:  # Q5_0 / Q5_1: 4 bytes of high bits (bit i = element i), then 16 bytes of nibbles
            lo = 4 if type_name == "Q5_1" else 2
            high = _bits_of(b[..., lo : lo + 4].copy().view(np.uint32)[..., 0], 32)
            q = _nibbles(b[..., lo + 4 :]) | (high << 4)
            bias = _f16(b, 2) if type_name == "Q5_1" else -16.0 * d
        return q.reshape(rows, nb * 32).astype(np.uint8), d, bias
    # Q4_K / Q5_K: super-blocks of 256 = 8 groups of 32 with 6-bit scale and min.
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, mn = _k_scales(b[..., 4:16])
    if type_name == "Q4_K":
        qs = b[..., 16:].reshape(rows, nb, 4, 32)  # 4 chunks of 64 values: low then high nibbles
        q = _nibbles(qs).reshape(rows, nb, 8, 32)
    else:  # Q5_K: 32 bytes of high bits (group j uses bit j of byte l), then 128 of nibbles
        qh = b[..., 16:48]
        qs = b[..., 48:].reshape(rows, nb, 4, 32)
        high = ((qh[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1)  # (rows, nb, 8, 32)
        q = _nibbles(qs).reshape(rows, nb, 8, 32) | (high << 4)
    scales = (d[..., None] * sc).reshape(rows, nb * 8)
    biases = -(dmin[..., None] * mn).reshape(rows, nb * 8)
    return q.reshape(rows, nb * 256).astype(np.uint8), scales, biases


def pack(q: np.ndarray, bits: int) -> np.ndarray:
    """q (rows, cols) with values < 2**bits -> MLX's packing: uint32 (rows, cols * bits / 32).

    MLX reads each row as one little-endian bit stream, element i at bits [i*bits, (i+1)*bits).
    Every 8 elements fill exactly `bits` bytes, so they are summed into one uint64 and its
    low `bits` bytes kept."""
    rows, cols = q.shape
    if bits == 8:
        return np.ascontiguousarray(q.astype(np.uint8)).view(np.uint32)
    if bits == 4:
        return np.ascontiguousarray((q[:, 0::2] | (q[:, 1::2] << 4)).astype(np.uint8)).view(np.uint32)
    eights = q.reshape(rows, cols // 8, 8).astype(np.uint64)
    word = np.zeros((rows, cols // 8), np.uint64)
    for i in range(8):
        word |= eights[..., i] << np.uint64(i * bits)
    packed = word.view(np.uint8).reshape(rows, cols // 8, 8)[..., :bits]  # little-endian host
    return np.ascontiguousarray(packed).reshape(rows, cols * bits // 8).view(np.uint32)


def native(type_name: str, raw: np.ndarray) -> tuple[dict[str, np.ndarray], int] | None:
    """{"weight": packed, "scales", "biases"} and bits for an exactly-mapped type, else None."""
    bits = EXACT_BITS.get(type_name)
    if bits is None:
        return None
    q, scales, biases = affine(type_name, raw)
    return {"weight": pack(q, bits), "scales": scales, "biases": biases}, bits


def dequantize(type_name: str, raw: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """float32 weights of shape `shape` (rows first, as in the HF checkpoint)."""
    if type_name not in SUPPORTED:
        raise ModelLoadError(f"GGUF tensor type {type_name} is not supported (supported: {', '.join(SUPPORTED)})")
    if type_name in ("F32", "F16"):
        return np.asarray(raw).astype(np.float32).reshape(shape)
    if type_name in EXACT_BITS:
        # s*q + b over the exact form: s*q is exact in float32, so one rounding, as gguf's
        # d*q - m; equal to gguf's dequantizer (tests/test_gguf_formats.py) and faster.
        q, scales, biases = affine(type_name, raw)
        rows = q.shape[0]
        w = q.reshape(rows, -1, GROUP).astype(np.float32) * scales[..., None] + biases[..., None]
        return w.reshape(shape)
    out = gguf.quants.dequantize(np.asarray(raw), gguf.GGMLQuantizationType[type_name])
    return np.asarray(out, dtype=np.float32).reshape(shape)


def requantize(w: np.ndarray, bits: int) -> tuple[dict[str, np.ndarray], float]:
    """MLX affine quantization of dense `w` (groups of 32) and its relative error ||w' - w|| / ||w||."""
    wm = mx.array(w)
    packed, scales, biases = mx.quantize(wm, group_size=GROUP, bits=bits)
    back = mx.dequantize(packed, scales, biases, group_size=GROUP, bits=bits)
    err = float(mx.linalg.norm((back - wm).flatten()) / max(float(mx.linalg.norm(wm.flatten())), 1e-30))
    parts = {"weight": np.array(packed), "scales": np.array(scales), "biases": np.array(biases)}
    return parts, err


def summary_entry(report: dict[str, Any], type_name: str, how: str, bits: int | None, err: float | None) -> None:
    """Accumulate per GGUF type: how it was read (exact | requantized | dense), count, max error."""
    e = report.setdefault(type_name, {"how": how, "tensors": 0})
    e["tensors"] += 1
    if bits is not None:
        e["bits"], e["group_size"] = bits, GROUP
    if err is not None:
        e["max_rel_error"] = max(e.get("max_rel_error", 0.0), err)
