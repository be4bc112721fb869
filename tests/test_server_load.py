"""Bounded load on a real `edgespec serve` process (loopback only, tiny bundle): concurrent
streaming clients decoded in batches, some leaving early, a small queue so some are refused."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import psutil
import pytest
from server_support import ServerProcess, write_tiny_bundle

import edgespec

CLIENTS = 12  # concurrent streaming clients
REQUESTS = 36  # in all
MAX_QUEUE = 4
MAX_BATCH = 4  # decoded together; 4 more wait, the rest of the 12 clients are refused
MAX_TOKENS = 64
RETRIES = 3  # a refused client retries this many times before giving up
PROMPTS = ["hello world", "abc def", "the quick brown fox", "Zebra 42"]


def _rss(proc: psutil.Process) -> int:
    return proc.memory_info().rss


async def _one(client: httpx.AsyncClient, url: str, i: int, leave_after: int | None, refusals: list):
    """-> (outcome, text): 'completed', 'refused' (after RETRIES polite retries) or 'cancelled'."""
    body = {"model": "default", "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": MAX_TOKENS, "stream": True}
    for _attempt in range(RETRIES + 1):
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            if r.status_code == 503:
                err = json.loads(await r.aread())["error"]
                assert err["code"] == "queue_full" and r.headers["retry-after"]
                refusals.append(i)
                await asyncio.sleep(0.2 * (1 + i % 5))  # back off (spread out, below Retry-After)
                continue
            assert r.status_code == 200, await r.aread()
            text, events = [], 0
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    return "completed", "".join(text)
                events += 1
                text.append(json.loads(line[6:])["choices"][0]["text"])
                if leave_after is not None and events >= leave_after:
                    return "cancelled", ""  # leaving the block drops the connection mid-stream
            raise AssertionError("stream ended without [DONE]")
    return "refused", ""


async def _load(url: str, refusals: list) -> list[tuple[int, str, str]]:
    gate = asyncio.Semaphore(CLIENTS)
    limits = httpx.Limits(max_connections=CLIENTS + 2)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:

        async def run(i):
            async with gate:
                outcome, text = await _one(client, url, i, 2 if i % 3 == 0 else None, refusals)
                return i, outcome, text

        return await asyncio.gather(*(run(i) for i in range(REQUESTS)))


def test_load_concurrent_streams_with_disconnects(tmp_path):
    bundle = write_tiny_bundle(tmp_path / "tiny-load")
    engine = edgespec.load(bundle, drafter="none", progress=False)
    refs = {p: engine.generate(p, max_tokens=MAX_TOKENS).text for p in PROMPTS}
    server = ServerProcess(bundle, "--max-queue", str(MAX_QUEUE), "--max-batch", str(MAX_BATCH))
    try:
        proc = psutil.Process(server.proc.pid)
        for p in PROMPTS:  # warm up: first-use allocations belong to the baseline
            httpx.post(server.url + "/v1/completions", timeout=60,
                       json={"model": "default", "prompt": p, "max_tokens": MAX_TOKENS})
        rss_before = _rss(proc)

        t0 = time.perf_counter()
        refusals: list[int] = []  # one entry per 503 answer
        results = asyncio.run(_load(server.url, refusals))
        wall = time.perf_counter() - t0

        outcomes = {k: sum(o == k for _, o, _ in results) for k in ("completed", "refused", "cancelled")}
        assert sum(outcomes.values()) == REQUESTS
        assert outcomes["completed"] >= 1 and refusals, "the load should both complete and refuse"
        for i, outcome, text in results:
            if outcome == "completed":
                assert text == refs[PROMPTS[i % len(PROMPTS)]], f"request {i} got wrong text"

        # The server stays up, drains, and counts the same story.
        assert server.alive()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            q = httpx.get(server.url + "/health").json()["queue"]
            if q["running"] == 0 and q["waiting"] == 0:
                break
            time.sleep(0.05)
        assert q["running"] == 0 and q["waiting"] == 0 and q["failed"] == 0
        assert q["refused"] == len(refusals)
        # Warm-up + accepted requests; a client that left may still have finished server-side.
        assert q["submitted"] == len(PROMPTS) + REQUESTS - outcomes["refused"]
        assert q["completed"] + q["cancelled"] == q["submitted"]
        assert q["cancelled"] <= outcomes["cancelled"]

        # Memory returns near its baseline (MLX's buffer cache is freed when the queue drains).
        rss_after = _rss(proc)
        print(f"\nload: {REQUESTS} requests, {CLIENTS} concurrent, queue {MAX_QUEUE}: "
              f"completed {outcomes['completed']}, refused {outcomes['refused']} "
              f"({len(refusals)} 503 answers incl. retried), "
              f"left early {outcomes['cancelled']} (server cancelled {q['cancelled']}), "
              f"{wall:.1f}s; RSS {rss_before / 2**20:.1f} MiB -> {rss_after / 2**20:.1f} MiB")
        assert rss_after <= rss_before * 1.10 + 16 * 2**20

        # A final request still gives the correct output.
        r = httpx.post(server.url + "/v1/completions", timeout=60,
                       json={"model": "default", "prompt": PROMPTS[0], "max_tokens": MAX_TOKENS})
        assert r.json()["choices"][0]["text"] == refs[PROMPTS[0]]
    finally:
        server.stop()


@pytest.mark.parametrize("max_queue", [0])
def test_zero_queue_refuses_while_busy(tmp_path, max_queue):
    """--max-batch 1 --max-queue 0: the running request is the only one; the next is refused, not queued."""
    bundle = write_tiny_bundle(tmp_path / "tiny-q0")
    server = ServerProcess(bundle, "--max-queue", str(max_queue), "--max-batch", "1")
    try:
        body = {"model": "default", "prompt": "hello world", "max_tokens": 500, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()  # keep a reference: a dropped iterator closes the response
            next(lines)  # the first of ~480 tokens is out: the engine is busy for a while
            refused = httpx.post(server.url + "/v1/completions", timeout=60,
                                 json={"model": "default", "prompt": "abc", "max_tokens": 2})
            assert refused.status_code == 503
            assert refused.json()["error"]["code"] == "queue_full"
    finally:
        server.stop()
