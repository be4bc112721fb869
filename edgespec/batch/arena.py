"""One K/V buffer per layer shared by the batch's sequences, a row per sequence.

A batched pass over sequences with their own caches has to gather every row's
keys and values into one padded (B, Hk, S_max, D) block per layer, and write each
row's new entries back one row at a time: on a CPU that is thousands of small
operations and copies per pass, about a third of an 8-row decode step (see
docs/batching.md). Rows of one arena need neither: the pass writes every row's
new K/V with one scatter per layer, at each row's own offset, and attention reads
the rows where they lie.

Each sequence still sees caches of its own (`SlotCache`, one per layer, the
KVCache interface: offset, update_and_fetch, trim, keep, reserve), so every
decoding mode runs unchanged, alone or in a pass; the arena only decides where
the entries live. A sequence's entries move into its row when it first shares a
pass: until then (alone, or a new request's prompt) they stay in a KVCache of its
own, so its passes never wait on the arena's pending writes. Rows are added as the batcher
asks (one per short request live), positions in steps of `step`; a
sequence's row is free again when it ends, and the arena goes with the batch
when the batch empties.

MLX arrays are values: writing into a buffer is in place only while nothing else
holds the old buffer. Rows' reads are therefore never kept between calls, and
`keep` (a tree commit) evaluates what it gathers before writing it back.
"""

from __future__ import annotations

import mlx.core as mx

from edgespec.caches.kv import KVCache, LayerCache, export_kv


