"""Load an `edgespec serve` process with concurrent streaming clients; report outcomes and RSS.

    python benchmarks/serve_load.py --model PATH [--clients 8 --requests 24 --max-tokens 16 --max-queue 4
                                                  --max-batch N]

Starts the server on a free loopback port (concurrent requests decoded in batches
of up to --max-batch; default the server's), warms it up, then runs `--requests`
streaming chat requests from `--clients` concurrent clients; every third client
leaves after two events. Refused requests (503) are retried up to 3 times.
Prints completed / refused / left-early counts, server-side counters, and the
server's RSS before, at peak and after the load, and checks a final request
against the greedy reference.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import subprocess
import sys
import threading
import time

import httpx
import psutil

PROMPTS = ["Name three colours.", "What is 2+2?", "Say hello in French.", "Give me a fruit."]


async def one(client, url, i, leave_after, max_tokens, refusals):
    body = {"model": "default", "stream": True, "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]}
    for _ in range(4):
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
            if r.status_code == 503:
                await r.aread()
                refusals.append(i)
                await asyncio.sleep(1.0)
                continue
            events, text = 0, []
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    return "completed", "".join(text)
                if line.startswith("data: {"):
                    events += 1
                    for c in json.loads(line[6:])["choices"]:
                        text.append(c["delta"].get("content") or "")
                    if leave_after and events >= leave_after:
                        return "left", ""
            return "broken", ""
    return "refused", ""


async def load(url, args, refusals):
    gate = asyncio.Semaphore(args.clients)
    async with httpx.AsyncClient(timeout=3600, limits=httpx.Limits(max_connections=args.clients + 2)) as client:

        async def run(i):
            async with gate:
                return await one(client, url, i, 2 if i % 3 == 0 else 0, args.max_tokens, refusals)

        return await asyncio.gather(*(run(i) for i in range(args.requests)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="bundle/GGUF to serve")
    ap.add_argument("--clients", type=int, default=8, help="concurrent streaming clients")
    ap.add_argument("--requests", type=int, default=24, help="requests in all")
    ap.add_argument("--max-tokens", type=int, default=16, help="tokens per reply")
    ap.add_argument("--max-queue", type=int, default=4, help="server --max-queue")
    ap.add_argument("--max-batch", type=int, default=None, help="server --max-batch (default: the server's)")
    args = ap.parse_args()

    cmd = [sys.executable, "-m", "edgespec.cli", "serve", "--model", args.model, "--drafter", "none",
           "--port", "0", "--max-queue", str(args.max_queue)]
    if args.max_batch is not None:
        cmd += ["--max-batch", str(args.max_batch)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        port = int(re.search(r":(\d+)/v1", proc.stdout.readline()).group(1))
        url = f"http://127.0.0.1:{port}"
        server = psutil.Process(proc.pid)
        ref = {}
        for p in PROMPTS:  # warm-up, and the greedy references
            r = httpx.post(url + "/v1/chat/completions", timeout=3600, json={
                "model": "default", "max_tokens": args.max_tokens, "messages": [{"role": "user", "content": p}]})
            ref[p] = r.json()["choices"][0]["message"]["content"]
        rss0 = server.memory_info().rss
        peak = [rss0]
        done = threading.Event()

        def sample():
            while not done.wait(0.05):
                peak[0] = max(peak[0], server.memory_info().rss)

        threading.Thread(target=sample, daemon=True).start()
        refusals: list[int] = []
        t0 = time.perf_counter()
        results = asyncio.run(load(url, args, refusals))
        wall = time.perf_counter() - t0
        while httpx.get(url + "/health").json()["queue"]["running"]:
            time.sleep(0.1)
        done.set()
        rss1 = server.memory_info().rss
        wrong = sum(1 for i, (o, t) in enumerate(results) if o == "completed" and t != ref[PROMPTS[i % len(PROMPTS)]])
        final = httpx.post(url + "/v1/chat/completions", timeout=3600, json={
            "model": "default", "max_tokens": args.max_tokens,
            "messages": [{"role": "user", "content": PROMPTS[0]}]}).json()["choices"][0]["message"]["content"]
        counts = {k: sum(o == k for o, _ in results) for k in ("completed", "refused", "left", "broken")}
        q = httpx.get(url + "/health").json()["queue"]
        mib = 2**20
        print(f"{args.requests} requests, {args.clients} concurrent, max_tokens {args.max_tokens}, "
              f"queue {args.max_queue}: {counts}, 503 answers {len(refusals)}, wrong texts {wrong}, "
              f"{wall:.1f}s")
        print(f"server counters: {q}")
        print(f"RSS: before {rss0 / mib:.1f} MiB, peak {peak[0] / mib:.1f} MiB, after {rss1 / mib:.1f} MiB; "
              f"final request correct: {final == ref[PROMPTS[0]]}; server alive: {proc.poll() is None}; "
              f"RSS after / before {rss1 / rss0:.3f}")
        ok = wrong == 0 and counts["broken"] == 0 and final == ref[PROMPTS[0]] and rss1 <= rss0 * 1.05
        return 0 if ok else 1
    finally:
        proc.terminate()
        proc.wait(30)


if __name__ == "__main__":
    sys.exit(main())
