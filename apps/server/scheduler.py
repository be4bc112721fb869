"""A fair FIFO queue in front of the engine, which runs one generation at a time.

One worker thread owns all generation (MLX is synchronous); request handlers
on the asyncio loop submit `Job`s and read the job's chunks from an
`asyncio.Queue` the worker feeds through `loop.call_soon_threadsafe`.

Fairness: jobs start strictly in arrival order (one `queue.Queue`, one worker).
Bound: at most `max_waiting` jobs wait behind the running one; `submit` refuses
the next one with `QueueFull` instead of letting latency grow without limit.
Cancellation: `job.cancel()` (client gone) makes a waiting job be skipped and
a running one stop at its next token (the engine's cancel callback), so the
engine is free for the next job within one decoding step.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from edgespec.generate import GenerationStats
from edgespec.options import GenerateOptions

log = logging.getLogger("edgespec.server")


class QueueFull(Exception):
    """More requests are waiting than the server accepts (--max-queue)."""


@dataclass
class Job:
    """One generation request. Events on `out`: ("chunk", Chunk), ("done", stats), ("error", exc)."""

    ids: list[int]
    options: GenerateOptions
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue = field(default_factory=asyncio.Queue)
    stats: GenerationStats = field(default_factory=GenerationStats)
    submitted_at: float = field(default_factory=time.perf_counter)
    started_at: float | None = None
    _cancelled: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    @property
    def queue_s(self) -> float:
        """Seconds spent waiting for the engine."""
        end = self.started_at if self.started_at is not None else time.perf_counter()
        return end - self.submitted_at

    def _emit(self, kind: str, payload: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.out.put_nowait, (kind, payload))
        except RuntimeError:  # the event loop is closed (server shutting down)
            pass


@dataclass
class Counters:
    submitted: int = 0
    completed: int = 0
    cancelled: int = 0
    refused: int = 0
    failed: int = 0


class Scheduler:
    def __init__(self, engine, max_waiting: int = 16, clear_cache=None):
        if max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0, got {max_waiting}")
        self.engine = engine
        self.max_waiting = max_waiting
        self.counters = Counters()
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self._lock = threading.Lock()
        self._active = 0  # accepted and not finished: waiting + running (or about to run)
        self._running: Job | None = None
        self._clear_cache = clear_cache  # called when the queue drains (frees MLX's buffer cache)
        self._thread = threading.Thread(target=self._work, name="edgespec-generate", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ request side
    def submit(self, job: Job) -> None:
        with self._lock:
            # One job runs, max_waiting wait behind it. Counting accepted jobs rather than
            # the worker's state keeps the bound exact while the worker is picking one up.
            if self._active >= self.max_waiting + 1:
                self.counters.refused += 1
                raise QueueFull(
                    f"the server is busy: {self._active - 1} requests are already waiting "
                    f"(limit {self.max_waiting}); retry later"
                )
            self._active += 1
            self.counters.submitted += 1
        self._queue.put(job)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            c = self.counters
            return {
                "running": int(self._running is not None),
                "waiting": self._active - (self._running is not None),
                "max_waiting": self.max_waiting,
                "submitted": c.submitted,
                "completed": c.completed,
                "cancelled": c.cancelled,
                "refused": c.refused,
                "failed": c.failed,
            }

    def close(self, timeout: float = 5.0) -> None:
        """Cancel everything still queued or running and stop the worker."""
        with self._lock:
            if self._running is not None:
                self._running.cancel()
        self._queue.put(None)
        self._thread.join(timeout)

    # ------------------------------------------------------------ worker side
    def _work(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                # Drain what is left so no handler waits forever.
                while not self._queue.empty():
                    rest = self._queue.get_nowait()
                    if rest is not None:
                        rest._emit("error", RuntimeError("the server is shutting down"))
                return
            with self._lock:
                self._running = job
            outcome = "failed"
            try:
                outcome = self._run(job)
            finally:
                with self._lock:
                    self._running = None
                    self._active -= 1
                    setattr(self.counters, outcome, getattr(self.counters, outcome) + 1)
                    idle = self._active == 0
            if idle and self._clear_cache is not None:
                try:
                    self._clear_cache()
                except Exception:  # never let housekeeping stop the worker
                    log.exception("clearing the buffer cache failed")

    def _run(self, job: Job) -> str:
        """Run one job; returns its outcome: 'completed', 'cancelled' or 'failed'."""
        if job.cancelled:  # the client left while waiting: skip it, never touch the engine
            job._emit("done", job.stats)
            return "cancelled"
        job.started_at = time.perf_counter()
        stream = None
        try:
            stream = self.engine.stream(job.ids, options=job.options, cancel=lambda: job.cancelled, stats=job.stats)
            for chunk in stream:
                job._emit("chunk", chunk)
        except Exception as e:  # reported to this client; the server keeps serving
            job._emit("error", e)
            return "failed"
        finally:
            if stream is not None:
                stream.close()  # releases the engine lock even if we stopped early
        outcome = "cancelled" if job.cancelled else "completed"  # before the handler sees "done"
        job._emit("done", job.stats)
        return outcome