class KVArena:
    step = 256  # positions are added in steps of this many

    def __init__(self):
        self.keys: dict[int, mx.array] = {}  # layer -> (rows, Hk, positions, D)
        self.values: dict[int, mx.array] = {}
        self.rows = 0
        self.positions = 0
        self._free: list[int] = []
        self.allocations = 0  # buffer (re)allocations so far, each a copy of what is held

    # ------------------------------------------------------------ rows and room
    def acquire(self, rows: int = 0) -> int:
        """A free row; when none is left the arena grows to `rows` rows (at least one more:
        the batcher passes how many its memory accounting allows for)."""
        if not self._free:
            self._grow_rows(max(1, rows - self.rows))
        self._free.sort()
        return self._free.pop(0)

    def release(self, row: int) -> None:
        self._free.append(row)

    def free_rows(self) -> list[int]:
        return sorted(self._free)

    def move(self, src: int, dst: int, copy: bool = True) -> None:
        """Row `src`'s entries (with `copy`) into the free row `dst`; `src` is free after. The
        batcher moves its highest row down into one a finished sequence left, so the rows in use
        stay one slice: a pass over rows with gaps has to copy them together every layer."""
        self._free.remove(dst)
        self._free.append(src)
        if not copy:
            return
        idx = mx.array([src], dtype=mx.int32)
        moved = [(d, layer, mx.take(d[layer], idx, axis=0)) for d in (self.keys, self.values) for layer in d]
        mx.eval([m for _, _, m in moved])  # nothing may hold the old buffers when they are written
        for d, layer, m in moved:
            d[layer][dst : dst + 1] = m

    @property
    def used(self) -> int:
        return self.rows - len(self._free)

    def _grow_rows(self, n: int) -> None:
        for d in (self.keys, self.values):
            for layer, a in d.items():
                d[layer] = mx.concatenate([a, mx.zeros((n, *a.shape[1:]), a.dtype)], axis=0)
        if self.keys:
            self.allocations += 1
        self._free.extend(range(self.rows, self.rows + n))
        self.rows += n

    def ensure(self, positions: int) -> None:
        """Room for `positions` entries in every row."""
        if positions <= self.positions:
            return
        new = -(-positions // self.step) * self.step
        for d in (self.keys, self.values):
            for layer, a in d.items():
                R, H, S, D = a.shape
                d[layer] = mx.concatenate([a, mx.zeros((R, H, new - S, D), a.dtype)], axis=2)
        if self.keys:
            self.allocations += 1
        self.positions = new

    def _layer(self, layer: int, k: mx.array, v: mx.array) -> None:
        if layer not in self.keys:
            H, D, Dv = k.shape[1], k.shape[3], v.shape[3]
            self.keys[layer] = mx.zeros((self.rows, H, self.positions, D), k.dtype)
            self.values[layer] = mx.zeros((self.rows, H, self.positions, Dv), v.dtype)

    # ------------------------------------------------------------ one row
    def write_row(self, layer: int, row: int, start: int, k: mx.array, v: mx.array) -> None:
        """k, v (1, Hk, T, D) at positions start.. of `row`."""
        self._layer(layer, k, v)
        T = k.shape[2]
        self.keys[layer][row : row + 1, :, start : start + T, :] = k
        self.values[layer][row : row + 1, :, start : start + T, :] = v

    def read_row(self, layer: int, row: int, n: int) -> tuple[mx.array, mx.array]:
        return self.keys[layer][row : row + 1, :, :n, :], self.values[layer][row : row + 1, :, :n, :]

    def keep(self, layers: list[int], row: int, start: int, indices: list[int]) -> None:
        """Entries start + indices (sorted) of `row` packed at `start`, in every layer given."""
        idx = mx.array([start + i for i in indices], dtype=mx.int32)
        n = len(indices)
        moved = [(d, layer, mx.take(d[layer][row : row + 1], idx, axis=2))
                 for layer in layers if layer in self.keys for d in (self.keys, self.values)]
        mx.eval([m for _, _, m in moved])  # nothing may hold the old buffers when they are written
        for d, layer, m in moved:
            d[layer][row : row + 1, :, start : start + n, :] = m

    # ------------------------------------------------------------ a batched pass
    def write_rows(self, layer: int, rows: mx.array, heads: mx.array, positions: mx.array,
                   k: mx.array, v: mx.array) -> None:
        """k, v (B, Hk, T, D): row b's T entries at positions[b] of arena row rows[b].
        rows (B, 1, 1), heads (1, Hk, 1), positions (B, 1, T): one scatter per buffer."""
        self._layer(layer, k, v)
        self.keys[layer][rows, heads, positions] = k
        self.values[layer][rows, heads, positions] = v

    def read_rows(self, layer: int, rows: list[int], n: int) -> tuple[mx.array, mx.array]:
        """(B, Hk, n, D) keys and values of `rows`, in that order."""
        K, V = self.keys[layer], self.values[layer]
        runs = _runs(rows)
        if len(runs) == 1:
            lo, hi = runs[0]
            return K[lo:hi, :, :n, :], V[lo:hi, :, :n, :]
        if rows == sorted(rows):
            # rows with gaps (a sequence ended between them): contiguous runs copied together,
            # several times faster here than a gather (mx.take) of the same rows
            return (mx.concatenate([K[lo:hi, :, :n, :] for lo, hi in runs], axis=0),
                    mx.concatenate([V[lo:hi, :, :n, :] for lo, hi in runs], axis=0))
        idx = mx.array(rows, dtype=mx.int32)
        return mx.take(K[:, :, :n, :], idx, axis=0), mx.take(V[:, :, :n, :], idx, axis=0)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for d in (self.keys, self.values) for a in d.values())


def _runs(rows: list[int]) -> list[tuple[int, int]]:
    """`rows` as runs of consecutive row numbers, [lo, hi) each, in order."""
    runs = [[rows[0], rows[0] + 1]]
    for r in rows[1:]:
        if r == runs[-1][1]:
            runs[-1][1] += 1
        else:
            runs.append([r, r + 1])
    return [(lo, hi) for lo, hi in runs]


