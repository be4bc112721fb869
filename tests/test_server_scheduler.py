"""The server's Scheduler in-process: FIFO start order, bounded waiting, cancellation."""

from __future__ import annotations

import asyncio

import pytest
from conftest import make_tiny_engine
from edgespec.apps.server.scheduler import Job, QueueFull, Scheduler

from edgespec.engine import make_options


async def _drain(job: Job) -> tuple[str, list]:
    chunks = []
    while True:
        kind, payload = await job.out.get()
        if kind == "chunk":
            chunks.append(payload)
        else:
            return kind, chunks


def test_fifo_order_bound_and_cancel():
    engine = make_tiny_engine(2, scale=4.0)
    engine.max_batch = 1  # strictly one at a time (the batched case: tests/test_server_batching.py)
    ids = engine.encode_prompt("hello world")
    sched = Scheduler(engine, max_waiting=3)

    async def main():
        loop = asyncio.get_running_loop()
        jobs = [Job(ids, make_options(max_tokens=30), loop) for _ in range(4)]
        for j in jobs:  # 1 runs (or is about to) + 3 wait
            sched.submit(j)
        with pytest.raises(QueueFull, match="limit 3"):
            sched.submit(Job(ids, make_options(max_tokens=2), loop))
        jobs[2].cancel()  # left while waiting: skipped, the engine never sees it
        results = [await _drain(j) for j in jobs]
        return jobs, results

    try:
        jobs, results = asyncio.run(main())
    finally:
        sched.close()
    assert [k for k, _ in results] == ["done"] * 4
    ran = [j for j in jobs if j.started_at is not None]
    assert ran == [jobs[0], jobs[1], jobs[3]]  # the cancelled one never started
    assert [j.started_at for j in ran] == sorted(j.started_at for j in ran)  # arrival order
    # it ends with one empty chunk saying why, as a request cancelled later does
    assert [(c.text, c.tokens, c.finish_reason) for c in results[2][1]] == [("", [], "cancelled")]
    ref = engine.generate("hello world", max_tokens=30).text
    for i in (0, 1, 3):
        assert "".join(c.text for c in results[i][1]) == ref
    snap = sched.snapshot()
    assert (snap["submitted"], snap["completed"], snap["cancelled"], snap["refused"]) == (4, 3, 1, 1)
