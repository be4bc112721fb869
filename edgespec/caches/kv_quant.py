"""A quantized KV cache (opt-in: `--kv-bits 8|4`), for long conversations on laptops short of memory.

Each position's keys and values are stored quantized along the head dimension in groups of
`group_size` (MLX's affine `mx.quantize`: codes plus a scale and a bias per group), so a
position's stored form depends on that position's K/V alone, never on how the positions
were written (a prompt chunk, a verified draft, one token). That is what keeps speculation
exact under a quantized cache: every mode sees exactly the keys and values plain decoding
under the same settings sees. Attention reads them dequantized (`mx.dequantize`), layer by
layer, so the full-precision copy lives only while its layer runs.

Positions before `start` (`--quantized-kv-start`) are kept in full precision: a fixed
position, not a moment, so the split is the same for every mode.

It changes the output (keys and values lose precision), so it is never on by default;
docs/prefix_cache.md measures what it costs.
"""

from __future__ import annotations

import mlx.core as mx

from edgespec.caches.kv import KVCache, LayerCache

BITS = (4, 8)


def check_settings(bits, group_size, start, head_dim: int | None = None) -> None:
    if bits is None:
        if start not in (0, None):  # a setting that would do nothing: say so rather than ignore it
            raise ValueError(f"quantized_kv_start ({start!r}) applies only to a quantized KV cache: give kv_bits "
                             "(--kv-bits 8 or 4) too, or leave it out")
        return
    if bits not in BITS:
        raise ValueError(f"kv_bits must be one of {BITS} (or None for full precision), got {bits!r}")
    if group_size not in (32, 64, 128):
        raise ValueError(f"kv_group_size must be 32, 64 or 128, got {group_size!r}")
    if isinstance(start, bool) or not isinstance(start, int) or start < 0:
        raise ValueError(f"quantized_kv_start must be a whole number of positions >= 0, got {start!r}")
    if head_dim is not None and head_dim % group_size:
        fits = [g for g in (32, 64, 128) if head_dim % g == 0]
        raise ValueError(f"kv_group_size {group_size} does not divide this model's head size {head_dim}"
                         + (f": use {' or '.join(map(str, fits))}" if fits else
                            "; its KV cache cannot be quantized (head size under 32)"))


