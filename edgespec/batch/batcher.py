"""Continuous batching: every live generation advances in the same verifier passes.

One worker thread owns all generation (MLX streams are per thread). Each live
sequence runs its decoding mode unchanged inside its own greenlet, with a
`SeqModel` standing in for the verifier: a model call hands a forward request
(`Row`) to the worker and is resumed with its logits. Each step the worker

1. admits waiting requests (FIFO) while the batch has room (`max_batch`) and the
   KV budget holds their reserve (edgespec.batch.memory);
2. resumes every live sequence with the result of its last request (or, when its
   client left, with `Cancelled`), which runs that sequence's Python (sampling,
   acceptance, streaming text out) up to its next model call;
3. runs the gathered requests in one pass (or a few, `group_rows`: rows padded to
   their longest T; a long prompt's chunk is not padded onto decode rows).

Each step also has a speculation regime for its adaptive rows, chosen and credited
from measured tokens/s per batch size (edgespec.batch.guard).

Outputs are each request's own: a row of a batched pass sees only its own cache
and mask, and sampling draws with noise keyed by (seed, position)
(`Sampler.sample_at`), so a request's tokens do not depend on its neighbours.
A sequence alone runs its model calls exactly as it would without the batcher.

This module is the batch's mechanics: the worker's step loop, resuming sequences, the joint
passes and the KV arena's rows (about 500 lines: one loop whose parts share the step's state).
Beside it: the policy (policy.py: admission, the speculation regime, pass pricing), a request
(request.py), a live sequence and its view of the verifier (seq.py), and the composition of a
request's model stack (stack.py).
"""

from __future__ import annotations

import atexit
import functools
import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable

import mlx.core as mx
from greenlet import GreenletExit, greenlet

import edgespec.batch.memory as memory
from edgespec.batch.arena import KVArena, SlotCache
from edgespec.batch.forward import Row, batched_forward, group_rows, layer_marks
from edgespec.batch.guard import SpecGuard
from edgespec.batch.policy import BatchPolicy
from edgespec.batch.request import Cancelled, Request
from edgespec.batch.seq import SeqModel, _Seq
from edgespec.batch.stack import compose_request
from edgespec.caches.kv import KVCache
from edgespec.drafters.base import DrafterReuse
from edgespec.errors import EngineError
from edgespec.generate import Chunk, stream_tokens
from edgespec.logits.sampling import Sampler

log = logging.getLogger("edgespec.batch")

IDLE_EXIT_S = 5.0  # an idle worker thread ends after this long
# A pass is evaluated this many layers at a time, so a request arriving meanwhile starts within
# a fraction of a step (time to first token under load).
EVAL_SEGMENT = 6
# ... except a request decoding alone whose pass has at most this many tokens (a plain step, a
# small verification): evaluated at once, as each segment boundary is a synchronisation (3-5%
# of a lone request's tokens/s on the project's CPU, benchmarks/results/batching.md); a request arriving then
# waits for that one short pass. Wider passes (several plain steps long) stay segmented.
ALONE_WHOLE_TOKENS = 16
READER_GRACE_S = 0.005  # how long a step waits for readers to take the tokens just streamed
_BATCHERS: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    for b in list(_BATCHERS):
        b.stop(2.0)


