"""Sharded verifier vs one process: tokens/s, round trips per token, weights per rank.

    python benchmarks/distributed.py [--model BUNDLE] [--ranks 2] [--split pipeline]
                                     [--max-tokens 48] [--prompts 3] [--json OUT]

Runs the same prompts (chat template, greedy) in mode plain and mode speculative with
K = --draft-tokens (the bundle's or the shipped drafter, on rank 0 only), first in this process, then over
--ranks local processes (ring backend on 127.0.0.1), and prints both side by side with
ratios. A round trip is one forward call through the shards (prefill chunks + verifier
passes); in one process the same count is reported as passes. Every rank also reports
the weights it holds and MLX's active memory after loading.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

PROMPTS = [
    "Explain in two sentences why the sky is blue.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "List three uses of a hash map.",
    "What is the capital of France, and what river runs through it?",
    "Summarise the plot of Romeo and Juliet in one paragraph.",
]


def modes(draft_tokens) -> list[dict]:
    return [dict(mode="plain"), dict(mode="speculative", draft_tokens=draft_tokens)]


def workload(engine, prompts: list[str], max_tokens: int, count_round_trips, draft_tokens="auto") -> list[dict]:
    out = []
    for case in modes(draft_tokens):
        engine.generate(messages=[{"role": "user", "content": "Hi"}], max_tokens=8, **case)  # warm-up
        tokens = passes = 0
        trips0 = count_round_trips()
        t0 = time.perf_counter()
        for p in prompts:
            r = engine.generate(messages=[{"role": "user", "content": p}], max_tokens=max_tokens, **case)
            tokens += len(r.tokens)
            passes += r.stats.verifier_passes
        dt = time.perf_counter() - t0
        trips = count_round_trips() - trips0
        out.append(dict(mode=case["mode"], tokens=tokens, seconds=dt, tok_s=tokens / dt,
                        passes=passes, round_trips=trips, tokens_per_pass=tokens / max(passes, 1)))
    return out


def rank_main(args) -> int:
    """One rank of the distributed run (started by main through spawn_local)."""
    import mlx.core as mx

    import edgespec.distributed as dist

    def loaded(rank, model, plan):
        mx.clear_cache()
        print(json.dumps({"rank": rank, "weights": dist.shard_bytes(model, plan),
                          "active": mx.get_active_memory(), "layers": list(plan.ranges[rank])}), flush=True)

    engine = dist.load(args.model, split=args.split, history="off", on_loaded=loaded)
    if engine is None:
        return 0
    rows = workload(engine, PROMPTS[: args.prompts], args.max_tokens, lambda: engine.model.calls, args.draft_tokens)
    print(json.dumps({"rows": rows}), flush=True)
    engine.model.close()
    os._exit(0)  # skip interpreter teardown (the engine's batching thread can abort it)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="bundle (default: the converted default model)")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--split", choices=["pipeline", "tensor"], default="pipeline")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--draft-tokens", default="4", help="K of mode speculative (an integer, or auto: the "
                    "controller then picks K from measured costs, often plain steps on a loaded CPU)")
    ap.add_argument("--json", default=None, help="also write the figures here")
    ap.add_argument("--rank-worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.draft_tokens = args.draft_tokens if args.draft_tokens == "auto" else int(args.draft_tokens)
    if args.model is None:
        from edgespec.converters.default_model import default_bundle_path

        args.model = str(default_bundle_path(progress=False))
    if args.rank_worker:
        return rank_main(args)

    import mlx.core as mx

    import edgespec
    from edgespec.distributed.launch import spawn_local

    engine = edgespec.load(args.model, history="off", progress=False)
    mx.clear_cache()
    single_active = mx.get_active_memory()
    # no shards in one process: no round trips
    single = workload(engine, PROMPTS[: args.prompts], args.max_tokens, lambda: 0, args.draft_tokens)
    del engine

    cmd = [sys.executable, str(Path(__file__).resolve()), "--rank-worker", "--model", args.model,
           "--split", args.split, "--max-tokens", str(args.max_tokens), "--prompts", str(args.prompts),
           "--draft-tokens", str(args.draft_tokens)]
    procs = spawn_local(args.ranks, cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    outs = [p.communicate(timeout=1800) for p in procs]
    for rank, (p, (_, err)) in enumerate(zip(procs, outs, strict=True)):
        if p.returncode != 0:
            print(f"rank {rank} failed ({p.returncode}):\n{err[-2000:]}", file=sys.stderr)
            return 1
    lines = [json.loads(x) for out, _ in outs for x in out.splitlines() if x.startswith("{")]
    ranks = sorted((x for x in lines if "rank" in x), key=lambda x: x["rank"])
    dist_rows = next(x["rows"] for x in lines if "rows" in x)

    print(f"model {args.model}; {args.ranks} local ranks, split {args.split}; {args.prompts} prompts x "
          f"{args.max_tokens} tokens, greedy; speculative K={args.draft_tokens}")
    print(f"one process: active memory after load {single_active / 2**20:.1f} MiB")
    for r in ranks:
        print(f"rank {r['rank']}: layers [{r['layers'][0]}, {r['layers'][1]}), weights {r['weights'] / 2**20:.1f} MiB "
              f"({r['weights'] / single_active:.2f} of one process), active {r['active'] / 2**20:.1f} MiB")
    print(f"{'mode':12} {'1 proc tok/s':>12} {'N ranks tok/s':>13} {'ratio':>6} {'tok/pass':>8} "
          f"{'round trips/tok':>15}")
    for s, d in zip(single, dist_rows, strict=True):
        print(f"{s['mode']:12} {s['tok_s']:12.1f} {d['tok_s']:13.1f} {d['tok_s'] / s['tok_s']:6.2f} "
              f"{d['tokens_per_pass']:8.2f} {d['round_trips'] / d['tokens']:15.3f}")
    plain, spec = dist_rows
    cut = (plain["round_trips"] / plain["tokens"]) / (spec["round_trips"] / spec["tokens"])
    print(f"speculative / plain over the ranks: {spec['tok_s'] / plain['tok_s']:.2f}x tokens/s; round trips per "
          f"token cut {cut:.2f}x (tokens per pass {spec['tokens_per_pass']:.2f})")
    if args.json:
        Path(args.json).write_text(json.dumps({"single": single, "distributed": dist_rows, "ranks": ranks,
                                               "single_active": single_active, "args": vars(args)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
