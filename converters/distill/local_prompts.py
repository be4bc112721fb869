"""More distillation prompts, built offline from what is on this machine.

Why: with the 284 built-in prompts (answered 4 times each, 105k targets) the
2-layer drafter reached 33% top-1 agreement on its training prompts but 12% on
held-out ones: it learns the topics it saw, not the verifier. Topic variety is
the limit, and no dataset can be downloaded. This module writes a JSONL prompt
file (the `--add-data` format of `edgespec distill`) from:

- code: small functions of the installed Python packages ("Explain what this
  Python function does", "Review this code and suggest improvements"), and
  tasks phrased from their docstrings' first sentences;
- summarization: prose paragraphs of those packages' docstrings and docs;
- translation: short plain sentences of the same prose, into four languages;
- chat: questions from the topic and activity lists below (written for edgespec).

Deterministic for a given set of installed packages (files and items are sorted,
then sampled with a fixed seed).

    python -m edgespec.converters.distill.local_prompts --out prompts.jsonl [--per-domain 400]
"""

from __future__ import annotations

import argparse
import ast
import json
import random
import re
import sys
import sysconfig
from pathlib import Path

from edgespec.converters.distill.prompts import BUILTIN_HELDOUT, builtin_path, read_prompts

CONCEPTS = """photosynthesis; inflation; the water cycle; black holes; compound interest; vaccines; climate change;
machine learning; the immune system; plate tectonics; supply and demand; gravity; electricity; the internet;
democracy; evolution; DNA; the stock market; renewable energy; the French Revolution; the Roman Empire;
quantum computing; blockchain; the human brain; sleep; nutrition; meditation; recycling; the greenhouse effect;
volcanoes; earthquakes; the solar system; the Moon; rainbows; tides; a credit score; a mortgage; taxes;
cloud computing; encryption; a database; an operating system; a compiler; open source software; a budget;
the Renaissance; World War I; the printing press; the Industrial Revolution; the Great Wall of China;
antibiotics; allergies; caffeine; exercise; a healthy breakfast; time zones; the seasons; ocean currents;
bees; coral reefs; rainforests; deserts; glaciers; hurricanes; lightning; magnets; batteries; solar panels;
electric cars; airplanes; submarines; satellites; GPS; smartphones; Wi-Fi; 3D printing; robots; artificial intelligence""".split(";")
ACTIVITIES = """learn to cook; start running; save money; learn a new language; improve my sleep; prepare for a job interview;
write a good resume; make new friends; start a garden; learn to play the piano; reduce my screen time;
organize my closet; plan a trip to Japan; keep houseplants alive; train a puppy; learn to draw; study for exams;
become more productive; start a small business; write a short story; speak in public with confidence;
eat more vegetables; drink more water; learn Python; build a website; take better photos; meditate;
manage my time; give constructive feedback; negotiate a salary; learn to swim; bake bread; paint a room;
fix a flat bicycle tire; back up my computer; choose a laptop; prepare for a marathon; care for a cat;
reduce food waste; read more books; write a thank-you note; plan a birthday party; stay motivated""".split(";")
CHAT_CONCEPT = ["What is {x}?", "Can you explain {x} in simple terms?", "Why is {x} important?",
                "Tell me three interesting facts about {x}.", "How does {x} work?"]
CHAT_ACTIVITY = ["How do I {x}?", "What are some tips to {x}?", "I want to {x}. Where should I start?",
                 "What mistakes should I avoid when I try to {x}?"]
LANGUAGES = ["French", "German", "Spanish", "Italian"]
TRANSLATE = ["Translate to {lang}: {s}", "Translate into {lang}: {s}", 'How do you say "{s}" in {lang}?']
SUMMARIZE = ["Give a short summary of this paragraph:\n{p}", "What are the key points of the following text?\n\n{p}",
             "Summarize in one sentence:\n{p}"]
CODE_SRC = ["Explain what this Python function does:\n```python\n{c}\n```",
            "Review this code and suggest improvements:\n```python\n{c}\n```",
            "Write a docstring for this function:\n```python\n{c}\n```"]
TASK_VERB = re.compile(r"^(Return|Compute|Check|Convert|Create|Find|Parse|Calculate|Generate|Remove|Split|Count|Sort|Build)s?\s")
PLAIN = re.compile(r"^[A-Z][A-Za-z ,'-]+\.$")


def _python_files(roots: list[Path]) -> list[Path]:
    out = []
    for r in roots:
        out += sorted(p for p in r.rglob("*.py") if "test" not in p.name and "/tests/" not in str(p))
    return out


