"""Structured output on the default model: what constraining costs, what the forced-token source wins.

    python benchmarks/structured.py [--model PATH] [--max-tokens 96] [--out FILE.json]

One run, side by side, greedy, on schema-constrained extraction prompts (the
schemas of tests/structured_cases.py, the ones with the most fixed structure
first):

- tokens/s of plain constrained decoding vs auto (the adaptive decoder with the
  forced-token source among its sources) and auto with the forced source alone;
  every constrained reply is checked identical across the three and valid
  (`jsonschema`);
- mask cost per token: host seconds spent in the grammar processor (matcher
  fork, bitmask, mask upload) per processed row, against a plain unconstrained
  step of the same model;
- schema compile time: first use (a schema never seen) and cached (the same
  schema again), plus building llguidance's tokenizer once per tokenizer;
- the same prompts unconstrained (plain), for contrast: how many replies parse
  as JSON and validate against the schema.

The machine may be shared: the figures are ratios of runs made together, and
indicative only.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

ORDER = ["many_fields", "invoice", "event", "recipe", "array_of_objects", "deep_nested", "ref_twice",
         "anyof_objects", "nested_anyof_ref", "person", "classification", "ref_defs"]


def validate(text: str, schema: dict) -> tuple[bool, bool]:
    """(parses as JSON, validates against the schema)."""
    import jsonschema

    try:
        doc = json.loads(text)
    except ValueError:
        return False, False
    try:
        jsonschema.validate(doc, schema)
    except jsonschema.ValidationError:
        return True, False
    return True, True


def main() -> int:
    from structured_cases import SCHEMAS, prompt_for

    import edgespec
    from edgespec.logits import processors
    from edgespec.logits.structured import ll_tokenizer, parse_response_format

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="bundle/GGUF (default: the default model)")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    args = ap.parse_args()

    engine = edgespec.load(args.model, drafter="none", progress=False, history="off")
    V = engine.model.args.vocab_size
    cases = {n: (s, t) for n, s, t in SCHEMAS}
    picked = [(n, *cases[n]) for n in ORDER]

    # ---- compile times
    t0 = time.perf_counter()
    ll_tokenizer(engine.tokenizer, V)
    tok_s = time.perf_counter() - t0
    first, cached = [], []
    for i, (_, schema, _) in enumerate(picked):
        fresh = dict(schema, description=f"benchmark run {time.time()} {i}")  # never compiled before
        t0 = time.perf_counter()
        parse_response_format(fresh).matcher(engine.tokenizer, V)
        first.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        parse_response_format(dict(fresh)).matcher(engine.tokenizer, V)
        cached.append(time.perf_counter() - t0)

    # ---- the mask's host time, counted inside the grammar processor
    spent = {"s": 0.0, "rows": 0}
    real_process = processors.GrammarProcessor.process

    def timed(self, logits, committed, paths):
        t = time.perf_counter()
        out = real_process(self, logits, committed, paths)
        spent["s"] += time.perf_counter() - t
        spent["rows"] += sum(p is not None for p in paths)
        return out

    processors.GrammarProcessor.process = timed

    def run(mode, rf, **kw):
        toks, secs, res = 0, 0.0, []
        for _name, schema, text in picked:
            r = engine.generate(messages=prompt_for(text), max_tokens=args.max_tokens, mode=mode,
                                response_format=schema if rf else None, **kw)
            toks += r.stats.generated_tokens
            secs += r.stats.decode_s
            res.append(r)
        return toks / secs, res

    # warm-up (first passes, cost curve) then the measured runs, interleaved
    run("plain", True)
    run("auto", True)
    spent.update(s=0.0, rows=0)
    plain_tps, plain = run("plain", True)
    mask_per_row = spent["s"] / max(spent["rows"], 1)
    auto_tps, auto = run("auto", True)
    forced_tps, forced = run("auto", True, sources="forced")
    free_tps, free = run("plain", False)
    free_step = 1.0 / free_tps
    free_auto_tps, _ = run("auto", False)
    processors.GrammarProcessor.process = real_process

    same = all(a.tokens == p.tokens == f.tokens for a, p, f in zip(auto, plain, forced, strict=True))
    valid = [validate(r.text, s)[1] for r, (_, s, _) in zip(plain, picked, strict=True)]
    free_ok = [validate(r.text, s) for r, (_, s, _) in zip(free, picked, strict=True)]
    acc = {}
    for r in auto:
        for k, v in r.stats.accepted_by_source.items():
            acc[k] = acc.get(k, 0) + v
    fig = {
        "prompts": len(picked),
        "plain_constrained_tok_s": plain_tps,
        "auto_constrained_tok_s": auto_tps,
        "auto_forced_only_tok_s": forced_tps,
        "auto_vs_plain_constrained": auto_tps / plain_tps,
        "forced_only_vs_plain_constrained": forced_tps / plain_tps,
        "auto_tokens_per_pass": sum(r.stats.generated_tokens for r in auto) / sum(r.stats.verifier_passes for r in auto),
        "auto_accepted_by_source": acc,
        "identical_greedy_outputs": same,
        "constrained_valid": f"{sum(valid)}/{len(valid)}",
        "mask_host_s_per_row": mask_per_row,
        "plain_free_step_s": free_step,
        "mask_cost_vs_plain_step": mask_per_row / free_step,
        "plain_unconstrained_tok_s": free_tps,
        "auto_unconstrained_tok_s": free_auto_tps,
        "unconstrained_parse_json": f"{sum(p for p, _ in free_ok)}/{len(free_ok)}",
        "unconstrained_valid": f"{sum(v for _, v in free_ok)}/{len(free_ok)}",
        "compile_first_ms_median": 1e3 * sorted(first)[len(first) // 2],
        "compile_first_ms_max": 1e3 * max(first),
        "compile_cached_ms_median": 1e3 * sorted(cached)[len(cached) // 2],
        "llguidance_tokenizer_build_ms": 1e3 * tok_s,
    }
    for k, v in fig.items():
        print(f"{k:34s} {v:.4g}" if isinstance(v, float) else f"{k:34s} {v}")
    print("\nunconstrained replies (plain, greedy), for contrast:")
    for (name, _, _), r, (p, v) in zip(picked, free, free_ok, strict=True):
        print(f"  {name:18s} json={'y' if p else 'n'} valid={'y' if v else 'n'}  {r.text[:70]!r}")
    if args.out:
        Path(args.out).write_text(json.dumps(fig, indent=2))
    return 0 if same and all(valid) else 1


if __name__ == "__main__":
    sys.exit(main())
