"""Admission in front of the engine's continuous batch (edgespec.batch).

Request handlers on the asyncio loop submit `Job`s; the engine's batch worker runs
up to `max_batch` of them together (each with its own caches, options and seed)
and feeds each job's chunks to an `asyncio.Queue` through `loop.call_soon_threadsafe`.

Fairness: jobs start in arrival order (the batcher admits FIFO as rows and KV memory
free up). Bound: at most `max_waiting` jobs wait beyond the running batch; `submit`
refuses the next one with `QueueFull` instead of letting latency grow without limit.
Cancellation: `job.cancel()` (client gone) makes a waiting job be skipped and a
running one leave the batch at its next step; the others' outputs do not change.
A request whose KV cache could never fit the memory budget gets an "error" event
(MemoryBudgetError: a 400 with the reason) instead of waiting forever.
"""

from __future__ import annotations

import asyncio
import logging
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
        self._lock = threading.Lock()
        self._active = 0  # accepted and not finished: waiting + running
        self._jobs: dict[int, Job] = {}  # by id(job): accepted, not finished
        self._batcher = engine.batcher
        self.max_batch = self._batcher.max_batch
        # Frees MLX's buffer cache when the batch drains (called on the worker thread).
        self._batcher.on_idle = clear_cache

    # ------------------------------------------------------------ request side
    def submit(self, job: Job) -> None:
        with self._lock:
            # max_batch run, max_waiting wait behind them. Counting accepted jobs rather than
            # the worker's state keeps the bound exact while the worker is picking one up.
            if self._active >= self.max_batch + self.max_waiting:
                self.counters.refused += 1
                raise QueueFull(
                    f"the server is busy: {self._active - self.max_batch} requests are already waiting "
                    f"(limit {self.max_waiting}); retry later"
                )
            self._active += 1
            self.counters.submitted += 1
            self._jobs[id(job)] = job
        try:
            mode = self.engine.resolve_mode(job.options)
            self.engine.submit(job.ids, job.options, mode, lambda kind, payload: self._on_event(job, kind, payload),
                               cancel=lambda: job.cancelled, stats=job.stats)
        except Exception as e:  # e.g. a request that can never fit the memory budget: this client's error
            self._on_event(job, "error", e)

    def _on_event(self, job: Job, kind: str, payload: Any) -> None:
        """The batch worker's events for one job (on the worker thread)."""
        if kind == "start":
            job.started_at = time.perf_counter()
            return
        if kind == "chunk":
            job._emit("chunk", payload)
            return
        with self._lock:
            if self._jobs.pop(id(job), None) is None:
                return
            self._active -= 1
            outcome = "failed" if kind == "error" else ("cancelled" if job.cancelled else "completed")
            setattr(self.counters, outcome, getattr(self.counters, outcome) + 1)
        job._emit(kind, payload)  # after counting: a handler that sees "done" sees the counters too

    def snapshot(self) -> dict[str, int]:
        running, _ = self._batcher.counts()
        with self._lock:
            c = self.counters
            running = min(running, self._active)
            return {
                "running": running,
                "waiting": self._active - running,
                "max_batch": self.max_batch,
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
            jobs = list(self._jobs.values())
        for j in jobs:
            j.cancel()
        self._batcher.close(timeout)
