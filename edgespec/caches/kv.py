"""KV cache with cheap rollback.

Keys and values live in a preallocated buffer that grows in steps of `step`
positions; `offset` is the number of valid positions. Rolling back (`trim`) is
just lowering `offset`: the stale entries are overwritten by the next write, so
rejecting draft tokens costs nothing.

The per-layer state protocol every cache kind implements (decoders and the prefix
cache, edgespec.caches.prefix, call only this):

- `offset`: positions held; `trim(n)` drops the last n; `keep(start, indices)` keeps a
  tree/lookahead step's accepted branch;
- `export_span(start, end)`: what a fresh cache needs to hold positions [start, end)
  after [0, start), as new arrays (never views of a buffer that is written later), or
  None where the layer cannot give that span now;
- `import_span(parts)`: append what `export_span` gave, at `offset`.

`span_kind` says what an exported span is: "positions" (attention: one entry per
position, any span can be exported) or "state" (recurrent/convolution layers: the state
after `end`, exportable only while `end == offset`; import replaces the state).

Speculation adds (edgespec.caches.recurrent implements them for "state" layers):

- `trim(n)` and `keep(start, indices)` on a "state" cache restore exactly the state plain
  decoding has after the kept positions (recomputed from a checkpoint), for rollbacks
  within the current decoding round (positions written since the last trim/keep, or the
  last LOG_LIMIT positions); an older rollback raises ValueError naming the limit;
- a pass whose mask is a tree (tree, lookahead and adaptive verification) runs each
  node of a "state" layer from its parent's state; the next pass must follow a `keep`;
- `arrays()`: the arrays whose evaluation computes the cache's latest pass (a prompt
  written in chunks evaluates them between chunks; `cache_arrays` gathers them).
"""

from __future__ import annotations

import mlx.core as mx


class LayerCache:
    """The per-layer cache protocol (the module docstring): what every cache kind declares,
    with the defaults of a kind that declares nothing. Callers read these; they never probe.

    span_kind: "positions" or "state" (see above); None: the kind cannot export spans (the
        prefix cache and saved sessions skip a model with such a layer).
    span_form: what else an exported span depends on (kv_quant's bits and groups), or None.
    forwards_ops: trim/keep are replayed elsewhere (a distributed verifier's mirror), so a
        tree commit calls keep() rather than writing keys in place.
    slot_positions: a batched pass's view: key slot j of every row holds position j.
    keeps_hidden: also keeps the final-norm hidden state per position (`hidden_at`).
    keep_many: a kind whose layers commit a tree step together (the batch arena's rows):
        keep_many(caches, start, indices); None: each layer keeps its own.
    keys: the layer's key buffer where it has one (None otherwise).
    """

    span_kind: str | None = None
    span_form: str | None = None
    forwards_ops = False
    slot_positions = False
    keeps_hidden = False
    keep_many = None
    keys = None
    offset = 0

    def reserve(self, positions: int) -> None:
        """Room for `positions` in one allocation, where the kind grows a buffer (else nothing)."""

    def arrays(self) -> list[mx.array]:
        """The arrays whose evaluation computes the layer's latest pass."""
        return [] if self.keys is None else [self.keys]


class KVCache(LayerCache):
    step = 256

    def __init__(self):
        self.keys: mx.array | None = None  # (B, Hk, capacity, D)
        self.values: mx.array | None = None
        self.offset = 0
        self._want = 0  # capacity to allocate at the next growth (see reserve)
        self.allocations = 0  # buffer (re)allocations so far, each a copy of what is cached

    def reserve(self, positions: int) -> None:
        """Make the next growth allocate room for `positions` in one go.

        A prompt written chunk by chunk would otherwise regrow (copy) the whole cache
        at every chunk: O(n^2 / chunk) bytes moved for an n-token prompt.
        """
        self._want = max(self._want, positions)

    def update_and_fetch(self, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array]:
        """Append k, v (B, Hk, T, D) at `offset`; return all valid (B, Hk, offset+T, D)."""
        prev, T = self.offset, k.shape[2]
        if self.keys is None or prev + T > self.keys.shape[2]:
            B, Hk, _, D = k.shape
            need = max(T, self._want - prev)
            n_steps = (need + self.step - 1) // self.step
            self.allocations += 1
            grow_k = mx.zeros((B, Hk, n_steps * self.step, D), k.dtype)
            grow_v = mx.zeros((B, Hk, n_steps * self.step, v.shape[3]), v.dtype)
            if self.keys is not None:
                self.keys = mx.concatenate([self.keys[..., :prev, :], grow_k], axis=2)
                self.values = mx.concatenate([self.values[..., :prev, :], grow_v], axis=2)
            else:
                self.keys, self.values = grow_k, grow_v
        self.offset += T
        self.keys[..., prev : self.offset, :] = k
        self.values[..., prev : self.offset, :] = v
        return self.keys[..., : self.offset, :], self.values[..., : self.offset, :]

    def trim(self, n: int) -> int:
        """Drop the last `n` positions; returns how many were dropped."""
        n = min(max(n, 0), self.offset)
        self.offset -= n
        return n

    def keep(self, start: int, indices: list[int]) -> None:
        """Keep only positions `start + indices` (sorted) of the last write, packed at `start`.

        Used after a tree/lookahead step: the accepted branch's entries move
        into place and everything after them is dropped.
        """
        if self.keys is None:
            return
        if list(indices) != list(range(len(indices))):
            idx = mx.array([start + i for i in indices], dtype=mx.int32)
            n = len(indices)
            self.keys[..., start : start + n, :] = mx.take(self.keys, idx, axis=2)
            self.values[..., start : start + n, :] = mx.take(self.values, idx, axis=2)
        self.offset = start + len(indices)

    span_kind = "positions"

    def arrays(self) -> list[mx.array]:
        return [] if self.keys is None else [self.keys]

    def export_span(self, start: int, end: int) -> tuple[mx.array, mx.array] | None:
        """Keys and values of positions [start, end), copied out of the buffer."""
        if self.keys is None or not 0 <= start < end <= self.offset:
            return None
        return export_kv(self.keys, self.values, start, end)

    def import_span(self, parts: tuple[mx.array, mx.array]) -> None:
        self.update_and_fetch(*parts)

    @property
    def state(self) -> tuple[mx.array, mx.array] | None:
        if self.keys is None:
            return None
        return self.keys[..., : self.offset, :], self.values[..., : self.offset, :]

    @property
    def nbytes(self) -> int:
        if self.keys is None:
            return 0
        return self.keys.nbytes + self.values.nbytes


