"""The corpus source's table (edgespec.adaptive.corpus) from the verifier's own greedy answers.

`edgespec distill` writes one into every drafter folder it makes (`corpus.bin`, from the
data it generated anyway). This module also builds one alone, as the default model's was:

    python -m edgespec.converters.distill.corpus --out corpus.bin \\
        --data edgespec/data/distill_prompts.jsonl --data local.jsonl \\
        --exclude edgespec/data/bench_prompts.jsonl --exclude benchmarks/prompts/mixed.jsonl

`--data` prompt files (the distill format) are answered greedily by the verifier (batched,
resumable in `--work`: each file's answers are kept there, so a rebuild with other
exclusions generates nothing); `--exclude` files (distill or bench format) name prompts the
corpus must not learn from: the answers to any data prompt sharing over 30% of its word
trigrams with one of them are left out of the table, so a benchmark never measures answers
the table holds.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

from edgespec.converters.distill import data as D
from edgespec.converters.distill.prompts import PromptItem, builtin_path, jsonl_rows, read_prompts

from edgespec.adaptive.corpus import MAGIC, OLD_MAGICS, CorpusTable

OVERLAP = 0.3  # share of the shorter prompt's word trigrams that makes two prompts one
MAX_PROMPT = 384  # prompt tokens kept (distill's default)


def from_examples(examples, vocab_hash: str | None, vocab_size: int | None = None) -> CorpusTable:
    """The table of distillation examples (prompt + the verifier's answer; priors measured on
    the answers, see CorpusTable.build); vocab_size (the verifier's) sets how ids are stored."""
    return CorpusTable.build([e.tokens for e in examples], vocab_hash, starts=[e.start for e in examples],
                             vocab_size=vocab_size)


def _trigrams(text: str) -> set:
    w = re.findall(r"[a-z0-9]+", text.lower())
    return {tuple(w[i : i + 3]) for i in range(len(w) - 2)}


def excluded_texts(path: str | Path) -> list[str]:
    """Prompt texts of a distill-format or bench-format JSONL file (all turns of a chat)."""
    out = []
    for _, row in jsonl_rows(Path(path)):
        if isinstance(row, dict):
            if isinstance(row.get("prompt"), str):
                out.append(row["prompt"])
            elif isinstance(row.get("text"), str):
                out.append(row["text"])
            elif isinstance(row.get("messages"), list):
                out.append(" ".join(str(m.get("content", "")) for m in row["messages"] if isinstance(m, dict)))
    return out


def overlapping(items: list[PromptItem], texts: list[str]) -> set[int]:
    """Indices of the items whose prompt shares more than OVERLAP of the shorter one's word
    trigrams with one of the texts."""
    grams = [g for g in map(_trigrams, texts) if g]
    out = set()
    for i, it in enumerate(items):
        g = _trigrams(it.text)
        if g and any(len(g & b) / min(len(g), len(b)) > OVERLAP for b in grams):
            out.add(i)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m edgespec.converters.distill.corpus",
                                 description="Build the corpus source's table (corpus.bin) from the verifier's "
                                 "greedy answers to prompt files (see the module docstring).")
    ap.add_argument("--verifier", default=None, help="bundle or model folder (default: the default model)")
    ap.add_argument("--out", required=True, help="corpus file to write (an existing file is replaced only if "
                    "it is an edgespec corpus, of this format or an older one)")
    ap.add_argument("--data", action="append", default=[], help="prompt file (repeatable; default: the "
                    "built-in distillation prompts)")
    ap.add_argument("--exclude", action="append", default=[], help="prompt file whose prompts the corpus must "
                    "not learn from (repeatable; distill or bench JSONL)")
    ap.add_argument("--work", default=None, help="folder for the answers (resumable; default: OUT.work)")
    ap.add_argument("--max-new", type=int, default=160, help="tokens per answer")
    ap.add_argument("--batch-size", type=int, default=16, help="prompts answered together")
    a = ap.parse_args(argv)
    out = Path(a.out).expanduser()
    if out.exists() and not _is_corpus(out):
        print(f"error: {out} exists and is not an edgespec corpus file; choose another --out", file=sys.stderr)
        return 2
    files = a.data or [str(builtin_path())]
    try:
        sets = [(Path(f).stem, read_prompts(f)) for f in files]
        texts = [t for f in a.exclude for t in excluded_texts(f)]
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from edgespec.converters.default_model import default_bundle_path

    from edgespec.progress import progress_bar
    from edgespec.weights import loader

    loaded = loader.load(a.verifier or default_bundle_path())
    work = Path(a.work) if a.work else out.with_name(out.name + ".work")
    examples = []
    t0 = time.time()
    for name, items in sets:
        folder = work / f"{name}-{D.items_hash(items)[:8]}"
        with progress_bar(total=len(items), desc=f"answers {name}", unit="prompt") as pb:
            D.build_dataset(loaded, items, folder, a.max_new, 1, a.batch_size, max_prompt=MAX_PROMPT,
                            progress=lambda d, n, pb=pb: pb.update(d - pb.n))
        # Examples come in the plan's order (one per prompt): which item each one answers.
        order = [i for group in D.shard_plan(loaded.tokenizer, items, a.batch_size, MAX_PROMPT) for i, _ in group]
        got = D.load_dataset(folder)[1]
        drop = overlapping(items, texts)
        examples += [e for i, e in zip(order, got, strict=True) if i not in drop]
        print(f"{name}: {len(items) - len(drop)} of {len(items)} prompts kept ({len(drop)} overlap --exclude)",
              file=sys.stderr)
    table = from_examples(examples, loaded.tokenizer.vocab_hash(), loaded.model.args.vocab_size)
    out.parent.mkdir(parents=True, exist_ok=True)
    table.save(out)
    print(json.dumps({"out": str(out), "sequences": len(examples), "tokens": int(sum(len(e.tokens) for e in examples)),
                      "contexts": len(table), "bytes": out.stat().st_size, "priors": len(table.priors),
                      "minutes": round((time.time() - t0) / 60, 1)}))
    return 0


def _is_corpus(path: Path) -> bool:
    """An edgespec corpus file, of this format or an older one (which a rebuild replaces)."""
    try:
        with open(path, "rb") as f:
            return f.read(len(MAGIC)) in (MAGIC, *OLD_MAGICS)
    except OSError:
        return False


if __name__ == "__main__":
    raise SystemExit(main())
