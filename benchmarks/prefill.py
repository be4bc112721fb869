"""Prefill: edgespec vs mlx-lm on the same weights and prompt lengths, side by side in one run.

    LD_PRELOAD=$(make -s preload) \\
        .venv/bin/python benchmarks/prefill.py [--model BUNDLE] [--sizes 512,2048,8190] [--repeats 3]

Each run feeds a prompt of N random token ids into fresh caches and times until the
last position's logits are computed (edgespec: `edgespec.generate.prefill`, the path
every mode takes; mlx-lm: `generate_step` up to its first token, i.e. its prefill in
`prefill_step_size` chunks plus one token's logits). Runs alternate edgespec / mlx-lm
so machine noise hits both alike; the report gives median tokens/s per size, the
ratio edgespec / mlx-lm, and each side's rate at the largest size over its rate at
the smallest.

The machine's speed drifts over minutes (a shared host: the same BLAS product has run
at 48 and at 80 GFLOPS a core an hour apart), and the sizes run minutes apart, so the
medians' ratio across sizes moves with it. Each edgespec run at a larger size is
therefore bracketed by runs at the smallest size just before and after it, and the
report also gives, per size, the median over repeats of rate(size) / mean(the two
bracketing rates): the scaling measured back to back.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time


def edgespec_prefill(model, ids) -> float:
    import mlx.core as mx

    from edgespec.generate import prefill

    cache = model.make_cache()
    t0 = time.perf_counter()
    mx.eval(prefill(model, cache, ids))
    return len(ids) / (time.perf_counter() - t0)


def mlxlm_prefill(model, ids) -> float:
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    t0 = time.perf_counter()
    gen = generate_step(mx.array(ids), model, max_tokens=1)
    next(gen)  # prefill + the first token's logits
    dt = time.perf_counter() - t0
    gen.close()
    return len(ids) / dt


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="bundle folder (default: the default model's bundle)")
    ap.add_argument("--sizes", default="512,2048,8190", help="prompt lengths in tokens, comma-separated")
    ap.add_argument("--repeats", type=int, default=3, help="alternating runs per implementation and size")
    ap.add_argument("--json", default=None, help="also write the results to this JSON file")
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]

    from pathlib import Path

    from edgespec.converters.default_model import default_bundle_path
    from mlx_lm.utils import load_model
    from tqdm import tqdm

    import edgespec

    bundle = args.model or str(default_bundle_path())
    engine = edgespec.load(bundle, drafter="none", progress=False, history="off")
    if max(sizes) >= engine.context_length:
        ap.error(f"--sizes: the model's context window is {engine.context_length} tokens")
    ref_model, _ = load_model(Path(bundle))
    rng = random.Random(0)
    V = engine.model.args.vocab_size
    edgespec_prefill(engine.model, [rng.randrange(V) for _ in range(64)])  # warm-up both
    mlxlm_prefill(ref_model, [rng.randrange(V) for _ in range(64)])
    runs: dict[int, dict[str, list[float]]] = {n: {"edgespec": [], "mlx_lm": []} for n in sizes}
    prompts = {n: [rng.randrange(V) for _ in range(n)] for n in sizes}
    lo, hi = min(sizes), max(sizes)
    paired: dict[int, list[float]] = {n: [] for n in sizes if n != lo}  # rate(n) / bracketing rate(lo)
    brackets = 2 * len(paired) * args.repeats
    with tqdm(total=len(sizes) * args.repeats * 2 + brackets, desc="prefill runs", file=sys.stderr) as bar:
        for n, ids in prompts.items():
            for _ in range(args.repeats):
                if n != lo:
                    before = edgespec_prefill(engine.model, prompts[lo])
                    bar.update()
                rate = edgespec_prefill(engine.model, ids)
                runs[n]["edgespec"].append(rate)
                bar.update()
                if n != lo:
                    after = edgespec_prefill(engine.model, prompts[lo])
                    paired[n].append(rate / ((before + after) / 2))
                    bar.update()
                runs[n]["mlx_lm"].append(mlxlm_prefill(ref_model, ids))
                bar.update()
    med = {n: {k: statistics.median(v) for k, v in r.items()} for n, r in runs.items()}
    print(f"{'tokens':>7} {'edgespec tok/s':>15} {'mlx-lm tok/s':>13} {'ratio':>6}")
    for n in sizes:
        e, m = med[n]["edgespec"], med[n]["mlx_lm"]
        print(f"{n:>7} {e:>15.1f} {m:>13.1f} {e / m:>6.2f}")
    scale = {k: med[hi][k] / med[lo][k] for k in ("edgespec", "mlx_lm")}
    print(f"rate at {hi} / rate at {lo}, medians: edgespec {scale['edgespec']:.2f}, mlx-lm {scale['mlx_lm']:.2f}")
    back_to_back = {n: statistics.median(r) for n, r in paired.items()}
    for n, r in paired.items():
        print(f"edgespec rate at {n} / rate at {lo} just before and after it: {back_to_back[n]:.2f} "
              f"(runs: {', '.join(f'{x:.2f}' for x in r)})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": bundle, "repeats": args.repeats, "median_tok_s": med, "runs": runs,
                       "large_over_small": scale, "back_to_back": back_to_back, "back_to_back_runs": paired},
                      f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
