"""The built-in calibration text: the verifier's greedy answers to the built-in training prompts.

A drafter only ever drafts answers, so the text that compression is tuned and
judged on (converters/coreml_calibrate.py) is answers, not prompts: measured on
the shipped drafter, tuning on prompts alone raised greedy agreement on held-back
prompts to 0.976 (int4) while agreement on held-out answers stayed at 0.925.

The file (`edgespec/data/calibration_answers.jsonl`, one {"domain", "prompt",
"answer"} per distinct built-in training prompt, in the prompt file's order) is made once
from a distillation data folder built on the built-in prompts:

    python -m edgespec.converters.distill.calibration_text DATA_FOLDER [--out FILE]
    python -m edgespec.converters.distill.calibration_text HELDOUT_DATA_FOLDER --heldout

(the second makes `calibration_answers_heldout.jsonl` from data built on the
held-out prompts: text to measure compression on, never to tune on).

Each example's prompt ids are matched to the prompt that produced them, and the
first (greedy) answer of each prompt is decoded to text; the file is plain text,
so any verifier's tokenizer can encode it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from edgespec.converters.distill.data import load_dataset
from edgespec.converters.distill.prompts import (
    BUILTIN_HELDOUT,
    builtin_path,
    encode_item,
    jsonl_rows,
    read_prompts,
)

from edgespec.weights.default_model import load_default
from edgespec.weights.loader import load

CALIBRATION_ANSWERS = "calibration_answers.jsonl"
# The same for the held-out prompts: text for measuring compression only (tests, benchmarks),
# never for tuning.
HELDOUT_ANSWERS = "calibration_answers_heldout.jsonl"


def answers_from_data(folder: str | Path, tokenizer, items=None, max_prompt: int = 384) -> list[dict]:
    """-> one row per distinct prompt of `items` (default: the built-in training prompts):
    its greedy answer in the data folder `folder`, as text."""
    items = read_prompts() if items is None else items
    # Only chat prompts have answers; the built-in file repeats a few prompts.
    items = list({it.text: it for it in items if it.kind == "prompt"}.values())
    by_ids = {tuple(encode_item(tokenizer, it, max_prompt)): n for n, it in enumerate(items)}
    answers: dict[int, str] = {}
    for ex in load_dataset(folder)[1]:
        n = by_ids.get(tuple(int(t) for t in ex.tokens[: ex.start]))
        if n is not None and n not in answers:  # the first example of a prompt is its greedy answer
            answers[n] = tokenizer.decode(ex.tokens[ex.start :].tolist(), skip_special_tokens=True)
    missing = [items[n].text[:40] for n in range(len(items)) if n not in answers]
    if missing:
        raise ValueError(f"{folder}: no answer for {len(missing)} prompts (first: {missing[0]!r})")
    return [
        {"domain": it.domain, "prompt": it.text, "answer": answers[n].strip()} for n, it in enumerate(items)
    ]


def read_answers(path: str | Path | None = None) -> list[dict]:
    """The rows of a calibration answers file (default: the built-in one)."""
    path = builtin_path(CALIBRATION_ANSWERS) if path is None else Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such calibration answers file")
    rows = []
    for n, row in jsonl_rows(path):
        if not isinstance(row, dict) or not row.get("prompt") or not isinstance(row.get("answer"), str):
            raise ValueError(f"{path}:{n}: each line needs 'prompt' and 'answer' (text)")
        rows.append(row)
    if not rows:
        raise ValueError(f"{path}: holds no answers")
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("data", help="distillation data folder built on the built-in training prompts")
    p.add_argument("--model", default=None, help="the verifier bundle it was built with (default model)")
    p.add_argument("--out", default=None, help="output JSONL (default: the package's built-in file)")
    p.add_argument("--heldout", action="store_true",
                   help="DATA was built on the built-in held-out prompts: write the held-out file")  # fmt: skip
    args = p.parse_args(argv)

    # The default model's tokenizer: its bundle when converted, else its GGUF (the same tokenizer).
    loaded = load(args.model, verify_hashes=False) if args.model else load_default(progress=False, verify_hashes=False)
    tokenizer = loaded.tokenizer
    items = read_prompts(builtin_path(BUILTIN_HELDOUT)) if args.heldout else None
    rows = answers_from_data(args.data, tokenizer, items)
    out = Path(args.out) if args.out else builtin_path(HELDOUT_ANSWERS if args.heldout else CALIBRATION_ANSWERS)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    tmp.replace(out)
    print(f"wrote {out}: {len(rows)} answers")
    return 0


if __name__ == "__main__":
    sys.exit(main())
