"""Plain decoding: edgespec vs mlx-lm's generate on the same weights, side by side in one run.

    LD_PRELOAD=$(make -s preload) \
        .venv/bin/python benchmarks/plain_vs_mlxlm.py [--model BUNDLE] [--tokens 128] [--repeats 3]

Both load the bundle's config.json + model.safetensors (HF names, so mlx-lm reads it
as is). Runs alternate edgespec / mlx-lm per repeat so machine noise hits both alike;
the report is the ratio of median decode tokens/s (prefill excluded on both sides).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

PROMPT = "Explain in detail how a bicycle works, part by part."


def edgespec_run(engine, ids, n):
    from edgespec.generate import GenerationStats
    from edgespec.logits.sampling import Sampler
    from edgespec.modes import make_mode
    from edgespec.options import GenerateOptions

    opts = GenerateOptions()
    steps = make_mode("plain", engine, opts).steps(ids, Sampler(opts.sampling), GenerationStats())
    first = next(steps)  # prefill + first token
    t0 = time.perf_counter()
    toks = [first.id] + [next(steps).id for _ in range(n - 1)]
    dt = time.perf_counter() - t0
    steps.close()
    return toks, (n - 1) / dt


def mlxlm_run(model, ids, n):
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    gen = generate_step(mx.array(ids), model, max_tokens=n)
    first, _ = next(gen)
    t0 = time.perf_counter()
    toks = [int(first)] + [int(next(gen)[0]) for _ in range(n - 1)]
    dt = time.perf_counter() - t0
    gen.close()
    return toks, (n - 1) / dt


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="bundle folder (default: the default model's bundle)")
    ap.add_argument("--tokens", type=int, default=128, help="tokens generated per run")
    ap.add_argument("--repeats", type=int, default=3, help="alternating repeats per implementation")
    ap.add_argument("--json", default=None, help="also write the results to this JSON file")
    args = ap.parse_args(argv)

    from edgespec.converters.default_model import default_bundle_path
    from mlx_lm.utils import load_model
    from tqdm import tqdm

    import edgespec

    bundle = args.model or str(default_bundle_path())
    engine = edgespec.load(bundle, drafter="none", progress=False)
    ref_model, _ = load_model(__import__("pathlib").Path(bundle))
    ids = engine.encode_prompt(messages=[{"role": "user", "content": PROMPT}])
    edgespec_run(engine, ids, 8)  # warm-up both
    mlxlm_run(ref_model, ids, 8)
    ours, theirs, same = [], [], True
    for _ in tqdm(range(args.repeats), desc="repeats", file=sys.stderr):
        a_toks, a = edgespec_run(engine, ids, args.tokens)
        b_toks, b = mlxlm_run(ref_model, ids, args.tokens)
        ours.append(a)
        theirs.append(b)
        same &= a_toks == b_toks
    res = {
        "model": bundle,
        "tokens": args.tokens,
        "edgespec_tok_s": statistics.median(ours),
        "mlx_lm_tok_s": statistics.median(theirs),
        "ratio": statistics.median(ours) / statistics.median(theirs),
        "same_tokens": same,
        "runs": {"edgespec": ours, "mlx_lm": theirs},
    }
    print(f"{'impl':<10} {'tok/s (median)':>15}")
    print(f"{'edgespec':<10} {res['edgespec_tok_s']:>15.2f}")
    print(f"{'mlx-lm':<10} {res['mlx_lm_tok_s']:>15.2f}")
    print(f"ratio edgespec / mlx-lm = {res['ratio']:.3f}; identical greedy tokens: {same}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
