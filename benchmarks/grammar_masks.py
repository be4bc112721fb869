"""What a tree's grammar masks cost, and whether they are a fresh matcher's (issue 42).

    LD_PRELOAD=$(make -s preload) python benchmarks/grammar_masks.py [--against REV] [--fuzz SECONDS]

On the default model's tokenizer:

- a matcher copy (`deep_copy`) at growing reply lengths (its cost grows with the reply);
- `GrammarProcessor.process` on a 16-row tree (three chains off one node, `json_object`) at
  50 / 300 / 1,000 / 3,000 reply tokens, best of two 30-call runs; with --against REV the
  processor of that commit is timed in the same process, alternating (`git show
  REV:edgespec/logits/processors.py`, e.g. 6cb351b for the rolling-back one);
- with --fuzz SECONDS, a differential fuzz along plain's reply to the reported schema
  (benchmarks/schemas/kb_480_job_condition.json): random trees near the reply, the sources'
  questions interleaved, every row's mask against a fresh matcher's. It prints the wrong
  masks found per processor (the rolling-back one finds some within a minute or two).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROMPT = "Describe a Kubernetes job condition as JSON saying the job is Complete with status True."


def processor_of(rev: str):
    """GrammarProcessor as commit `rev` wrote it (its module loaded from a temporary file)."""
    src = subprocess.run(["git", "show", f"{rev}:edgespec/logits/processors.py"], cwd=HERE.parent,
                         capture_output=True, text=True, check=True).stdout
    path = Path(tempfile.mkdtemp()) / f"processors_{rev}.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(f"processors_{rev}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod.GrammarProcessor


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--against", default=None, help="also time (and fuzz) the processor of this commit")
    ap.add_argument("--fuzz", type=float, default=0.0, help="seconds of differential fuzz per processor")
    args = ap.parse_args(argv)

    import mlx.core as mx
    import numpy as np
    from edgespec.converters.default_model import default_bundle_path

    import edgespec
    from edgespec.logits.processors import GrammarProcessor
    from edgespec.logits.structured import parse_response_format

    engine = edgespec.load(default_bundle_path(progress=False), progress=False, history="off")
    tok, V = engine.tokenizer, engine.model.args.vocab_size
    procs = {"now": GrammarProcessor}
    if args.against:
        procs[args.against] = processor_of(args.against)

    g = parse_response_format({"type": "json_object"})
    text = '{"items": [' + ", ".join(json.dumps({"name": f"item number {i}", "tags": ["a", "b"], "n": i})
                                     for i in range(400))
    ids = tok.encode(text, add_special_tokens=False)
    m, at = g.matcher(tok, V), 0
    for n in (100, 1000, 3000, 8000):
        m.try_consume_tokens(ids[at:n])
        at = n
        t = time.perf_counter()
        for _ in range(200):
            m.deep_copy()
        print(f"deep_copy at {n} reply tokens: {(time.perf_counter() - t) / 200 * 1e6:.1f} us")

    logits = mx.zeros((16, V))
    for n in (50, 300, 1000, 3000):
        committed, base = ids[:n], ids[n:n + 6]
        paths = [[]] + [base[:j] for j in range(1, 6)]
        for alt in (ids[n + 20:n + 25], ids[n + 40:n + 45]):
            paths += [base[:1] + alt[:j] for j in range(1, 6)]
        best: dict[str, float] = {}
        for _ in range(2):
            for name, cls in procs.items():
                gp = cls(g.matcher(tok, V), V)
                gp.sync(committed)
                t = time.perf_counter()
                for _ in range(30):
                    mx.eval(gp.process(logits, committed, paths))
                best[name] = min(best.get(name, float("inf")), (time.perf_counter() - t) / 30 * 1e3)
        print(f"process, {len(paths)} rows at {n} reply tokens: "
              + ", ".join(f"{k} {v:.2f} ms" for k, v in best.items()))

    if args.fuzz > 0:
        schema = json.loads((HERE / "schemas" / "kb_480_job_condition.json").read_text())
        rf = {"type": "json_schema", "json_schema": {"name": "kb_480_job_condition", "schema": schema}}
        reply = engine.generate(messages=[{"role": "user", "content": PROMPT}], response_format=rf,
                                temperature=0, max_tokens=192, mode="plain").tokens
        g = parse_response_format(rf)
        pool = sorted(set(reply))
        refs: dict[tuple, np.ndarray | None] = {}

        def fresh(path):
            key = tuple(path)
            if key not in refs:
                f = g.matcher(tok, V)
                ok = f.try_consume_tokens(list(path)) == len(path)
                refs[key] = np.unpackbits(np.frombuffer(f.compute_bitmask(), dtype=np.uint8),
                                          bitorder="little")[:V].astype(bool) if ok else None
            return refs[key]

        for name, cls in procs.items():
            rng, t0, checks, wrong = random.Random(0), time.time(), 0, 0
            while time.time() - t0 < args.fuzz:
                gp, c = cls(g.matcher(tok, V), V), 0
                while c < len(reply):
                    committed = reply[:c]
                    paths = []
                    for _ in range(rng.randint(1, 6)):
                        path = reply[c:c + rng.randint(0, 8)] + [rng.choice(pool) for _ in range(rng.randint(0, 4))]
                        paths.append(path)
                        if rng.random() < 0.3:
                            gp.forced(committed, 8)
                        elif rng.random() < 0.3:
                            gp.allowed_prefix(committed, path)
                    rows = np.isfinite(np.array(gp.process(mx.zeros((len(paths), V)), committed, paths)))
                    for row, path in zip(rows, paths, strict=True):
                        want = fresh(committed + path)
                        if want is not None:
                            checks += 1
                            wrong += int(not np.array_equal(row, want))
                    c += rng.randint(1, 6)
            print(f"fuzz {name}: {checks} rows checked, {wrong} wrong masks, {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
