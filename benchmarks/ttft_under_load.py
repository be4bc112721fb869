"""Time to first token under load, a pass evaluated in segments vs whole, over HTTP, side by side.

    python benchmarks/ttft_under_load.py [--model PATH] [--mode auto] [--rounds 6] [--segments 6,1000]

Starts one batched `edgespec serve` per value of the batcher's EVAL_SEGMENT (layers per
evaluated segment of a pass; 1000 = the whole pass at once, as before segments), all up
together. Each round, on each server in turn (the order turning): one request alone (idle
time to first token), one sent once 3 others stream (benchmarks/concurrency.py's
`ttft_under_load`), and 4 requests sent together (aggregate tokens/s: what evaluating in
segments costs; with --max-batch 8 the batch has room, so the passes are segmented).
Medians per server. Run on quiet cores.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from concurrency import PROMPTS, together, ttft_under_load  # noqa: E402


def start(model: str | None, segment: int) -> tuple[subprocess.Popen, str]:
    code = ("import sys, edgespec.batch.batcher as b; b.EVAL_SEGMENT = int(sys.argv.pop(1)); "
            "from edgespec.cli import main; sys.exit(main())")
    cmd = [sys.executable, "-c", code, str(segment), "serve", "--port", "0", "--drafter", "none", "--history", "off",
           "--max-batch", "8", *(["--model", model] if model else [])]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    m = re.search(r":(\d+)/v1", proc.stdout.readline())
    if not m:
        proc.terminate()
        raise SystemExit("a server did not start")
    return proc, f"http://127.0.0.1:{m.group(1)}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="bundle/GGUF (default: the default model)")
    ap.add_argument("--mode", default="auto", help="decoding mode of every request")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--segments", default="6,1000", help="EVAL_SEGMENT of each server")
    args = ap.parse_args()
    segments = [int(x) for x in args.segments.split(",")]
    servers = {}
    try:
        for seg in segments:
            servers[seg] = start(args.model, seg)
        samples = {seg: ([], [], []) for seg in segments}
        for _, url in servers.values():  # warm-up
            asyncio.run(together(url, PROMPTS[:4], args.max_tokens, args.mode))
        for r in range(args.rounds):
            for seg in segments[r % len(segments):] + segments[: r % len(segments)]:
                url = servers[seg][1]
                samples[seg][0].append(asyncio.run(together(url, [PROMPTS[0]], args.max_tokens, args.mode))[0][0][2])
                samples[seg][1].append(asyncio.run(ttft_under_load(url, args.max_tokens, args.mode)))
                res, wall = asyncio.run(together(url, PROMPTS[:4], args.max_tokens, args.mode))
                samples[seg][2].append(sum(x[1] for x in res) / wall)
    finally:
        for proc, _ in servers.values():
            proc.terminate()
    print(f"mode {args.mode}, time to first token, idle vs while 3 others stream, {args.rounds} rounds (medians)")
    for seg, (idle, loaded, rates) in samples.items():
        i, lo = statistics.median(idle), statistics.median(loaded)
        print(f"EVAL_SEGMENT {seg}: idle {i * 1000:.0f} ms, loaded {lo * 1000:.0f} ms ({lo / i:.2f}x); "
              f"loaded samples {' / '.join(f'{x * 1000:.0f}' for x in loaded)}; 4 requests together "
              f"{statistics.median(rates):.1f} tok/s ({' / '.join(f'{x:.1f}' for x in rates)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
