"""One verifier pass over the pending forward requests of several sequences.

Each sequence keeps its own KV caches (edgespec.caches.kv.KVCache, one per layer), so
every decoding mode's cache operations (trim, keep, commit_kv) stay per sequence.
A batched pass pads the rows to the longest T and, per layer, gathers each row's
cache into one (B, Hk, S_max, D) block:

    row b: T_b new tokens, S_b = cached_b + T_b keys
    inputs    (B, T_max)       ids, padded with 0
    positions (B, T_max)       the row's own RoPE positions (padding: 0)
    mask      (B, 1, T_max, S_max)  the row's own mask (causal, or the tree mask the mode
                               gave) in the top-left (T_b, S_b) corner; padded keys are
                               never attended, a padded query attends key 0 only (no
                               all-False row: its output is thrown away)

A row's new K/V are written into ITS cache only for its T_b real tokens, so a
row's cache after the pass is what it would be after the same call alone.
When every row's caches live in one KVArena (edgespec.batch.arena: the
batcher's sequences), nothing is gathered: one scatter per layer writes the new
K/V at each row's offset and attention reads the arena's rows in place. Rows with
caches of their own (a long request, another cache type) are gathered per layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from edgespec.caches.kv import KVCache, LayerCache


@dataclass
class Row:
    """One sequence's model call: model(inputs, cache, mask=mask, positions=positions)."""

    inputs: mx.array  # (1, T) ids
    cache: list  # the sequence's KVCache per layer
    mask: mx.array | None = None  # None = causal over cache + new; else (T, S) bool (or broadcastable)
    positions: mx.array | None = None  # None = cache offset + arange(T); else (T,)
    return_hidden: bool = False
    last_only: bool = False  # logits of the last position only, (1, 1, V)
    offset: int = field(init=False)  # cached positions before this call

    def __post_init__(self):
        self.offset = self.cache[0].offset if self.cache else 0

    @property
    def T(self) -> int:
        return int(self.inputs.shape[-1])

    @property
    def S(self) -> int:
        return self.offset + self.T


class _GatherCache(LayerCache):
    """Stands in for one layer's cache in a batched pass: writes each row's real new K/V
    into that row's own cache and hands attention the rows padded to S_max."""

    offset = 0  # unused: the batched pass always gives positions
    slot_positions = True  # key slot j of every row holds position j (sliding windows measure from it)

    def __init__(self, caches: list, lengths: list[int], s_max: int):
        self.caches, self.lengths, self.s_max = caches, lengths, s_max

    def update_and_fetch(self, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array]:
        ks, vs = [], []
        for b, (c, t) in enumerate(zip(self.caches, self.lengths, strict=True)):
            kb, vb = c.update_and_fetch(k[b : b + 1, :, :t], v[b : b + 1, :, :t])  # (1, Hk, S_b, D)
            pad = self.s_max - kb.shape[2]
            if pad and type(c) is KVCache and c.keys.shape[2] >= self.s_max:
                # The buffer already holds S_max positions: the ones past this row's S_b
                # are zeros or stale (finite) K/V its mask never attends, so take them as
                # the padding rather than copying the row into a padded array first.
                kb, vb = c.keys[:, :, : self.s_max], c.values[:, :, : self.s_max]
            elif pad:
                kb = mx.pad(kb, [(0, 0), (0, 0), (0, pad), (0, 0)])
                vb = mx.pad(vb, [(0, 0), (0, 0), (0, pad), (0, 0)])
            ks.append(kb)
            vs.append(vb)
        return mx.concatenate(ks, axis=0), mx.concatenate(vs, axis=0)


class _ArenaView(LayerCache):
    """Stands in for one layer's cache in a batched pass whose rows all live in one
    KVArena (edgespec.batch.arena): one scatter writes every row's new K/V at its own
    offset (a padded row's padding lands past its new offset, where nothing reads it),
    and attention reads the rows in place."""

    offset = 0  # unused: the batched pass always gives positions
    slot_positions = True  # key slot j of every row holds position j (sliding windows measure from it)

    def __init__(self, arena, layer: int, rows: list[int], rows_idx: mx.array, write_pos: mx.array, s_max: int):
        self.arena, self.layer, self.rows = arena, layer, rows
        self.rows_idx, self.write_pos, self.s_max = rows_idx, write_pos, s_max

    def update_and_fetch(self, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array]:
        heads = mx.arange(k.shape[1], dtype=mx.int32).reshape(1, -1, 1)
        self.arena.write_rows(self.layer, self.rows_idx, heads, self.write_pos, k, v)
        return self.arena.read_rows(self.layer, self.rows, self.s_max)


def _shared_arena(rows: list[Row]):
    """The KVArena every row's caches live in (layer i in cache i), or None."""
    arena = getattr(rows[0].cache[0], "arena", None) if rows[0].cache else None
    if arena is None:
        return None
    n = len(rows[0].cache)
    for r in rows:
        if len(r.cache) != n or any(getattr(c, "arena", None) is not arena or c.layer != i
                                    for i, c in enumerate(r.cache)):
            return None
    return arena


def _cache_views(rows: list[Row], t_max: int, s_max: int) -> tuple[list, bool]:
    """Per layer, the cache the batched model call writes and reads through; and whether
    they are arena views (the rows' offsets are then advanced by the caller)."""
    arena = _shared_arena(rows)
    n_layers = len(rows[0].cache)
    if arena is None:
        return [_GatherCache([r.cache[i] for r in rows], [r.T for r in rows], s_max) for i in range(n_layers)], False
    for r in rows:
        for c in r.cache:
            c.attach()
    slots = [r.cache[0].row for r in rows]
    arena.ensure(max(r.offset for r in rows) + t_max)
    rows_idx = mx.array(slots, dtype=mx.int32).reshape(-1, 1, 1)
    write_pos = mx.array(np.array([r.offset for r in rows], dtype=np.int32)[:, None] + np.arange(t_max, dtype=np.int32))
    write_pos = write_pos.reshape(len(rows), 1, t_max)
    return [_ArenaView(arena, i, slots, rows_idx, write_pos, s_max) for i in range(n_layers)], True