class QuantizedKVCache(LayerCache):
    """One layer's K/V: full precision before `start`, quantized from there (the KVCache
    interface and the state protocol of edgespec.caches.kv)."""

    span_kind = "positions"
    step = 256

    def __init__(self, bits: int, group_size: int = 64, start: int = 0):
        self.bits, self.group_size, self.start = bits, group_size, start
        self.span_form = f"q{bits}/{group_size}/{start}"
        self.full = KVCache()  # positions < start
        self.q: list[mx.array] | None = None  # k codes, k scales, k biases, v codes, v scales, v biases
        self.q_offset = 0  # positions held quantized
        self._last: tuple[int, mx.array, mx.array] | None = None  # the last write, in full precision
        self.allocations = 0

    # ------------------------------------------------------------------ positions
    @property
    def offset(self) -> int:
        return self.full.offset + self.q_offset

    @offset.setter
    def offset(self, value: int) -> None:
        self.trim(self.offset - value)

    def reserve(self, positions: int) -> None:
        self.full.reserve(min(positions, self.start))

    def _quantize(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        check_settings(self.bits, self.group_size, self.start, x.shape[-1])
        return mx.quantize(x, group_size=self.group_size, bits=self.bits)

    def _write_q(self, parts: tuple[mx.array, ...]) -> None:
        T = parts[0].shape[2]
        prev = self.q_offset
        if self.q is None or prev + T > self.q[0].shape[2]:
            n = -(-(prev + T) // self.step) * self.step
            self.allocations += 1
            grown = []
            for i, p in enumerate(parts):
                buf = mx.zeros((*p.shape[:2], n, p.shape[3]), p.dtype)
                if self.q is not None and prev:
                    buf[..., :prev, :] = self.q[i][..., :prev, :]
                grown.append(buf)
            self.q = grown
        for buf, p in zip(self.q, parts, strict=True):
            buf[..., prev : prev + T, :] = p
        self.q_offset = prev + T

    def _dequantized(self, dtype) -> tuple[mx.array, mx.array] | None:
        if not self.q_offset:
            return None
        n = self.q_offset
        kq, ks, kb, vq, vs, vb = (a[..., :n, :] for a in self.q)
        k = mx.dequantize(kq, ks, kb, group_size=self.group_size, bits=self.bits).astype(dtype)
        v = mx.dequantize(vq, vs, vb, group_size=self.group_size, bits=self.bits).astype(dtype)
        return k, v

    def update_and_fetch(self, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array]:
        """Append k, v (B, Hk, T, D) at `offset`; return every position's K/V (dequantized)."""
        prev, T = self.offset, k.shape[2]
        self._last = (prev, k, v)
        n_full = max(0, min(T, self.start - prev))
        if n_full:
            self.full.update_and_fetch(k[..., :n_full, :], v[..., :n_full, :])
        if T > n_full:
            self._write_q((*self._quantize(k[..., n_full:, :]), *self._quantize(v[..., n_full:, :])))
        return self._fetch(k.dtype)

    def _fetch(self, dtype) -> tuple[mx.array, mx.array]:
        full = self.full.state
        deq = self._dequantized(dtype)
        if full is None:
            return deq
        if deq is None:
            return full
        return mx.concatenate([full[0], deq[0]], axis=2), mx.concatenate([full[1], deq[1]], axis=2)

    def trim(self, n: int) -> int:
        n = min(max(n, 0), self.offset)
        from_q = min(n, self.q_offset)
        self.q_offset -= from_q
        self.full.trim(n - from_q)
        return n

    def keep(self, start: int, indices: list[int]) -> None:
        """A tree/lookahead step's accepted entries, packed at `start`: written again from the
        step's full-precision K/V, so each lands exactly as if written there directly."""
        if list(indices) == list(range(len(indices))):
            self.trim(self.offset - (start + len(indices)))
            return
        if self._last is None or not self._last[0] <= start <= self._last[0] + self._last[1].shape[2]:
            raise RuntimeError("QuantizedKVCache.keep: the kept entries are not from the last write")
        at, k, v = self._last
        idx = mx.array([start - at + i for i in indices], dtype=mx.int32)
        self.trim(self.offset - start)
        self.update_and_fetch(mx.take(k, idx, axis=2), mx.take(v, idx, axis=2))

    def arrays(self) -> list[mx.array]:
        """What to evaluate so the latest pass is computed (edgespec.caches.kv.cache_arrays)."""
        return self.full.arrays() + ([self.q[0], self.q[3]] if self.q is not None else [])

    # ------------------------------------------------------------------ the state protocol
    def export_span(self, start: int, end: int) -> tuple[mx.array, ...] | None:
        """Full-precision (k, v) for spans before `start`, the six quantized arrays after it;
        None for a span across it."""
        if not 0 <= start < end <= self.offset:
            return None
        if end <= self.start:
            return self.full.export_span(start, end)
        if start < self.start:
            return None
        a, b = start - self.start, end - self.start
        parts = tuple(mx.contiguous(q[..., a:b, :]) + 0 for q in self.q)
        mx.eval(parts)
        return parts

    def import_span(self, parts: tuple[mx.array, ...]) -> None:
        if len(parts) == 2:
            if self.offset + parts[0].shape[2] > self.start:
                raise ValueError("full-precision positions past quantized_kv_start")
            self.full.import_span(parts)
        else:
            if self.offset < self.start:
                raise ValueError("quantized positions before quantized_kv_start")
            self._write_q(tuple(parts))
        self._last = None

    @property
    def state(self) -> tuple[mx.array, mx.array] | None:
        if not self.offset:
            return None
        return self._fetch(self.full.keys.dtype if self.full.keys is not None else mx.float32)

    @property
    def nbytes(self) -> int:
        return self.full.nbytes + (sum(a.nbytes for a in self.q) if self.q is not None else 0)


def quantize_caches(caches: list, bits: int | None, group_size: int = 64, start: int = 0) -> list:
    """Each plain KVCache of `caches` as a QuantizedKVCache (other cache kinds as they are)."""
    if bits is None:
        return caches
    return [QuantizedKVCache(bits, group_size, start) if type(c) is KVCache and not c.offset else c
            for c in caches]
