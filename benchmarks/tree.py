"""Plain vs chain speculation vs static / dynamic / multi-source trees vs cascade, in one run.

    export LD_PRELOAD=$(make -s preload)  # Linux CPU
    python benchmarks/tree.py [--per-domain 1] [--max-tokens 32] [--drop 7] [--json out.json]

The default model (dense fp32 bundle) is the verifier. Chain and tree modes use
the same drafter: self-speculation on the verifier's own layers, dropping the
first `--drop` layers of the cached skip-set search path (or `--drafter PATH`).
The cascade puts the shipped distilled drafter under that self-speculative
mid level. Greedy; every mode's tokens are checked equal to plain's. Modes run
interleaved per prompt; each keeps its best tokens/s over `--repeats`.
Reports tokens/s relative to plain and tokens per verifier pass, by domain.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOMAINS = ("code", "chat", "summarization", "translation")

# label -> (mode, drafter role, extra options)
METHODS = {
    "plain": ("plain", None, {}),
    "chain": ("speculative", "self", {}),
    "static tree": ("tree", "self", {"shape": "static", "branching": "3x2x1x1"}),
    "dynamic tree": ("tree", "self", {"shape": "dynamic"}),
    "multi-source": ("tree", "self", {"shape": "dynamic", "sources": "drafter+prompt_lookup+pool"}),
    "cascade": ("cascade", "tiny", {}),
}


def load_prompts(per_domain: int) -> list[dict]:
    rows = [
        json.loads(x)
        for x in (REPO / "edgespec/data/bench_prompts.jsonl").read_text().splitlines()
        if x.strip()
    ]
    return [r for d in DOMAINS for r in [r for r in rows if r.get("domain") == d][:per_domain]]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--per-domain", type=int, default=1, help="prompts per domain")
    ap.add_argument("--max-tokens", type=int, default=32, help="tokens generated per prompt")
    ap.add_argument(
        "--repeats", type=int, default=1, help="measured runs per (prompt, mode); best kept"
    )
    ap.add_argument(
        "--drop",
        type=int,
        default=7,
        help="self-speculation: layers dropped along the searched path",
    )
    ap.add_argument(
        "--drafter",
        default=None,
        help="tiny drafter folder for the cascade (default: the shipped one)",
    )
    ap.add_argument(
        "--methods",
        default=",".join(METHODS),
        help="comma-separated subset of: " + ", ".join(METHODS),
    )
    ap.add_argument("--json", default=str(REPO / "bench-out" / "tree.json"), help="results path")
    args = ap.parse_args(argv)

    from edgespec.converters.default_model import default_bundle_path

    import edgespec
    from edgespec.drafters import load_drafter, shipped_drafter_path
    from edgespec.drafters.self_spec import SelfSpecDrafter, skip_set_for

    engine = edgespec.load(default_bundle_path(progress=True), drafter="none", progress=False)
    path = skip_set_for(engine.loaded)["path"]
    n = len(engine.model.layers)
    dropped = {layer for layer, _ in path[: args.drop]}
    self_d = SelfSpecDrafter(engine.model, [i for i in range(n) if i not in dropped])
    tiny = load_drafter(engine, args.drafter or str(shipped_drafter_path(engine)))
    drafters = {"self": self_d, "tiny": tiny, None: None}
    print(
        f"self drafter {self_d.name} (dropped {sorted(dropped)}), tiny {tiny.name}", file=sys.stderr
    )
    methods = [m for m in args.methods.split(",") if m]
    mid_layers = "+".join(str(i) for i in self_d.layer_ids)

    def generate(label, ids, max_tokens):
        mode, role, extra = METHODS[label]
        engine.drafter = drafters[role]
        if mode == "cascade":
            extra = dict(extra, mid_layers=mid_layers)
        return engine.generate(ids, max_tokens=max_tokens, mode=mode, **extra)

    prompts = load_prompts(args.per_domain)
    t0 = time.perf_counter()
    warm = engine.encode_prompt(messages=[{"role": "user", "content": "Say hello."}])
    for label in methods:  # calibrations and graph warm-up, unmeasured
        generate(label, warm, 8)
    print(f"warm-up (calibration) {time.perf_counter() - t0:.1f}s", file=sys.stderr)

    rows = []
    for p in prompts:
        ids = engine.encode_prompt(messages=[{"role": "user", "content": p["prompt"]}])
        best, ref = {}, None
        for _ in range(args.repeats):
            for label in methods:
                res = generate(label, ids, args.max_tokens)
                s = res.stats
                if label == "plain":
                    ref = res.tokens
                elif ref is not None and res.tokens != ref:
                    print(f"MISMATCH {label} on {p['id']}", file=sys.stderr)
                    return 3
                if label not in best or s.tokens_per_s > best[label]["tok_s"]:
                    best[label] = {
                        "tok_s": s.tokens_per_s,
                        "per_pass": s.tokens_per_pass or 0.0,
                        "by_source": dict(s.accepted_by_source),
                    }
        for label, b in best.items():
            rows.append({"id": p["id"], "domain": p["domain"], "method": label, **b})
        print(
            f"{p['id']}: " + ", ".join(f"{k} {v['tok_s']:.1f}" for k, v in best.items()),
            file=sys.stderr,
        )

    agg = defaultdict(lambda: defaultdict(list))
    plain = {(r["id"]): r["tok_s"] for r in rows if r["method"] == "plain"}
    for r in rows:
        agg[r["method"]][r["domain"]].append((r["tok_s"] / plain[r["id"]], r["per_pass"]))
    doms = [d for d in DOMAINS if any(d in agg[m] for m in agg)]
    print(
        "| method | "
        + " | ".join(f"{d}: x plain / tok per pass" for d in doms)
        + " | mean x plain |"
    )
    print("|---|" + "---|" * (len(doms) + 1))
    for m in methods:
        cells, means = [], []
        for d in doms:
            v = agg[m].get(d, [])
            x = sum(a for a, _ in v) / len(v)
            tpp = sum(b for _, b in v) / len(v)
            means.append(x)
            cells.append(f"{x:.2f} / {tpp:.2f}")
        print(f"| {m} | " + " | ".join(cells) + f" | {sum(means) / len(means):.2f} |")
    src = defaultdict(int)
    for r in rows:
        if r["method"] == "multi-source":
            for k, v in r["by_source"].items():
                src[k] += v
    print(f"\nmulti-source accepted tokens by source: {dict(src)}")
    cas = engine.memory.cascade_drafters
    for d in cas.values():
        print(
            f"cascade: inner acceptance {d.inner_accepted}/{d.inner_drafted}, drafting runs {d.counts}"
        )
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
