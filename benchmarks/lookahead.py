"""Plain vs lookahead vs prompt lookup, side by side in one run, on the default model.

    export LD_PRELOAD=$(make -s preload)  # Linux CPU
    python benchmarks/lookahead.py [--max-tokens 96] [--repeats 2] [--window 4 --ngram 4 --guesses 4]
                                   [--memory-context 2048] [--json out.json]

Greedy decoding; every mode's output is checked equal to plain's. Reports tokens/s,
tokens per verifier pass and peak memory per prompt and mode, then the peak memory of
plain vs lookahead at a long (default 2k-token) context. Modes run interleaved,
`--repeats` rounds, and each keeps its best tokens/s: on a shared machine the best
round is the one least disturbed by other processes.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

CODE = """def load_rows(path):
    rows = []
    f = open(path)
    for line in f.readlines():
        line = line.strip()
        if line == "":
            continue
        parts = line.split(",")
        rows.append({"name": parts[0], "age": int(parts[1]), "city": parts[2]})
    f.close()
    return rows


def adults(rows):
    out = []
    for r in rows:
        if r["age"] >= 18:
            out.append(r)
    return out
"""

TEXT = (
    "The town council met on Tuesday to discuss the future of the old railway station. "
    "Some members want to turn the building into a public library with a small cafe, "
    "while others prefer to sell it to a private company that plans to open a hotel. "
    "The library plan would cost the town about two million dollars over five years, "
    "but supporters say it would bring families and students into the centre. "
    "The hotel plan would bring money at once and create around forty jobs. "
    "The council will hold a public meeting next month before it votes in June."
)

PROMPTS = [
    (
        "copy: edit text",
        "copy",
        f"Rewrite the following text exactly, but replace every 'town' with 'city':\n\n{TEXT}",
    ),
    (
        "copy: refactor code",
        "copy",
        f"Refactor this Python code to use a with-statement for the file, and keep everything else the same. Return the full code.\n\n{CODE}",
    ),
    (
        "copy: summarize",
        "copy",
        f"Summarize the following text, quoting its key sentences:\n\n{TEXT}",
    ),
    ("chat: tips", "chat", "What are three easy ways to save energy at home?"),
    ("chat: story", "chat", "Tell me a short story about a cat who learns to swim."),
]

MODES = ["plain", "lookahead", "prompt_lookup"]


def run_one(engine, messages, mode, max_tokens, extra):
    res = engine.generate(
        messages=messages,
        max_tokens=max_tokens,
        mode=mode,
        **(extra if mode == "lookahead" else {}),
    )
    s = res.stats
    return res.tokens, {
        "tokens": s.generated_tokens,
        "tok_s": s.tokens_per_s,
        "tok_per_pass": s.tokens_per_pass or 0.0,
        "peak_mb": s.peak_memory_bytes / 2**20,
        "notes": list(s.notes),
    }


def memory_check(engine, context: int, extra) -> dict:
    """Peak memory of plain vs lookahead decoding 32 tokens after a `context`-token prompt."""
    filler = (TEXT + "\n\n" + CODE + "\n\n") * 40
    ids = engine.tokenizer.encode(filler)[: context - 40]
    out = {}
    for mode in ("plain", "lookahead"):
        res = engine.generate(
            ids, max_tokens=32, mode=mode, **(extra if mode == "lookahead" else {})
        )
        out[mode] = res.stats.peak_memory_bytes
    out["extra_pct"] = 100.0 * (out["lookahead"] - out["plain"]) / max(out["plain"], 1)
    out["prompt_tokens"] = len(ids)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default=None, help="model path (default: SmolLM2-135M-Instruct)")
    p.add_argument(
        "--max-tokens", type=int, default=96, help="tokens generated per prompt and mode"
    )
    p.add_argument(
        "--window", type=int, default=None, help="lookahead window W (default: the mode's)"
    )
    p.add_argument("--ngram", type=int, default=None, help="lookahead n-gram size N")
    p.add_argument(
        "--guesses", type=int, default=None, help="lookahead pooled candidates G per step"
    )
    p.add_argument(
        "--span", type=int, default=None, help="length of candidates copied from the text"
    )
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated modes to compare")
    p.add_argument(
        "--repeats", type=int, default=2, help="interleaved rounds per prompt; best tokens/s kept"
    )
    p.add_argument(
        "--prompts", default="", help="comma-separated prompt-name prefixes to run (default all)"
    )
    p.add_argument(
        "--memory-context",
        type=int,
        default=2048,
        help="context for the peak-memory check (0 = skip)",
    )
    p.add_argument("--json", default=None, help="write the raw results to this file")
    args = p.parse_args(argv)

    import edgespec

    engine = edgespec.load(args.model, drafter="none", progress=False)
    extra = {
        k: getattr(args, k)
        for k in ("window", "ngram", "guesses", "span")
        if getattr(args, k) is not None
    }
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    wanted = [w.strip() for w in args.prompts.split(",") if w.strip()]
    engine.generate("Hello", max_tokens=4, mode="plain")  # warm up
    rows, results = [], {}
    for name, _kind, prompt in PROMPTS:
        if wanted and not any(name.startswith(w) for w in wanted):
            continue
        messages = [{"role": "user", "content": prompt}]
        ref, best, equal = None, {}, {}
        for _ in range(max(args.repeats, 1)):
            for mode in modes:
                toks, r = run_one(engine, messages, mode, args.max_tokens, extra)
                ref = toks if ref is None else ref
                equal[mode] = equal.get(mode, True) and toks == ref
                if mode not in best or r["tok_s"] > best[mode]["tok_s"]:
                    best[mode] = r
        for mode in modes:
            r = best[mode]
            r["equal_to_plain"] = equal[mode]
            results[f"{name} | {mode}"] = r
            rows.append((name, mode, r))
            print(f"{name:22s} {mode:14s} {r['tok_s']:6.2f} tok/s  {r['tok_per_pass']:.2f} tok/pass  "
                  f"peak {r['peak_mb']:.0f} MB  equal={r['equal_to_plain']}", file=sys.stderr, flush=True)  # fmt: skip

    print("\n| prompt | mode | tok/s | x plain | tok/pass | peak MB | = plain |")
    print("|---|---|---|---|---|---|---|")
    base = {name: r["tok_s"] for name, mode, r in rows if mode == modes[0]}
    for name, mode, r in rows:
        speed = r["tok_s"] / base[name] if base.get(name) else 0.0
        print(
            f"| {name} | {mode} | {r['tok_s']:.2f} | {speed:.2f} | {r['tok_per_pass']:.2f} | {r['peak_mb']:.0f} | {r['equal_to_plain']} |"
        )
    for kind in ("copy", "chat"):
        names = [n for n, k, _ in PROMPTS if k == kind and n in base]
        for mode in modes[1:]:
            sp = [
                results[f"{n} | {mode}"]["tok_s"] / base[n]
                for n in names
                if f"{n} | {mode}" in results and base[n]
            ]
            if sp:
                print(
                    f"\n{kind}: {mode} mean speed-up x{sum(sp) / len(sp):.2f} (min x{min(sp):.2f})",
                    end="",
                )
    print()
    if args.memory_context:
        t0 = time.perf_counter()
        mem = memory_check(engine, args.memory_context, extra)
        results["memory"] = mem
        print(f"\npeak memory at {mem['prompt_tokens']}-token context: plain {mem['plain'] / 2**20:.1f} MB, "
              f"lookahead {mem['lookahead'] / 2**20:.1f} MB ({mem['extra_pct']:+.2f}%) [{time.perf_counter() - t0:.0f}s]")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
