"""`edgespec serve` with continuous batching (real server processes, tiny bundle, loopback)."""

from __future__ import annotations

import asyncio
import json

import httpx
from server_support import ServerProcess, write_tiny_bundle

import edgespec
from edgespec.batch.memory import reserve_bytes
from edgespec.lookahead.memory import tree_bytes

PROMPTS = ["hello world", "abc def", "the quick brown fox", "Zebra 42"]
MAX_TOKENS = 48


async def _stream(client, url, prompt, leave_after=None, **extra):
    body = {"model": "default", "prompt": prompt, "max_tokens": MAX_TOKENS, "stream": True, **extra}
    text = []
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                return "".join(text)
            if line.startswith("data: "):
                text.append(json.loads(line[6:])["choices"][0]["text"])
                if leave_after is not None and len(text) >= leave_after:
                    return None  # drops the connection mid-stream
    raise AssertionError("no [DONE]")


def test_concurrent_streams_get_their_own_replies_and_a_disconnect_changes_nothing(tmp_path):
    bundle = write_tiny_bundle(tmp_path / "tiny")
    engine = edgespec.load(bundle, drafter="none", progress=False)
    refs = {p: engine.generate(p, max_tokens=MAX_TOKENS).text for p in PROMPTS}
    sampled = {"temperature": 0.8, "seed": 11}
    ref_sampled = engine.generate(PROMPTS[0], max_tokens=MAX_TOKENS, **sampled).text
    server = ServerProcess(bundle, "--max-batch", "8", "--max-queue", "0")
    try:
        async def main():
            async with httpx.AsyncClient(timeout=120) as client:
                jobs = [_stream(client, server.url, p) for p in PROMPTS]
                jobs.append(_stream(client, server.url, PROMPTS[1], leave_after=2))  # leaves mid-stream
                jobs.append(_stream(client, server.url, PROMPTS[0], **sampled))
                jobs.append(_stream(client, server.url, PROMPTS[2], mode="plain"))
                return await asyncio.gather(*jobs)

        got = asyncio.run(main())
        # --max-queue 0 refused none of the 7: they ran as one batch, each with its own reply.
        assert got[:4] == [refs[p] for p in PROMPTS]
        assert got[4] is None
        assert got[5] == ref_sampled and got[6] == refs[PROMPTS[2]]
        q = httpx.get(server.url + "/health").json()["queue"]
        assert q["max_batch"] == 8 and q["failed"] == 0 and q["refused"] == 0
    finally:
        server.stop()


def test_max_batch_admits_that_many_then_refuses_with_no_queue(tmp_path):
    bundle = write_tiny_bundle(tmp_path / "tiny")
    server = ServerProcess(bundle, "--max-batch", "2", "--max-queue", "0")
    try:
        body = {"model": "default", "prompt": "hello world", "max_tokens": 480, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r1:
            lines1 = r1.iter_lines()
            next(lines1)
            with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r2:
                assert r2.status_code == 200  # joined the running batch
                lines2 = r2.iter_lines()
                next(lines2)
                third = httpx.post(server.url + "/v1/completions", timeout=60,
                                   json={"model": "default", "prompt": "abc", "max_tokens": 2})
                assert third.status_code == 503 and third.json()["error"]["code"] == "queue_full"
    finally:
        server.stop()


def test_a_request_that_can_never_fit_the_memory_budget_is_a_400(tmp_path):
    bundle = write_tiny_bundle(tmp_path / "tiny")
    engine = edgespec.load(bundle, drafter="none", progress=False)
    small = reserve_bytes(engine, 16, 8)
    budget = tree_bytes(engine.model) + small  # caches for a short request, not a long one
    server = ServerProcess(bundle, "--memory-budget", str(budget))
    try:
        ok = httpx.post(server.url + "/v1/completions", timeout=60,
                        json={"model": "default", "prompt": "hello", "max_tokens": 8})
        assert ok.status_code == 200
        big = httpx.post(server.url + "/v1/completions", timeout=60,
                         json={"model": "default", "prompt": "hello", "max_tokens": 400})
        assert big.status_code == 400
        msg = big.json()["error"]["message"]
        assert "KV cache" in msg and "--memory-budget" in msg
    finally:
        server.stop()