class Batcher(BatchPolicy):
    """Owns the worker thread; `submit` queues a request, the worker streams it out."""

    def __init__(self, engine, max_batch: int | None = None):
        self.engine = engine
        self._free_at_start = memory.free_memory_now() if engine.memory_budget is None else None
        self.max_batch = max_batch if max_batch is not None else memory.default_max_batch(engine, self.budget)
        if self.max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {self.max_batch}")
        self._cv = threading.Condition()
        self._waiting: deque[Request] = deque()
        self._live: list[_Seq] = []
        self._reserved = 0
        self._thread: threading.Thread | None = None
        self._hub: greenlet | None = None
        self.steps = 0  # batched steps run (for tests and benchmarks)
        self.early_starts = 0  # new requests resumed right after their prompt's pass, mid-step
        self.batch_sizes: dict[int, int] = {}  # live sequences per step -> steps
        self.on_idle: Callable[[], None] | None = None
        self._cost: tuple | None = None  # (curve id, StepCost)
        self._arena: KVArena | None = None  # the live sequences' KV rows (edgespec.batch.arena)
        self._last_passes: list[tuple[int, int]] = []  # (rows, T) of the last step's passes
        self._marks: list[list] = []  # per segment, arrays ending it (forward.layer_marks)
        # Speculation in a batch, measured (edgespec.batch.guard): this step's batch size, its
        # regime (None until an adaptive row asks: steps nobody asks about, such as a batch of
        # plain-mode rows, neither run the guard's schedule nor are credited), tokens committed
        # so far in it, and the last step's (regime, batch size, asked, clean) to credit this
        # step's tokens and time to.
        self.guard = SpecGuard()
        self._step_n = 0
        self._regime: str | None = None
        self._asked = False
        self._step_tokens = 0
        self._prev: tuple[str | None, int, bool, bool] | None = None
        self._clean = True  # no prompt's pass in this step
        self._stopping = False
        _BATCHERS.add(self)

    # ------------------------------------------------------------ caller side
    @property
    def budget(self) -> float:
        """What the live sequences' caches may hold (with the prefix cache's: it gives way,
        see _make_room)."""
        return memory.cache_budget(self.engine, self._free_at_start)

    def _start_worker(self) -> None:
        """(lock held)"""
        self._thread = threading.Thread(target=self._work, name="edgespec-batch", daemon=True)
        self._thread.start()

    def wake(self) -> None:
        """A reader took a chunk: a sequence waiting on it may go on."""
        with self._cv:
            self._cv.notify()

    def counts(self) -> tuple[int, int]:
        """(running, waiting) right now."""
        with self._cv:
            return len(self._live), len(self._waiting)

    def close(self, timeout: float = 5.0) -> None:
        """Cancel every waiting and running request and wait (up to `timeout`) until the batch
        is empty; the engine stays usable."""
        with self._cv:
            for r in self._waiting:
                r.cancel()
            for s in self._live:
                s.req.cancel()
            self._cv.notify()
        end = time.monotonic() + timeout
        while time.monotonic() < end and any(self.counts()):
            with self._cv:
                self._cv.notify()
            time.sleep(0.01)

    def stop(self, timeout: float = 5.0) -> None:
        """Cancel everything and end the worker thread (at interpreter exit: a worker left
        running would hold MLX's per-thread stream past its teardown)."""
        self.close(timeout)
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout)
        with self._cv:
            self._thread, self._stopping = None, False

    # ------------------------------------------------------------ inside a sequence
    def others_live(self) -> bool:
        return len(self._live) > 1 or bool(self._waiting)

    def forward(self, row: Row):
        """Called from a sequence's greenlet: wait for the next batched pass, return this row's result."""
        return self._hub.switch(row)

    # ------------------------------------------------------------ worker side
    def _admit(self) -> bool:
        with self._cv:
            while True:
                while not self._live and not self._waiting and not self._stopping:
                    if not self._cv.wait(IDLE_EXIT_S) and not self._live and not self._waiting:
                        # Idle: the thread ends (it holds the engine; the next submit starts one).
                        self._thread = None
                        return False
                if self._stopping and not self._live and not self._waiting:
                    return False
                self._take_waiting()
                if self._live:
                    return True

    def _work(self) -> None:
        self._hub = greenlet.getcurrent()
        try:
            while self._admit():  # False: idle for a while, or stopping
                self._step()
        except BaseException as e:  # a bug of the batcher's own (requests' errors are theirs)
            log.exception("the batch worker failed")
            self._fail_all(e)
        finally:
            # The thread ends here. MLX keeps streams per thread, and one that ran async_eval and
            # is left to MLX's teardown at exit aborts the process: release this thread's now.
            try:
                mx.synchronize()
            finally:
                clear = getattr(mx, "clear_streams", None)
                if clear is not None:
                    clear()

    def _fail_all(self, cause: BaseException) -> None:
        """The worker failed outside any request: end every request it held with an EngineError
        (their callers must not wait forever) and forget them; the next submit starts a new
        worker on an empty batch."""
        err = EngineError(f"the engine's batch worker failed ({type(cause).__name__}: {cause}); "
                          "this request was ended, the next one starts afresh")
        err.__cause__ = cause
        with self._cv:
            live, waiting = list(self._live), list(self._waiting)
            self._live, self._waiting = [], deque()
            self._reserved, self._arena, self._marks, self._last_passes = 0, None, [], []
            self._prev = None
        for req in [s.req for s in live] + waiting:
            req.fail(err)
            req.send("error", err)
        for seq in live:  # unwind their greenlets here, on the thread they belong to
            if seq.glet is not None and not seq.glet.dead:
                try:
                    seq.glet.throw(GreenletExit())
                except BaseException:
                    log.exception("a sequence failed while being unwound")
        with self._cv:
            self._thread = None
            if self._waiting:  # submitted meanwhile: a new worker serves them
                self._start_worker()

    def _step(self) -> None:
        n = len(self._live)
        self.batch_sizes[n] = self.batch_sizes.get(n, 0) + 1
        self.steps += 1
        t_step = time.perf_counter()
        self._step_n, self._regime = n, None
        self._asked, self._step_tokens = False, 0
        try:
            self._step_body()
        finally:
            self._credit(n, t_step)

    def _step_body(self) -> None:
        self._clean = True
        # Time to first token: a request admitted this step goes first (_start).
        new = [s for s in self._live if not s.started]
        self._start(new)
        # The last pass, computed before anyone is looked at: its readers take their chunks
        # meanwhile (MLX computes without the GIL), so a sequence that streamed a token last
        # step is ready again now instead of missing this step's pass. While the batch has
        # room, it is computed a few layers at a time, and a request that arrives meanwhile
        # starts between two of them instead of waiting for the whole pass (a speculation
        # step's can take several times a plain step's).
        pending = [s.value for s in self._live if s not in new and isinstance(s.value, (mx.array, tuple))]
        marks, self._marks = self._marks, []
        if len(self._live) >= self.max_batch:
            marks = []  # nobody could be admitted before the pass ends: evaluate it at once
        elif len(self._live) == 1 and all(T <= ALONE_WHOLE_TOKENS for _, T in self._last_passes):
            marks = []  # alone, a short pass: a newcomer waits for it (ALONE_WHOLE_TOKENS)
        if pending:
            t0 = time.perf_counter()
            arrived = False
            while marks:
                self._eval_part(marks.pop(0))  # popped: a buffer held here could not be written in place
                if self._waiting:
                    with self._cv:
                        late = self._take_waiting()
                    arrived |= bool(late)
                    self._start(late)  # resumed below like the others (they are started now)
            mx.eval(pending)
            if len(self._last_passes) == 1 and self._last_passes[0][0] > 1 and not arrived:
                # what a pass of this shape costs here, for pricing speculation (cost.StepCost)
                self._step_cost().observe(*self._last_passes[0], time.perf_counter() - t0)
        self._last_passes = []
        resumed = len(new)
        for seq in list(self._live):
            if seq in new:
                continue
            if seq.row is not None:  # its error handler already made its next call (_run_pass)
                resumed += 1
                continue
            if seq.on_reader and not seq.req.cancelled and not seq.req.is_ready():
                continue
            seq.on_reader = False
            resumed += 1
            self._resume(seq)
        # A sequence that streamed a token this step waits for its reader to take it. Readers
        # are quick (a thread handing the chunk on): give them a moment, so the sequence makes
        # its next call in this step's pass rather than in a pass of its own next step.
        # A round that commits several tokens streams them one chunk (and one wait) at a time.
        deadline = time.perf_counter() + READER_GRACE_S
        while True:
            readers = [s for s in self._live if s.on_reader and s.row is None]
            if not readers:
                break
            ready = [s for s in readers if _any_ready([s])]
            if not ready:
                left = deadline - time.perf_counter()
                if left <= 0:
                    break
                with self._cv:
                    self._cv.wait_for(functools.partial(_any_ready, readers), left)
                continue
            for seq in ready:
                seq.on_reader = False
                resumed += 1
                self._resume(seq)
        rows = [s for s in self._live if s.row is not None]
        if not rows:
            if not resumed and self._live:  # every sequence waits for its reader
                with self._cv:
                    self._cv.wait(0.05)
            return
        layers: list[list] = []
        for g in group_rows([s.row.T for s in rows], self._pass_cost):
            self._last_passes.append((len(g), max(rows[i].row.T for i in g)))
            cache = rows[g[0]].row.cache
            self._run_pass([rows[i] for i in g])
            layers.append(layer_marks(cache))
        # where the next step may pause evaluating these passes: every EVAL_SEGMENT layers
        n = min(len(m) for m in layers)
        self._marks = [[m[i] for m in layers] for i in range(EVAL_SEGMENT - 1, n - 1, EVAL_SEGMENT)]

    def _eval_part(self, arrays: list) -> None:
        """Evaluate one segment of the pending pass (a method: tests act between segments)."""
        mx.eval(arrays)

    def _start(self, new: list[_Seq]) -> None:
        """Start requests just admitted: each runs up to its prompt's call; while others decode,
        the prompts' passes are computed at once (before the others' pending pass is waited
        for), each streams its first token, and its next call joins this step's pass."""
        if not new:
            return
        self._clean = False  # a prompt's pass: not a decoding step's cost
        for seq in new:
            self._resume(seq)
        prompts = [s for s in new if s.row is not None]
        if prompts and len(prompts) < len(self._live):
            for g in group_rows([s.row.T for s in prompts], self._pass_cost):
                self._run_pass([prompts[i] for i in g])
            for s in prompts:
                if not s.emitted and s.row is None and not s.glet.dead and not s.on_reader \
                        and not s.req.cancelled:
                    self.early_starts += 1
                    self._resume(s)

    def _resume(self, seq: _Seq) -> None:
        """Run `seq` up to its next model call (seq.row), its reader (on_reader) or its end."""
        before = seq.req.stats.generated_tokens
        try:
            if not seq.started:
                if seq.req.cancelled:  # its client left before its first step
                    self._finish(seq)
                    seq.req.send("chunk", Chunk("", [], "cancelled"))
                    seq.req.send("done", seq.req.stats)
                    return
                seq.started = True
                seq.req.started_at = time.perf_counter()
                seq.req.send("start", None)
                out = seq.glet.switch()
            elif seq.req.cancelled:
                out = seq.glet.throw(Cancelled())
            else:
                out = seq.glet.switch(seq.value)
        except BaseException as e:  # _run reports its own errors; this is a bug in the batcher
            log.exception("a sequence failed outside its own error handling")
            seq.req.send("error", e)
            out = None
        self._step_tokens += seq.req.stats.generated_tokens - before
        self._settle(seq, out)

    def _settle(self, seq: _Seq, out) -> None:
        """Record where a resumed sequence stopped: its end, its reader, or its next call."""
        if seq.glet.dead:
            self._finish(seq)
        elif out is _WAIT:
            seq.on_reader, seq.value = True, None
        else:
            seq.row, seq.value = out, None
            seq.size = out.T

    def _run_pass(self, seqs: list[_Seq]) -> None:
        """One batched pass over `seqs`' rows: each gets its result (or the error) as its
        value, to be resumed with; an error is thrown into the sequence right away."""
        try:
            results = batched_forward(self.engine.model, [s.row for s in seqs])
        except Exception as e:
            results = [_Raise(e)] * len(seqs)
        for s, r in zip(seqs, results, strict=True):
            s.row, s.value = None, r
            if isinstance(r, _Raise):  # thrown into the sequence: it reports the error to its client
                try:
                    out = s.glet.throw(r.error)
                except BaseException as e:  # raised again on its way out: still this sequence's alone
                    log.exception("a sequence failed outside its own error handling")
                    s.req.send("error", e)
                    out = None
                self._settle(s, out)

    def arena_caches(self, seq: _Seq, caches: list) -> list:
        """`caches` (one KVCache per layer) moved to a row of the batch's arena; as they are
        for other cache types, and for a request that may grow past ARENA_POSITIONS (every
        row of an arena is as long as its longest, so a long request keeps its own)."""
        if not caches or any(type(c) is not KVCache or c.offset for c in caches):
            return caches
        if not seq.req.arena_positions:
            return caches
        if self._arena is None:
            self._arena = KVArena()
        # Rows up to one per short request live (what held_bytes accounts), not doubled.
        row = self._arena.acquire(sum(1 for s in self._live if s.req.arena_positions))
        seq.arena_rows[row] = [SlotCache(self._arena, i, row) for i in range(len(caches))]
        return seq.arena_rows[row]

    def _finish(self, seq: _Seq) -> None:
        if self._arena is not None:
            for row in seq.arena_rows:
                self._arena.release(row)
            seq.arena_rows = {}
            if not self._arena.used:
                self._arena = None  # the batch is empty: its memory goes
            else:
                self._compact()
        with self._cv:
            self._live.remove(seq)
            self._reserved -= seq.req.own_bytes
            idle = not self._live and not self._waiting
        if idle:
            mx.synchronize()  # nothing left computing behind the last reply (clean exit)
        if idle and self.on_idle is not None:
            try:
                self.on_idle()
            except Exception:
                log.exception("the idle callback failed")

    def _compact(self) -> None:
        """Move the highest rows in use down into the free ones below them (arena.move), so the
        live rows stay contiguous after a sequence ended (its rows already released)."""
        arena = self._arena
        held = {row: s for s in self._live for row in s.arena_rows}
        while held and arena.free_rows() and arena.free_rows()[0] < max(held):
            src, dst = max(held), arena.free_rows()[0]
            seq = held.pop(src)
            slots = seq.arena_rows.pop(src)
            # entries still in caches of their own (not attached yet): only the row number changes
            arena.move(src, dst, copy=any(c.attached for c in slots))
            for c in slots:
                c.row = dst
            seq.arena_rows[dst] = slots
            held[dst] = seq

    def _drafter_reuse(self, mode, stats):
        """The request's use of the drafter's prefix store (drafters.base.DrafterReuse), bound
        to the fork of the drafter its mode drafts with; None without one."""
        fork = getattr(mode, "request_drafter", None)
        if fork is None or fork is self.engine.drafter or not fork.caps.prefix_store:
            return None  # the engine's own drafter (no fork): shared, nothing of its own to keep
        store = self.engine.drafter_prefix_cache
        if store is None:
            return None

        fork.prefix_reuse = DrafterReuse(store, fork, stats)
        return fork.prefix_reuse

    def _run(self, seq: _Seq) -> None:
        """A sequence's whole life, inside its greenlet: build the mode, stream, report."""
        req, engine = seq.req, self.engine
        stats = req.stats
        reply: list[int] = []
        ok = False
        try:
            mode = engine.build_mode(req.options, req.mode_name, stats)
            sampler = Sampler(req.options.sampling)
            follow = compose_request(mode, engine, req.options, req.ids,
                                     view=lambda model: SeqModel(model, self, seq), sampler=sampler)
            seq.drafter_reuse = self._drafter_reuse(mode, stats)
            steps = follow(mode.steps(req.ids, sampler, stats))
            chunks = stream_tokens(steps, engine.tokenizer, stats, req.options.max_tokens, req.options.stop,
                                   context_left=engine.context_length - len(req.ids),
                                   cancel=lambda: req.cancelled)
            try:
                for chunk in chunks:
                    seq.emitted = True
                    reply.extend(chunk.tokens)
                    req.send("chunk", chunk)
                    if req.ready is not None and not chunk.finish_reason and not req.is_ready():
                        self._hub.switch(_WAIT)  # resumed once the reader has taken it
                ok = True
            except Cancelled:
                ok = True
                req.send("chunk", Chunk("", [], "cancelled"))
            finally:
                chunks.close()
                if seq.reuse is not None:
                    if ok:  # the reply's committed positions, for the next turn (prefix_cache)
                        seq.reuse.commit(list(req.ids) + reply)
                    seq.reuse = None
                if seq.drafter_reuse is not None:
                    if ok:  # the drafter's cache on the committed path, likewise
                        seq.drafter_reuse.commit(list(req.ids) + reply)
                    seq.drafter_reuse = None
                if engine.history is not None and reply:
                    engine.history.add(list(req.ids) + reply)
                get_peak = getattr(mx, "get_peak_memory", None)
                stats.peak_memory_bytes = int(get_peak()) if get_peak else 0
                engine.last_stats = stats
        except Exception as e:  # reported to this request's caller; the others keep going
            req.send("error", e)
            return
        req.send("done", stats)


_WAIT = object()  # a sequence's signal to the worker: paused for its reader


def _any_ready(seqs: list[_Seq]) -> bool:
    return any(s.req.cancelled or s.req.is_ready() for s in seqs)


class _Raise:
    def __init__(self, error: Exception):
        self.error = error
