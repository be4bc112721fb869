"""A batcher setting A/B over HTTP, side by side: time to first token under load, and requests sent together.

    python benchmarks/ttft_under_load.py [--model PATH] [--mode auto] [--rounds 6]
        [--setting EVAL_SEGMENT=6,1000] [--together 4]

Starts one batched `edgespec serve` (--max-batch 8) per value of a constant of
edgespec.batch.batcher, all up together. The default compares EVAL_SEGMENT (layers per
evaluated segment of a pass; 1000 = the whole pass at once, as before segments);
`--setting READER_GRACE_S=0.005,0` compares a step waiting 5 ms for readers to take
the tokens just streamed with not waiting. Each round, on each server in turn (the
order turning): one request alone (idle time to first token), one sent once 3 others stream
(benchmarks/concurrency.py's `ttft_under_load`), and for each --together N, N requests
sent together (aggregate tokens/s, from the first request sent to the last reply).
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


def start(model: str | None, name: str, value: str) -> tuple[subprocess.Popen, str]:
    code = ("import sys, edgespec.batch.batcher as b; name, value = sys.argv.pop(1), sys.argv.pop(1); "
            "setattr(b, name, type(getattr(b, name))(value)); from edgespec.cli import main; sys.exit(main())")
    cmd = [sys.executable, "-c", code, name, value, "serve", "--port", "0", "--drafter", "none", "--history", "off",
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
    ap.add_argument("--setting", default="EVAL_SEGMENT=6,1000",
                    help="NAME=V1,V2,...: a constant of edgespec.batch.batcher, one server per value")
    ap.add_argument("--segments", default=None, help="shorthand for --setting EVAL_SEGMENT=...")
    ap.add_argument("--together", default="4", help="comma-separated numbers of requests sent together")
    args = ap.parse_args()
    import edgespec.batch.batcher as batcher

    spec = f"EVAL_SEGMENT={args.segments}" if args.segments else args.setting
    name, _, values = spec.partition("=")
    values = [v.strip() for v in values.split(",") if v.strip()]
    if not isinstance(getattr(batcher, name, None), (int, float)) or len(values) < 2:
        raise SystemExit(f"--setting: NAME=V1,V2 with NAME a number constant of edgespec.batch.batcher, got {spec!r}")
    together_n = [int(x) for x in args.together.split(",")]
    if any(not 1 <= n <= len(PROMPTS) for n in together_n):
        raise SystemExit(f"--together: each number from 1 to {len(PROMPTS)} (the prompts there are), got {args.together!r}")
    servers = {}
    try:
        for v in values:
            servers[v] = start(args.model, name, v)
        samples = {v: ([], [], {n: [] for n in together_n}) for v in values}
        for _, url in servers.values():  # warm-up
            asyncio.run(together(url, PROMPTS[:4], args.max_tokens, args.mode))
        for r in range(args.rounds):
            for v in values[r % len(values):] + values[: r % len(values)]:
                url = servers[v][1]
                samples[v][0].append(asyncio.run(together(url, [PROMPTS[0]], args.max_tokens, args.mode))[0][0][2])
                samples[v][1].append(asyncio.run(ttft_under_load(url, args.max_tokens, args.mode)))
                for n in together_n:
                    res, wall = asyncio.run(together(url, PROMPTS[:n], args.max_tokens, args.mode))
                    samples[v][2][n].append(sum(x[1] for x in res) / wall)
    finally:
        for proc, _ in servers.values():
            proc.terminate()
    print(f"mode {args.mode}, {args.rounds} rounds (medians); time to first token idle vs while 3 others stream")
    for v, (idle, loaded, rates) in samples.items():
        i, lo = statistics.median(idle), statistics.median(loaded)
        print(f"{name} {v}: idle {i * 1000:.0f} ms, loaded {lo * 1000:.0f} ms ({lo / i:.2f}x); "
              f"loaded samples {' / '.join(f'{x * 1000:.0f}' for x in loaded)}" + "".join(
                  f"; {n} requests together {statistics.median(x):.1f} tok/s ({' / '.join(f'{y:.1f}' for y in x)})"
                  for n, x in rates.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
