"""Repetitive traffic through `edgespec serve`: does the history source make later requests faster?

    python benchmarks/history_traffic.py [--model PATH] [--prompts benchmarks/prompts/repetitive_unittest.jsonl]
                                         [--max-tokens 96]

Starts the server twice on a free loopback port, once with `--history memory` and
once with `--history off` (one after the other, nothing else running), and sends
the prompt file's requests one at a time, greedy, mode auto. Per run it reports
the decode tokens/s of every request (the server's own `edgespec.tokens_per_s`),
the mean over requests 1-5 and 16-20 and their ratio, the server's RSS peak and
the history store's size (`/health`). Replies must be identical in both runs:
history shapes drafts, never the output (exit 1 otherwise).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import psutil

HERE = Path(__file__).resolve().parent


def serve(model: str | None, history: str, prompts: list[dict], max_tokens: int):
    cmd = [sys.executable, "-m", "edgespec.cli", "serve", "--port", "0", "--history", history]
    if model:
        cmd += ["--model", model]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        port = int(re.search(r":(\d+)/v1", proc.stdout.readline()).group(1))
        url = f"http://127.0.0.1:{port}"
        server = psutil.Process(proc.pid)
        peak = [server.memory_info().rss]
        done = threading.Event()

        def sample():
            while not done.wait(0.05):
                peak[0] = max(peak[0], server.memory_info().rss)

        threading.Thread(target=sample, daemon=True).start()
        # Warm-up on an unrelated request (calibration, allocator): not part of the series.
        httpx.post(url + "/v1/chat/completions", timeout=3600, json={
            "model": "default", "max_tokens": 16, "messages": [{"role": "user", "content": "Say hello."}]})
        rates, texts = [], []
        for i, p in enumerate(prompts):
            msgs = p.get("messages") or [{"role": "user", "content": p["prompt"]}]
            r = httpx.post(url + "/v1/chat/completions", timeout=3600, json={
                "model": "default", "max_tokens": max_tokens, "temperature": 0, "messages": msgs}).json()
            rates.append(r["edgespec"]["tokens_per_s"])
            texts.append(r["choices"][0]["message"]["content"])
            print(f"  [{history}] request {i + 1:2d}: {rates[-1]:6.1f} tok/s, "
                  f"{r['usage']['completion_tokens']} tokens, mode {r['edgespec']['mode']}", file=sys.stderr)
        health = httpx.get(url + "/health").json()
        done.set()
        return rates, texts, peak[0], health.get("history", {})
    finally:
        proc.terminate()
        proc.wait(30)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="bundle/GGUF to serve (default: the default model)")
    ap.add_argument("--prompts", default=str(HERE / "prompts" / "repetitive_unittest.jsonl"),
                    help="JSONL requests, sent in file order")
    ap.add_argument("--max-tokens", type=int, default=96, help="tokens per reply at most")
    args = ap.parse_args()
    prompts = [json.loads(line) for line in Path(args.prompts).read_text().splitlines() if line.strip()]
    if len(prompts) < 20:
        raise SystemExit("need at least 20 requests (compares requests 1-5 with 16-20)")
    results = {}
    for history in ("memory", "off"):
        results[history] = serve(args.model, history, prompts, args.max_tokens)
    mib = 2**20
    print(f"{len(prompts)} requests from {args.prompts}, max_tokens {args.max_tokens}, greedy, mode auto")
    print("| history | tok/s requests 1-5 | tok/s requests 16-20 | 16-20 / 1-5 | RSS peak MiB | store |")
    print("|---|---|---|---|---|---|")
    first_last = {}
    for history, (rates, _, peak, h) in results.items():
        a, b = statistics.mean(rates[:5]), statistics.mean(rates[15:20])
        first_last[history] = (a, b)
        store = f"{h.get('documents', 0)} docs, {h.get('bytes', 0) / mib:.2f} MiB" if h.get("mode") != "off" else "off"
        print(f"| {history} | {a:.1f} | {b:.1f} | {b / a:.2f}x | {peak / mib:.0f} | {store} |")
    on, off = first_last["memory"], first_last["off"]
    print(f"requests 16-20 with history vs without: {on[1] / off[1]:.2f}x; "
          f"RSS peak with / without: {results['memory'][2] / results['off'][2]:.3f}")
    same = results["memory"][1] == results["off"][1]
    print(f"replies identical with and without history: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
