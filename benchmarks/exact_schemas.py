"""Greedy `auto` against `plain` on JSON schemas, repeated, with the runtime exactness guard on.

    LD_PRELOAD=$(make -s preload) python benchmarks/exact_schemas.py --repeats 20 [--seeded] [--schema FILE.json ...]

The cases are the suite's structured-output schemas (tests/structured_cases.py) plus any
--schema files (each a JSON schema; its prompt from --prompt or a generic one). Each schema is
decoded once in plain and `repeats` times in auto on one engine (history and the prefix cache
on, as a server runs), every emitted token checked by the guard (edgespec.logits.exactness); with
--seeded the auto runs use SeededPolicy(repeat) instead of the timed choices. Prints one line
per divergence (with plain's log-probs there) and a summary; exit 1 on any divergence.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="bundle or GGUF (default: the default model)")
    ap.add_argument("--repeats", type=int, default=20, help="auto runs per schema")
    ap.add_argument("--seeded", action="store_true", help="auto's decisions from SeededPolicy(repeat)")
    ap.add_argument("--schema", action="append", default=[], help="an extra JSON-schema file")
    ap.add_argument("--prompt", default="Describe it as JSON.", help="the prompt of the extra schemas")
    ap.add_argument("--max-tokens", type=int, default=192, help="tokens per reply")
    args = ap.parse_args(argv)

    from structured_cases import SCHEMAS

    import edgespec
    from edgespec.adaptive.policy import SeededPolicy

    cases = [(Path(f).stem, json.loads(Path(f).read_text()), args.prompt) for f in args.schema] + list(SCHEMAS)
    if args.model is None:
        from edgespec.converters.default_model import default_bundle_path

        args.model = default_bundle_path(progress=False)
    eng = edgespec.load(args.model, progress=False)
    eng.check_exact = True  # every emitted token checked (edgespec.logits.exactness)
    t0, runs, bad = time.time(), 0, 0
    for name, schema, prompt in cases:
        rf = {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}
        msgs = [{"role": "user", "content": prompt}]
        eng.policy = None
        plain = eng.chat(msgs, response_format=rf, temperature=0, max_tokens=args.max_tokens, mode="plain",
                         logprobs=2)
        for r in range(args.repeats):
            eng.policy = SeededPolicy(r) if args.seeded else None
            got = eng.chat(msgs, response_format=rf, temperature=0, max_tokens=args.max_tokens, mode="auto")
            runs += 1
            if got.tokens != plain.tokens:
                bad += 1
                k = next((i for i, (a, b) in enumerate(zip(plain.tokens, got.tokens, strict=False)) if a != b),
                         min(len(plain.tokens), len(got.tokens)))
                top = plain.logprobs[k].top if k < len(plain.logprobs) else None
                print(f"DIFF {name} run {r} at token {k}: plain {plain.tokens[k:k + 1]} auto {got.tokens[k:k + 1]} "
                      f"(plain's top there: {top})", flush=True)
        print(f"{name}: {args.repeats} runs", flush=True)
    eng.policy = None
    print(f"{len(cases)} schemas, {runs} auto runs, {bad} differ from plain, {time.time() - t0:.0f} s")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