class SlotCache(LayerCache):
    """One layer's cache of one sequence whose entries live in a row of a `KVArena`
    (the KVCache interface).

    It starts detached, on a KVCache of its own, and moves into its row when the
    sequence first shares a pass (`attach`, from edgespec.batch.forward). A sequence
    alone, and a new request's prompt, so never depend on the arena: writing into a
    buffer the others' pending pass writes too would make the prompt wait for that pass
    (time to first token).
    """

    def __init__(self, arena: KVArena, layer: int, row: int):
        self.arena, self.layer, self.row = arena, layer, row
        self.own: KVCache | None = KVCache()
        self.allocations = 0

    @property
    def attached(self) -> bool:
        return self.own is None

    def attach(self) -> None:
        """Move the entries into the arena row (lazily: part of the pass that needs them)."""
        own = self.own
        if own is None:
            return
        self.own = None
        self._offset = own.offset
        if own.keys is not None and own.offset:
            self.arena.ensure(own.offset)
            self.arena.write_row(self.layer, self.row, 0, own.keys[..., : own.offset, :],
                                 own.values[..., : own.offset, :])

    @property
    def offset(self) -> int:
        return self.own.offset if self.own is not None else self._offset

    @offset.setter
    def offset(self, value: int) -> None:
        if self.own is not None:
            self.own.offset = value
        else:
            self._offset = value

    def reserve(self, positions: int) -> None:
        if self.own is not None:
            self.own.reserve(positions)
        else:
            self.arena.ensure(positions)

    def update_and_fetch(self, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array]:
        if self.own is not None:
            return self.own.update_and_fetch(k, v)
        prev, T = self._offset, k.shape[2]
        self.arena.ensure(prev + T)
        self.arena.write_row(self.layer, self.row, prev, k, v)
        self._offset = prev + T
        return self.arena.read_row(self.layer, self.row, self._offset)

    def trim(self, n: int) -> int:
        n = min(max(n, 0), self.offset)
        self.offset -= n
        return n

    def keep(self, start: int, indices: list[int]) -> None:
        keep_slots([self], start, indices)

    @staticmethod
    def keep_many(caches: list[SlotCache], start: int, indices: list[int]) -> None:
        keep_slots(caches, start, indices)

    def _buffer(self, kind: str) -> mx.array | None:
        """Its whole keys or values buffer (capacity positions), as KVCache.keys/values."""
        if self.own is not None:
            return getattr(self.own, kind)
        a = getattr(self.arena, kind).get(self.layer)
        return None if a is None else a[self.row : self.row + 1]

    @property
    def keys(self) -> mx.array | None:
        return self._buffer("keys")

    @property
    def values(self) -> mx.array | None:
        return self._buffer("values")

    span_kind = "positions"

    def export_span(self, start: int, end: int) -> tuple[mx.array, mx.array] | None:
        if self.own is not None:
            return self.own.export_span(start, end)
        st = self.state
        if st is None or not 0 <= start < end <= self._offset:
            return None
        return export_kv(st[0], st[1], start, end)

    def import_span(self, parts: tuple[mx.array, mx.array]) -> None:
        self.update_and_fetch(*parts)

    @property
    def state(self) -> tuple[mx.array, mx.array] | None:
        if self.own is not None:
            return self.own.state
        if self.layer not in self.arena.keys:
            return None
        return self.arena.read_row(self.layer, self.row, self._offset)

    @property
    def nbytes(self) -> int:
        """Its own buffer's size, or its row's share of the arena."""
        if self.own is not None:
            return self.own.nbytes
        a, b = self.arena.keys.get(self.layer), self.arena.values.get(self.layer)
        if a is None:
            return 0
        return (a.nbytes + b.nbytes) // max(self.arena.rows, 1)


def keep_slots(caches: list[SlotCache], start: int, indices: list[int]) -> None:
    """`KVCache.keep` for a sequence's slot caches, all layers at once (one evaluation)."""
    if not caches:
        return
    n = len(indices)
    for c in caches:
        if c.own is not None:
            c.own.keep(start, indices)
    attached = [c for c in caches if c.own is None]
    if attached and list(indices) != list(range(n)):
        by_arena: dict[int, tuple[KVArena, int, list[int]]] = {}
        for c in attached:
            a = by_arena.setdefault(id(c.arena), (c.arena, c.row, []))
            a[2].append(c.layer)
        for arena, row, layers in by_arena.values():
            arena.keep(layers, row, start, indices)
    for c in attached:
        c.offset = start + n