def _row_mask(row: Row, t_max: int, s_max: int) -> mx.array:
    """(T_max, S_max) bool: the row's own mask in the corner, padding as described above."""
    T, S, off = row.T, row.S, row.offset
    if row.mask is None:
        m = np.zeros((t_max, s_max), dtype=bool)
        m[:T, :S] = np.arange(S)[None, :] <= off + np.arange(T)[:, None]  # causal
        m[T:, 0] = True
        return mx.array(m)
    own = row.mask
    if own.dtype != mx.bool_:
        own = own > -np.inf  # an additive mask: -inf = masked
    own = own.reshape(own.shape[-2], own.shape[-1])
    own = mx.broadcast_to(own, (T, S)) if own.shape != (T, S) else own
    m = mx.pad(own, [(0, t_max - T), (0, s_max - S)], constant_values=False)
    if t_max > T:
        pad_q = np.zeros((t_max, s_max), dtype=bool)
        pad_q[T:, 0] = True
        m = m | mx.array(pad_q)
    return m


def _row_positions(row: Row, t_max: int) -> mx.array:
    if row.positions is None:
        pos = mx.arange(row.offset, row.offset + row.T, dtype=mx.int32)
    else:
        pos = row.positions.reshape(-1).astype(mx.int32)
    if t_max > row.T:
        pos = mx.pad(pos, [(0, t_max - row.T)])
    return pos


def batched_forward(model, rows: list[Row]) -> list:
    """Run `rows` in ONE model pass; returns per row what model(...) would return for it
    alone: logits (1, T_b, V), or (logits, hidden) where the row asked for return_hidden."""
    if len(rows) == 1:  # alone: exactly the sequence's own call (no masks, no padding)
        r = rows[0]
        return [model(r.inputs, r.cache, mask=r.mask, positions=r.positions, return_hidden=r.return_hidden,
                      last_only=r.last_only)]
    if any(c.span_kind == "state" for r in rows for c in r.cache):
        # A recurrent layer's state is one per sequence and padding would run through it:
        # rows with such layers take one pass each (the same calls as alone).
        return [batched_forward(model, [r])[0] for r in rows]
    if _shared_arena(rows) is not None:
        # the rows in arena order, so attention reads them as one slice of the arena (or a few)
        order = sorted(range(len(rows)), key=lambda b: rows[b].cache[0].row)
        if order != list(range(len(rows))):
            out = batched_forward(model, [rows[b] for b in order])
            results = [None] * len(rows)
            for res, b in zip(out, order, strict=True):
                results[b] = res
            return results
    t_max = max(r.T for r in rows)
    s_max = max(r.S for r in rows)
    inputs = mx.concatenate(
        [mx.pad(r.inputs.reshape(1, -1).astype(mx.int32), [(0, 0), (0, t_max - r.T)]) for r in rows], axis=0
    )
    positions = mx.stack([_row_positions(r, t_max) for r in rows])  # (B, T_max)
    mask = mx.stack([_row_mask(r, t_max, s_max) for r in rows])[:, None]  # (B, 1, T_max, S_max)
    views, in_arena = _cache_views(rows, t_max, s_max)
    hidden = any(r.return_hidden for r in rows)
    out = model(inputs, views, mask=mask, positions=positions, return_hidden=hidden)
    if in_arena:
        for r in rows:
            for c in r.cache:
                c.offset += r.T
    logits, h = out if hidden else (out, None)
    results = []
    for b, r in enumerate(rows):
        lg = logits[b : b + 1, r.T - 1 : r.T] if r.last_only else logits[b : b + 1, : r.T]
        results.append((lg, h[b : b + 1, : r.T]) if r.return_hidden else lg)
    return results


def layer_marks(cache: list) -> list:
    """Per layer, the K buffer a pass over `cache` (one row's caches) has just written, or []
    when the caches keep none: evaluating the i-th computes that pass up to layer i, so a long
    pass can be evaluated a few layers at a time (the batcher starts new requests between)."""
    marks = []
    for c in cache:
        own = getattr(c, "own", c)  # a SlotCache's own KVCache (None once in its arena row)
        a = c.arena.keys.get(c.layer) if own is None else getattr(own, "keys", None)
        if not isinstance(a, mx.array):
            return []
        marks.append(a)
    return marks


def group_rows(sizes: list[int], cost) -> list[list[int]]:
    """Split rows into passes so the step costs least: padding a decode row (T=1) to a
    prefill chunk's 128 tokens wastes more than a second pass costs, padding it to a
    tree's 8 tokens does not. `cost(n)` is the measured time of one pass over n tokens.
    Returns groups of row indices (rows sorted by T, contiguous groups; exact DP)."""
    order = sorted(range(len(sizes)), key=lambda i: sizes[i])
    n = len(order)
    best = [0.0] + [float("inf")] * n  # best[j]: cheapest split of the first j sorted rows
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        t_max = sizes[order[j - 1]]
        for i in range(j):
            c = best[i] + cost((j - i) * t_max)
            if c < best[j]:
                best[j], cut[j] = c, i
    groups, j = [], n
    while j > 0:
        groups.append([order[k] for k in range(cut[j], j)])
        j = cut[j]
    return groups[::-1]
