"""One live sequence of the batch: its state between steps (`_Seq`: greenlet, pending row, arena
rows, prefix reuse) and the verifier as it sees it (`SeqModel`: a model call becomes a row of
the batch's next joint pass, edgespec.batch.batcher)."""

from __future__ import annotations

import itertools
import time
from typing import Any

import mlx.core as mx
from greenlet import greenlet

from edgespec.batch.forward import Row
from edgespec.batch.request import Request
from edgespec.caches.prefix import Reuse

PREFILL_CHUNK = 128  # prompt tokens per step while other sequences decode
_KEYS = itertools.count()


class SeqModel:
    """The verifier as one sequence sees it: calls become rows of the batch's next pass.

    Everything but the call (args, make_cache, layers, head, ...) is the model's own.
    Calls that cannot join a batch (no cache, a layer subset, several rows) run at once.
    """

    def __init__(self, model, batcher, seq: _Seq | None = None):
        """batcher: the Batcher (edgespec.batch.batcher) whose passes the calls join."""
        self._model = model
        self._batcher = batcher
        self._seq = seq
        self.blocked_s = 0.0  # seconds its calls spent waiting for batched passes

    def __getattr__(self, name):
        return getattr(self._model, name)

    def batch_context(self):
        """None while this sequence runs alone; else (the other rows as `cost.Peer`s, StepCost,
        this row's tie-break key) for pricing speculation against the whole batch
        (edgespec.batch.cost)."""
        return self._batcher.batch_context(self._seq)

    def make_cache(self):
        """The model's caches; for a batched sequence, rows of the batch's KV arena when the
        model's caches are plain KVCaches and the request is short enough (see Batcher)."""
        caches = self._batcher.engine.make_cache(self._model)
        if self._seq is None:
            return caches
        return self._batcher.arena_caches(self._seq, caches)

    def prefix_reuse(self, cache):
        """This request's use of the engine's prefix cache for the verifier's `cache`
        (edgespec.generate.prefill restores and stores through it), or None."""
        store = self._batcher.engine.prefix_cache
        if self._seq is None or store is None or not store.enabled or len(cache) != len(self._model.layers):
            return None

        self._seq.reuse = Reuse(store, self._seq.req.stats)
        return self._seq.reuse

    def speculation_allowed(self) -> bool:
        """Whether this step's regime lets an adaptive row speculate at all (the batch's
        measured guard, edgespec.batch.guard); True alone."""
        return self._seq is None or self._batcher.speculation_allowed()

    def publish_gains(self, gains, extra_s: float = 0.0) -> None:
        """This row's gain curve and the host seconds a tree round costs it beyond a plain
        step, for the other rows' joint choice (cost.joint_sizes)."""
        if self._seq is not None:
            self._seq.gains, self._seq.extra_s = gains, extra_s

    def __call__(self, inputs, cache=None, mask=None, positions=None, layer_ids=None, return_hidden=False,
                 last_only=False):
        if cache is None or layer_ids is not None or inputs.ndim != 2 or inputs.shape[0] != 1 \
                or isinstance(mask, str):
            return self._model(inputs, cache, mask=mask, positions=positions, layer_ids=layer_ids,
                               return_hidden=return_hidden, last_only=last_only)
        T = inputs.shape[1]
        b = self._batcher
        if mask is None and positions is None and T > PREFILL_CHUNK and b.others_live():
            # A long causal call (a prompt) in chunks, so the others keep decoding meanwhile.
            outs = []
            for s in range(0, T, PREFILL_CHUNK):
                outs.append(b.forward(Row(inputs[:, s : s + PREFILL_CHUNK], cache, return_hidden=return_hidden,
                                          last_only=last_only)))
            logits = [o[0] if return_hidden else o for o in outs]
            logits = logits[-1] if last_only else mx.concatenate(logits, axis=1)
            if return_hidden:
                return logits, mx.concatenate([o[1] for o in outs], axis=1)
            return logits
        t0 = time.perf_counter()
        out = b.forward(Row(inputs, cache, mask, positions, return_hidden, last_only))
        self.blocked_s += time.perf_counter() - t0
        return out


class _Seq:
    def __init__(self, req: Request, glet: greenlet):
        self.req, self.glet = req, glet
        self.value: Any = None  # what the next resume sends: the last request's result
        self.row: Row | None = None
        self.started = False
        self.on_reader = False  # paused after a chunk until its reader takes it
        self.size = 1  # tokens of its latest model call (what it adds to a step)
        self.emitted = False  # has streamed a chunk (its prompt is done)
        self.gains = None  # its latest gain curve (adaptive decoding), see cost.joint_sizes
        self.extra_s = 0.0  # host seconds its tree round costs beyond a plain step
        self.key = next(_KEYS)  # admission order: the tie-break of the joint choice
        self.arena_rows: dict[int, list] = {}  # rows of the batch's KV arena it holds -> its SlotCaches
        self.reuse = None  # its prefix-cache use (edgespec.caches.prefix.Reuse), once its prompt ran
        self.drafter_reuse = None  # its drafter's (edgespec.drafters.base.DrafterReuse)
