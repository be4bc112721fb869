"""Greedy `auto` against `plain` on JSON schemas, repeated, with the runtime exactness guard on.

    LD_PRELOAD=$(make -s preload) python benchmarks/exact_schemas.py --repeats 20 [--seeded] [--schema FILE.json ...]

The cases are the suite's structured-output schemas (tests/structured_cases.py), any --schema
files (each a JSON schema; its prompt from --prompt or a generic one), and the schema of issue
42's reported miss (benchmarks/schemas/, with its prompt). Each schema is decoded once in
plain (on an engine of its own) and then `repeats` times in auto: each round a fresh engine
(history and the prefix cache on, as a server runs) decodes every schema in turn, the reported
schema last, so that its run follows the other schemas' requests as in the report and auto's
history holds earlier replies of other schemas, never plain's reply of the same one. Every
emitted token is checked by the guard (edgespec.logits.exactness); with --seeded the auto
runs use SeededPolicy(round) instead of the timed choices. With --concurrent N, N requests are in
flight at once (the batch decodes them together). With --shared, each auto run follows a plain run of
the same schema on its engine. The guard also replays every request from empty caches when it
ends (keys and values restored or packed for the wrong tokens fail there). Prints one line per
divergence or guard failure (with plain's log-probs there) and a summary; exit 1 on any.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="bundle or GGUF (default: the default model)")
    ap.add_argument("--repeats", type=int, default=20, help="auto runs per schema")
    ap.add_argument("--seeded", action="store_true", help="auto's decisions from SeededPolicy(repeat)")
    ap.add_argument("--schema", action="append", default=[], help="an extra JSON-schema file")
    ap.add_argument("--prompt", default="Describe it as JSON.", help="the prompt of the extra schemas")
    ap.add_argument("--history", default="memory", choices=("memory", "off"), help="auto's history source")
    ap.add_argument("--keep-engine", action="store_true",
                    help="one auto engine for every round (default: a fresh one per round, so that each "
                         "schema's run sees the earlier schemas' requests of its round only)")
    ap.add_argument("--shared", action="store_true",
                    help="each auto run right after a plain run of the same schema on the same engine (as a "
                         "harness comparing modes on one loaded model would): auto's prefix cache then holds "
                         "plain's blocks and its history plain's reply")
    ap.add_argument("--concurrent", type=int, default=1,
                    help="auto requests in flight at once (decoded together in the engine's batch)")
    ap.add_argument("--only", type=int, default=0, help="the first N cases only (0: all)")
    ap.add_argument("--max-tokens", type=int, default=192, help="tokens per reply")
    args = ap.parse_args(argv)

    from structured_cases import SCHEMAS

    import edgespec
    from edgespec.adaptive.policy import SeededPolicy

    here = Path(__file__).resolve().parent / "schemas"
    reported = [("kb_480_job_condition", json.loads((here / "kb_480_job_condition.json").read_text()),
                 "Describe a Kubernetes job condition as JSON saying the job is Complete with status True.")]
    extra = [(Path(f).stem, json.loads(Path(f).read_text()), args.prompt) for f in args.schema]
    cases = list(SCHEMAS) + extra
    if args.only:
        cases = cases[: max(args.only - 1, 0)]
    cases += reported  # last, after the others' requests, as in the report
    if args.model is None:
        from edgespec.converters.default_model import default_bundle_path

        args.model = default_bundle_path(progress=False)
    # Plain's replies from an engine of their own, so that auto's history never holds them.
    ref = edgespec.load(args.model, progress=False, history="off")
    plains = {}
    for name, schema, prompt in cases:
        plains[name] = ref.chat([{"role": "user", "content": prompt}], response_format=_rf(name, schema),
                                temperature=0, max_tokens=args.max_tokens, mode="plain", logprobs=2)
    del ref
    t0, runs, bad = time.time(), 0, 0
    eng = None
    for r in range(args.repeats):
        if eng is None or not args.keep_engine:
            eng = edgespec.load(args.model, progress=False, history=args.history)
            eng.check_exact = True  # every emitted token checked (edgespec.logits.exactness)
        eng.policy = SeededPolicy(r) if args.seeded else None

        def one(case, r=r, eng=eng):
            """None when auto's reply equals plain's, else what to print."""
            name, schema, prompt = case
            plain = plains[name]
            msgs = [{"role": "user", "content": prompt}]
            try:
                if args.shared:
                    eng.chat(msgs, response_format=_rf(name, schema), temperature=0, max_tokens=args.max_tokens,
                             mode="plain")
                got = eng.chat(msgs, response_format=_rf(name, schema), temperature=0,
                               max_tokens=args.max_tokens, mode="auto")
            except AssertionError as e:  # the guard (ExactnessError): a token plain would not emit
                return f"GUARD {name} round {r}: {e}"
            if got.tokens == plain.tokens:
                return None
            k = next((i for i, (a, b) in enumerate(zip(plain.tokens, got.tokens, strict=False)) if a != b),
                     min(len(plain.tokens), len(got.tokens)))
            top = plain.logprobs[k].top if k < len(plain.logprobs) else None
            return (f"DIFF {name} round {r} at token {k}: plain {plain.tokens[k:k + 1]} auto {got.tokens[k:k + 1]} "
                    f"(plain's top there: {top}; {eng.policy.describe() if args.seeded else ''})")

        if args.concurrent > 1:  # requests decoded together in the engine's batch
            with ThreadPoolExecutor(args.concurrent) as pool:
                outcomes = list(pool.map(one, cases))
        else:
            outcomes = [one(c) for c in cases]
        runs += len(outcomes)
        for line in outcomes:
            if line is not None:
                bad += 1
                print(line, flush=True)
        print(f"round {r}: {len(cases)} schemas, {runs} auto runs so far, {bad} differ, {time.time() - t0:.0f} s",
              flush=True)
    eng.policy = None
    print(f"{len(cases)} schemas, {runs} auto runs, {bad} differ from plain, {time.time() - t0:.0f} s")
    return 1 if bad else 0


def _rf(name: str, schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}


if __name__ == "__main__":
    sys.exit(main())