def _harvest(files: list[Path], max_files: int, rng: random.Random):
    """(functions, tasks, paragraphs, sentences) found in a sample of the files."""
    funcs, tasks, paras, sents = [], [], [], []
    for path in rng.sample(files, min(max_files, len(files))):
        try:
            src = path.read_text(encoding="utf-8")
            tree = ast.parse(src)
        except (OSError, UnicodeDecodeError, SyntaxError, ValueError, RecursionError):
            continue
        lines = src.splitlines()
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef | ast.Module):
                continue
            doc = ast.get_docstring(node) or ""
            for block in doc.split("\n\n"):
                text = " ".join(block.split())
                if 200 <= len(text) <= 700 and text.count("`") < 4 and not re.search(r"[>:=]{2}|\|", text):
                    paras.append(text)
                for s in re.split(r"(?<=\.)\s+", text):
                    if 30 <= len(s) <= 110 and PLAIN.match(s):
                        sents.append(s)
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
                first = " ".join(doc.split("\n\n")[0].split())
                if TASK_VERB.match(first) and 25 <= len(first) <= 110 and "`" not in first:
                    verb, rest = first.split(" ", 1)
                    verb = verb.lower().rstrip("s") + "s"
                    tasks.append(f"Write a Python function that {verb} {rest.rstrip('.')}.")
                n = (node.end_lineno or node.lineno) - node.lineno + 1
                if 4 <= n <= 16:
                    body = "\n".join(lines[node.lineno - 1 : node.end_lineno])
                    indent = len(body) - len(body.lstrip())
                    funcs.append("\n".join(x[indent:] for x in body.splitlines()))
    return funcs, tasks, paras, sents


def build(per_domain: int = 400, seed: int = 0, roots: list[Path] | None = None, max_files: int = 4000,
          exclude: set[str] | None = None) -> list[dict]:
    rng = random.Random(seed)
    roots = roots or [Path(sysconfig.get_paths()["purelib"])]
    funcs, tasks, paras, sents = _harvest(_python_files(roots), max_files, rng)
    for xs in (funcs, tasks, paras, sents):
        xs[:] = sorted(set(xs))
    rows: list[dict] = []

    def take(domain: str, make, n: int) -> None:
        seen = {r["prompt"] for r in rows} | (exclude or set())
        out = []
        for _ in range(n * 20):
            if len(out) >= n:
                break
            p = make()
            if p and p not in seen:
                seen.add(p)
                out.append({"domain": domain, "prompt": p})
        rows.extend(out)

    half = per_domain // 2
    take("code", lambda: rng.choice(CODE_SRC).format(c=rng.choice(funcs)) if funcs else None, half)
    take("code", lambda: rng.choice(tasks) if tasks else None, per_domain - half)
    take("summarization", lambda: rng.choice(SUMMARIZE).format(p=rng.choice(paras)) if paras else None, per_domain)
    take("translation", lambda: rng.choice(TRANSLATE).format(lang=rng.choice(LANGUAGES), s=rng.choice(sents))
         if sents else None, per_domain)
    concepts = [c.strip() for c in CONCEPTS if c.strip()]
    acts = [a.strip() for a in ACTIVITIES if a.strip()]
    take("chat", lambda: rng.choice(CHAT_CONCEPT).format(x=rng.choice(concepts)), per_domain - per_domain // 3)
    take("chat", lambda: rng.choice(CHAT_ACTIVITY).format(x=rng.choice(acts)), per_domain // 3)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Write a distillation prompt file from local Python packages' "
                                 "code and docs plus built-in chat topics (see the module docstring).")
    ap.add_argument("--out", required=True, help="JSONL file to write")
    ap.add_argument("--per-domain", type=int, default=400, help="prompts per domain (code, chat, summarization, "
                    "translation)")
    ap.add_argument("--seed", type=int, default=0, help="sampling seed")
    ap.add_argument("--root", action="append", default=None, help="folder to harvest (repeatable; default: this "
                    "Python's site-packages)")
    ap.add_argument("--max-files", type=int, default=4000, help="Python files sampled from the roots")
    args = ap.parse_args(argv)

    held = {i.text for i in read_prompts(builtin_path(BUILTIN_HELDOUT))}
    rows = build(args.per_domain, args.seed, [Path(r) for r in args.root] if args.root else None, args.max_files,
                 exclude=held)
    tmp = Path(args.out + ".part")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tmp.replace(args.out)
    counts = {d: sum(r["domain"] == d for r in rows) for d in sorted({r["domain"] for r in rows})}
    print(f"wrote {len(rows)} prompts to {args.out}: {counts}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