def export_kv(keys: mx.array, values: mx.array, start: int, end: int) -> tuple[mx.array, mx.array]:
    """Positions [start, end) of (B, Hk, capacity, D) buffers as arrays of their own: a copy,
    so the buffer stays the only holder of its memory and is still written in place."""
    k = mx.contiguous(keys[..., start:end, :]) + 0
    v = mx.contiguous(values[..., start:end, :]) + 0
    mx.eval(k, v)
    return k, v


def cache_arrays(caches) -> list[mx.array]:
    """What to evaluate so a pass over `caches` is computed (see `arrays` above)."""
    out = []
    for c in caches:
        out.extend(c.arrays())
    return out


def trim_caches(caches: list[KVCache], n: int) -> None:
    for c in caches:
        c.trim(n)


def cache_offset(caches: list[KVCache]) -> int:
    return caches[0].offset if caches else 0


class HiddenKVCache(KVCache):
    """A KVCache that also keeps one row of hidden states per position, trimmed, kept and
    exported with its keys: what a drafter reading the verifier's states finds there (Gemma 4's
    assistant and Qwen3.5's MTP head: final-norm states; a DFlash drafter: its target layers'
    outputs, models.base.Model.record_hidden)."""

    keeps_hidden = True

    def __init__(self):
        super().__init__()
        self.hidden: mx.array | None = None  # (B, capacity, E)

    def put_hidden(self, h: mx.array) -> None:
        """h (B, T, E): the rows of the last T positions written."""
        end = self.offset
        start = end - h.shape[1]
        if self.hidden is None or end > self.hidden.shape[1]:
            cap = max(end, self.keys.shape[2] if self.keys is not None else end)
            grown = mx.zeros((h.shape[0], cap, h.shape[2]), h.dtype)
            if self.hidden is not None and start > 0:
                grown[:, :start] = self.hidden[:, :start]
            self.hidden = grown
        self.hidden[:, start:end] = h

    def hidden_at(self, i: int) -> mx.array | None:
        """(B, 1, E) row of position i, or None when not held."""
        if self.hidden is None or not 0 <= i < min(self.offset, self.hidden.shape[1]):
            return None
        return self.hidden[:, i : i + 1]

    def keep(self, start: int, indices) -> None:
        if self.hidden is not None and list(indices) != list(range(len(indices))):
            idx = mx.array([start + i for i in indices], dtype=mx.int32)
            self.hidden[:, start : start + len(indices)] = mx.take(self.hidden, idx, axis=1)
        super().keep(start, indices)

    def export_span(self, start: int, end: int):
        kv = super().export_span(start, end)
        if kv is None or self.hidden is None or end > self.hidden.shape[1]:
            return kv
        return (*kv, mx.contiguous(self.hidden[:, start:end]) + 0)

    def import_span(self, parts) -> None:
        super().import_span(parts[:2])
        if len(parts) > 2:
            self.put_hidden(parts[2])


def kv_bytes(args, context: int, itemsize: int = 4) -> int:
    """K and V of every layer for `context` positions: 2 * L * Hk * D * context * itemsize."""
    return (
        2 * args.num_hidden_layers * args.num_key_value_heads * args.head_dim * context * itemsize
    )
