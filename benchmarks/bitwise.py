"""Bitwise verification's cost and effect: plain and `auto` tokens/s with it off and on.

    LD_PRELOAD=$(make -s preload) python benchmarks/bitwise.py [--per-domain 2] [--max-tokens 64]

On the project's mixed prompts (edgespec/benchmark, the built-in set), greedy, one process:
for each prompt the four variants (plain off, plain on, auto off, auto on) run back to back
in an order that turns from prompt to prompt, so load from other processes hits all four
alike; only ratios are meaningful on a shared machine. Prints tokens/s per variant (total
tokens / total time), the on/off ratios, and the divergences of auto from plain in each
setting (with bitwise on there must be none). `--probe` first prints which rows of a
32-token chain and tree pass differ from one-token passes, mode off and on.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="bundle/folder/GGUF (default: the default model)")
    ap.add_argument("--per-domain", type=int, default=2, help="prompts per domain of the built-in set")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens per reply")
    ap.add_argument("--probe", action="store_true", help="first print the rows of wide passes that differ")
    args = ap.parse_args()

    import mlx.core as mx
    import numpy as np

    import edgespec
    from edgespec.benchmark import load_prompts, select_prompts
    from edgespec.benchmark.runner import encode
    from edgespec.engine import make_options
    from edgespec.kernels import exact

    engine = edgespec.load(args.model, drafter="none", progress=False, history="off")
    model = engine.loaded.model
    if args.probe:
        from edgespec.benchmark.width_check import chain_rows, random_tree, tree_rows

        rng = np.random.default_rng(0)
        prompt = [int(x) for x in rng.integers(1, 40000, 40)]
        tokens = [int(x) for x in rng.integers(1, 40000, 32)]
        parents = random_tree(rng, 32)
        for on in (False, True):
            exact.set_enabled(on)
            print(f"bitwise {'on ' if on else 'off'}: rows differing from one-token passes: chain of 32: "
                  f"{len(chain_rows(model, prompt, tokens))}, tree of 32: "
                  f"{len(tree_rows(model, prompt, tokens, parents))}", flush=True)
    prompts = select_prompts(load_prompts(None), None, args.per_domain)
    variants = [("plain", False), ("plain", True), ("auto", False), ("auto", True)]
    tokens = {v: 0 for v in variants}
    seconds = {v: 0.0 for v in variants}
    outputs: dict[tuple, list[int]] = {}
    ids = [encode(engine, p, True) for p in prompts]
    for v in variants:  # warm-up: kernels built, allocator pools filled
        exact.set_enabled(v[1])
        engine.generate(ids[0], options=make_options(mode=v[0], max_tokens=8))
    for i, p in enumerate(prompts):
        k = i % len(variants)
        for mode, on in variants[k:] + variants[:k]:
            exact.set_enabled(on)
            mx.clear_cache()
            t0 = time.perf_counter()
            res = engine.generate(ids[i], options=make_options(mode=mode, max_tokens=p.max_tokens or args.max_tokens))
            seconds[mode, on] += time.perf_counter() - t0
            tokens[mode, on] += len(res.tokens)
            outputs[i, mode, on] = list(res.tokens)
        so_far = {v: tokens[v] / seconds[v] for v in variants}
        print(f"prompt {i + 1}/{len(prompts)} ({p.domain}): on/off so far plain "
              f"{so_far['plain', True] / so_far['plain', False]:.3f}, auto "
              f"{so_far['auto', True] / so_far['auto', False]:.3f}", file=sys.stderr, flush=True)
    rate = {v: tokens[v] / seconds[v] for v in variants}
    for v in variants:
        print(f"{v[0]:5s} bitwise {'on ' if v[1] else 'off'}: {tokens[v]} tokens in {seconds[v]:.1f} s, "
              f"{rate[v]:.2f} tokens/s")
    for mode in ("plain", "auto"):
        print(f"{mode}: bitwise on / off = {rate[mode, True] / rate[mode, False]:.3f} (tokens/s ratio)")
    for on in (False, True):
        print(f"auto / plain, bitwise {'on ' if on else 'off'}: {rate['auto', on] / rate['plain', on]:.3f}")
        diverged = [i for i in range(len(prompts)) if outputs[i, "auto", on] != outputs[i, "plain", on]]
        print(f"  auto differs from plain on {len(diverged)} of {len(prompts)} prompts {diverged}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
