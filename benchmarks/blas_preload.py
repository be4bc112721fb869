"""Which OpenBLAS to preload under MLX's CPU matmuls: Debian's vs numpy's (through the shim).

    make setup   # builds .cache/lib/libedgespec_cblas.so (edgespec/kernels/cpu_blas.py)
    .venv/bin/python benchmarks/blas_preload.py [--rounds 4] [--model BUNDLE]

The preload is fixed when a process starts, so each measurement is a fresh process, and
the two preloads alternate round by round (load drift hits both alike). Each process
loads the default model's bundle (or --model) on the CPU and times, median of --passes:
- a decoding pass of B = 1, 2, 4, 8 rows (caches at 150 positions), the model as it runs;
- a prefill of each of --prefill tokens (default 512; best of 2 under 2,048 tokens, else one).
Prints medians over the rounds for each preload, the shim's time over Debian's, and each
preload's B-row / 1-row pass cost (what batching and speculation are priced on).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEBIAN = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0"
ROWS = (1, 2, 4, 8)


def child(model: str | None, passes: int, sizes: list[int]) -> None:
    import mlx.core as mx

    import edgespec
    from edgespec.generate import prefill

    mx.set_default_device(mx.cpu)
    engine = edgespec.load(model, drafter="none", progress=False, history="off")
    m = engine.model
    rng = random.Random(1)
    out = {}
    for B in ROWS:
        cache = m.make_cache()
        mx.eval(m(mx.array([[rng.randrange(1000) for _ in range(150)] for _ in range(B)]), cache))
        times = []
        for _ in range(passes + 1):  # the first pass warms up
            x = mx.array([[rng.randrange(1000)] for _ in range(B)])
            t0 = time.perf_counter()
            mx.eval(m(x, cache, last_only=True))
            times.append(time.perf_counter() - t0)
            for c in cache:
                c.trim(1)
        out[f"pass{B}"] = statistics.median(times[1:]) * 1000
    for n in sizes:
        ids = [rng.randrange(1000) for _ in range(n)]
        times = []
        for _ in range(2 if n < 2048 else 1):
            cache = m.make_cache()
            t0 = time.perf_counter()
            mx.eval(prefill(m, cache, ids))
            times.append(time.perf_counter() - t0)
        out[f"prefill{n}"] = min(times) * 1000
    print(json.dumps(out))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=4, help="alternations of the two preloads")
    ap.add_argument("--passes", type=int, default=9, help="timed passes per size in each process")
    ap.add_argument("--model", default=None, help="bundle folder (default: the default model's bundle)")
    ap.add_argument("--shim", default=str(REPO / ".cache/lib/libedgespec_cblas.so"), help="the built shim")
    ap.add_argument("--debian", default=DEBIAN, help="Debian's OpenBLAS (libopenblas0-pthread)")
    ap.add_argument("--prefill", default="512", help="comma-separated prompt lengths to prefill (default 512)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.passes < 1:
        ap.error("--rounds and --passes must be at least 1")
    try:
        sizes = [int(s) for s in args.prefill.split(",") if s.strip()]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        ap.error(f"--prefill: positive token counts, comma-separated (got {args.prefill!r})")
    if args.child:
        child(args.model, args.passes, sizes)
        return 0
    preloads = {"debian": args.debian, "shim": args.shim}
    for name, path in preloads.items():
        if not os.path.isfile(path):
            ap.error(f"{name} preload {path} not found (`make setup` builds the shim; "
                     "Debian's is the libopenblas0-pthread package)")
    cmd = [sys.executable, __file__, "--child", "--passes", str(args.passes), "--prefill", args.prefill]
    if args.model:
        cmd += ["--model", args.model]
    results: dict[str, list[dict]] = {k: [] for k in preloads}
    from tqdm import tqdm

    for _ in tqdm(range(args.rounds), desc="rounds", file=sys.stderr):
        for name, path in preloads.items():
            r = subprocess.run(cmd, env=dict(os.environ, LD_PRELOAD=path), capture_output=True, text=True)
            if r.returncode != 0:
                print(r.stderr, file=sys.stderr)
                return 1
            results[name].append(json.loads(r.stdout.strip().splitlines()[-1]))
            time.sleep(1.0)
    keys = [f"pass{B}" for B in ROWS] + [f"prefill{n}" for n in sizes]
    med = {name: {k: statistics.median(r[k] for r in rs) for k in keys} for name, rs in results.items()}
    print(f"median of {args.rounds} rounds, ms (decoding pass of B rows; prefill of n tokens)")
    print(f"{'':>14}" + "".join(f"{k:>13}" for k in keys))
    for name in preloads:
        print(f"{name:>14}" + "".join(f"{med[name][k]:13.1f}" for k in keys))
    print(f"{'shim / debian':>14}" + "".join(f"{med['shim'][k] / med['debian'][k]:13.2f}" for k in keys))
    for name in preloads:
        print(f"{name}: pass cost over 1 row: " + ", ".join(
            f"{B} rows {med[name][f'pass{B}'] / med[name]['pass1']:.2f}x" for B in ROWS[1:]))
        if len(sizes) > 1:
            lo, hi = min(sizes), max(sizes)
            rate = {n: n / med[name][f"prefill{n}"] for n in (lo, hi)}
            print(f"{name}: prefill rate at {hi} / rate at {lo}: {rate[hi] / rate[lo]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
