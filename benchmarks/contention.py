"""`auto` against plain per domain, idle and under a fixed background CPU load (issue 45).

    python benchmarks/contention.py [--model PATH] [--drafter SPEC] [--max-tokens 96]
        [--repeats 2] [--per-domain 2] [--load N] [--phases idle,busy] [--json out.json]

Runs the project's mixed prompts (edgespec/data/bench_prompts.jsonl, or --prompts FILE) with plain and
`auto`, modes interleaved per prompt (edgespec.benchmark.runner), once per phase:
"idle" with nothing started, "busy" with `--load` busy processes (default one per
core: a Python loop each, started before the phase and stopped after it by this
script). Prints auto/plain (decode tokens/s ratio) per domain and overall for each
phase (in parentheses the lowest and highest of the repeats' ratios), plain tokens/s,
the regret guard's trips (edgespec.adaptive.policy), and whether every greedy output
equalled plain's. Figures on a shared machine are rough:
compare ratios, and report the load with them.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from contextlib import contextmanager

# A busy loop that ends itself once its parent is gone (the benchmark killed, not only
# stopped: a `finally` does not run on SIGTERM/SIGKILL, and orphaned spinners would keep the
# cores busy for good). It checks every million iterations (tens of milliseconds).
BUSY = """import os, sys
parent = int(sys.argv[1])
n = 0
while True:
    n += 1
    if n % 1_000_000 == 0 and os.getppid() != parent:
        break
"""


@contextmanager
def background_load(n: int):
    """`n` busy processes for the duration of the block (none when n == 0)."""
    procs = [subprocess.Popen([sys.executable, "-c", BUSY, str(os.getpid())], stdin=subprocess.DEVNULL) for _ in range(n)]
    try:
        time.sleep(0.5 if n else 0.0)  # let the scheduler spread them before measuring
        yield
    finally:
        for p in procs:  # only the processes started here, by their handles
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def guard_counts(engine) -> dict:
    """Trips/releases/interleaves of the regret guards the engine's auto decoders kept."""
    out = {"trips": 0, "releases": 0, "interleaves": 0}
    for mem in engine.memory.adaptive.values():
        g = mem.get("guard")
        if g is not None:
            for k in out:
                out[k] += getattr(g, k)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="bundle, HF folder or GGUF (default: the default model)")
    ap.add_argument("--drafter", default=None, help="drafter spec as for `edgespec bench` (default: the model's)")
    ap.add_argument("--max-tokens", type=int, default=96, help="tokens generated per prompt")
    ap.add_argument("--repeats", type=int, default=2, help="measured repeats per prompt and mode")
    ap.add_argument("--per-domain", type=int, default=2, help="prompts per domain (from the prompt set)")
    ap.add_argument("--prompts", default=None,
                    help="a JSONL prompt set as for `edgespec bench --prompts` (default: the built-in set; "
                         "benchmarks/prompts/mixed.jsonl is the second, 7-domain set)")
    ap.add_argument("--load", type=int, default=os.cpu_count() or 1,
                    help="busy background processes in the busy phase (default: one per core)")
    ap.add_argument("--phases", default="idle,busy", help="comma-separated, in order: idle, busy")
    ap.add_argument("--json", default=None, help="also write the per-phase reports to this file")
    args = ap.parse_args()
    phases = [p.strip() for p in args.phases.split(",") if p.strip()]
    bad = [p for p in phases if p not in ("idle", "busy")]
    if bad or not phases:
        ap.error(f"--phases: choose from idle, busy (got {args.phases!r})")
    if args.load < 0 or args.repeats < 1 or args.max_tokens < 1 or args.per_domain < 1:
        ap.error("--load must be >= 0; --repeats, --max-tokens and --per-domain >= 1")

    import edgespec
    from edgespec.benchmark import build_report, load_prompts, select_prompts
    from edgespec.benchmark.runner import run_benchmark
    from edgespec.benchmark.specs import parse_mode_specs
    from edgespec.modes import available_modes
    from edgespec.progress import progress_bar

    prompts = select_prompts(load_prompts(args.prompts), per_domain=args.per_domain)
    specs = parse_mode_specs("plain,auto", list(available_modes()) + ["auto"])
    engine = edgespec.load(args.model, drafter=args.drafter, progress=True)
    out = {}
    for phase in phases:
        n = args.load if phase == "busy" else 0
        before = guard_counts(engine)
        total = len(prompts) * len(specs) * (args.repeats + 1)
        with background_load(n), progress_bar(total=total, desc=phase, unit="gen") as bar:
            run = run_benchmark(engine, prompts, specs, max_tokens=args.max_tokens, repeats=args.repeats,
                                on_progress=lambda k, desc: bar.update(k))
            load1 = os.getloadavg()[0]
        rep = build_report(run, {"phase": phase, "load_processes": n, "loadavg_1m": load1})
        after = guard_counts(engine)
        rep["guard"] = {k: after[k] - before[k] for k in after}
        out[phase] = rep
        auto = rep["results"].get("auto", {})
        plain = rep["results"].get("plain", {})
        # each domain's ratio, with the lowest and highest of its repeats (how far one run moves)
        cells = "  ".join(f"{d} {auto[d]['speedup']:.2f} ({auto[d]['speedup_min']:.2f}-{auto[d]['speedup_max']:.2f})"
                          if auto[d].get("speedup_min") is not None else f"{d} {auto[d]['speedup']:.2f}"
                          for d in ["all"] + rep["domains"] if d in auto and auto[d]["speedup"])
        print(f"{phase} (busy processes {n}, load {load1:.1f}): auto/plain {cells}; "
              f"plain {plain.get('all', {}).get('tokens_per_s', 0):.1f} tok/s; "
              f"equal to plain: {rep['status'].get('auto')}; guard {rep['guard']}")
    if args.json:  # atomic: a temporary file beside it, then renamed
        tmp = f"{args.json}.tmp-{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(out, f, indent=1, default=str)
        os.replace(tmp, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
