"""How sure the drafter is, and how often it is right: offline, per domain (docs/adaptive.md).

    LD_PRELOAD=$(make -s preload) python benchmarks/drafter_confidence.py \
        [--prompts benchmarks/prompts/mixed.jsonl] [--per-domain 6] [--max-tokens 96]

The verifier answers each prompt greedily (mode plain); the model's drafter then runs
teacher-forced along prompt + answer (one pass: along an accepted chain a drafter sees exactly
these tokens). Per domain: how often the verifier's token is the drafter's top 1, in its top 2
and top 3, and the top-1 hit rate per bin of the drafter's own probability of its token (the
token buckets of `edgespec.adaptive.sources`). Also the seconds of ranking one position
(`ModelDrafter._rank`) against a softmax over the whole vocabulary.
"""

from __future__ import annotations

import argparse
import bisect
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import mlx.core as mx
import numpy as np

import edgespec
from edgespec.adaptive.sources import SURE_EDGES
from edgespec.drafters.base import ranked_tokens, request_drafter

REPO = Path(__file__).resolve().parent.parent


def teacher_forced(drafter, prompt: list[int], answer: list[int], top: int = 3) -> list[tuple]:
    """(verifier's token, drafter's top ids, their probabilities) at every answer position."""
    drafter.begin(prompt)
    seq = prompt + answer
    off = len(drafter.fed)
    logits = drafter._forward(mx.array(seq[off:], dtype=mx.int32)[None])  # row j predicts seq[off+j+1]
    p = np.array(mx.softmax(logits.astype(mx.float32), axis=-1))
    out = []
    for pos in range(len(prompt), len(seq)):
        row = p[pos - 1 - off]
        ids = np.argsort(-row)[:top]
        out.append((seq[pos], ids.tolist(), row[ids].tolist()))
    return out


def rank_cost(drafter, vocab: int, repeats: int = 200) -> tuple[float, float]:
    """Median ms of the drafter's ranking of one position and of a full-vocabulary ranking."""
    logits = mx.random.normal((vocab,))
    if drafter.vocab_map is not None:  # a reduced-vocabulary drafter: -inf outside its kept ids
        full = mx.full((vocab,), -mx.inf)
        full[drafter._kept] = logits[drafter._kept]
        logits = full
    token = mx.argmax(logits)
    mx.eval(logits, token)

    def ms(fn):
        ts = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            mx.eval(*fn())
            ts.append(time.perf_counter() - t0)
        return 1e3 * float(np.median(ts))

    return ms(lambda: drafter._rank(logits, token, 3)), ms(lambda: ranked_tokens(logits, token, 3))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", default=str(REPO / "benchmarks" / "prompts" / "mixed.jsonl"))
    ap.add_argument("--per-domain", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=96)
    args = ap.parse_args(argv)
    engine = edgespec.load(progress=False, history="off")
    if engine.drafter is None or not engine.drafter.caps.ranks:
        sys.exit("the model's drafter does not rank its tokens (an MLX drafter is needed)")
    drafter = request_drafter(engine.drafter)
    rows = [json.loads(x) for x in Path(args.prompts).read_text().splitlines() if x.strip()]
    taken: dict[str, int] = defaultdict(int)
    recs: dict[str, list] = defaultdict(list)
    for r in rows:
        if taken[r["domain"]] >= args.per_domain:
            continue
        taken[r["domain"]] += 1
        msgs = r.get("messages") or [{"role": "user", "content": r["prompt"]}]
        ids = engine.encode_prompt(messages=msgs)
        answer = engine.generate(ids, max_tokens=args.max_tokens, mode="plain").tokens
        got = teacher_forced(drafter, ids, answer)
        recs[r["domain"]].extend(got)
        recs["all"].extend(got)
    bins = [f"q{i}" for i in range(len(SURE_EDGES) + 1)]
    print(f"{'domain':16s} {'positions':>9s} {'top1':>6s} {'top2':>6s} {'top3':>6s}   top-1 hit rate by the "
          f"drafter's probability (bins {', '.join(bins)}; share of positions / hit rate)")
    for dom, rs in sorted(recs.items(), key=lambda kv: (kv[0] != "all", kv[0])):
        hits = [[t in ids[:n] for t, ids, _ in rs] for n in (1, 2, 3)]
        per_bin = defaultdict(lambda: [0, 0])
        for t, ids, ps in rs:
            b = per_bin[bisect.bisect(SURE_EDGES, ps[0])]
            b[0] += t == ids[0]
            b[1] += 1
        cells = " ".join(f"{per_bin[i][1] / len(rs):.2f}/{per_bin[i][0] / max(per_bin[i][1], 1):.2f}"
                         for i in range(len(bins)))
        print(f"{dom:16s} {len(rs):9d} " + " ".join(f"{np.mean(h):6.3f}" for h in hits) + "   " + cells)
    own, full = rank_cost(drafter, engine.model.args.vocab_size)
    print(f"ranking one position: {own:.3f} ms the drafter's own way, {full:.3f} ms over all "
          f"{engine.model.args.vocab_size} ids")
    return 0


if __name__ == "__main__":
    sys.exit(main())
