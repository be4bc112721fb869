"""Benchmark prompt sets: the built-in one and users' JSONL files.

One JSON object per line:

    {"prompt": "text", "domain": "code", "max_tokens": 64}
    {"messages": [{"role": "user", "content": "text"}], "domain": "chat"}

Exactly one of "prompt" / "messages"; "domain" (default "default"),
"max_tokens" (default: the bench's --max-tokens) and "id" are optional.
Blank lines are skipped. Every malformed line is reported at once, by line number.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

KEYS = ("prompt", "messages", "domain", "max_tokens", "id")
ROLES = ("system", "user", "assistant")
DEFAULT_DOMAIN = "default"
MAX_LISTED_ERRORS = 20


@dataclass
class BenchPrompt:
    prompt: str | None  # plain text (wrapped as one user turn unless raw), or None
    messages: list[dict] | None  # a chat, or None
    domain: str = DEFAULT_DOMAIN
    max_tokens: int | None = None  # None = the bench-wide default
    id: str = ""
    line: int | None = None  # 1-based line in the source file

    def preview(self, width: int = 48) -> str:
        text = self.prompt if self.prompt is not None else self.messages[-1]["content"]
        text = " ".join(text.split())
        return text if len(text) <= width else text[: width - 3] + "..."


def _check_messages(msgs) -> str | None:
    if not isinstance(msgs, list) or not msgs:
        return '"messages" must be a non-empty list of {"role", "content"} objects'
    for j, m in enumerate(msgs):
        if not isinstance(m, dict) or set(m) != {"role", "content"}:
            return f'"messages"[{j}] must be an object with exactly "role" and "content"'
        if m["role"] not in ROLES:
            return f'"messages"[{j}].role must be one of {", ".join(ROLES)}, got {m["role"]!r}'
        if not isinstance(m["content"], str):
            return f'"messages"[{j}].content must be a string'
    return None


def parse_prompt_line(obj, line: int) -> BenchPrompt:
    """One decoded JSON value -> BenchPrompt; raises ValueError (without the line prefix)."""
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - set(KEYS))
    if unknown:
        raise ValueError(
            f"unknown key(s) {', '.join(map(repr, unknown))}; valid keys: {', '.join(KEYS)}"
        )
    has_p, has_m = "prompt" in obj, "messages" in obj
    if has_p == has_m:
        raise ValueError('give exactly one of "prompt" or "messages"')
    if has_p and (not isinstance(obj["prompt"], str) or not obj["prompt"].strip()):
        raise ValueError('"prompt" must be a non-empty string')
    if has_m and (err := _check_messages(obj["messages"])):
        raise ValueError(err)
    domain = obj.get("domain", DEFAULT_DOMAIN)
    if not isinstance(domain, str) or not domain.strip():
        raise ValueError('"domain" must be a non-empty string')
    mt = obj.get("max_tokens")
    if mt is not None and (not isinstance(mt, int) or isinstance(mt, bool) or mt < 1):
        raise ValueError(f'"max_tokens" must be an integer >= 1, got {mt!r}')
    pid = obj.get("id", "")
    if not isinstance(pid, (str, int)) or isinstance(pid, bool):
        raise ValueError('"id" must be a string or integer')
    return BenchPrompt(
        prompt=obj.get("prompt"),
        messages=obj.get("messages"),
        domain=domain.strip(),
        max_tokens=mt,
        id=str(pid),
        line=line,
    )


def parse_prompts(text: str, source: str = "<prompts>") -> list[BenchPrompt]:
    """Parse JSONL text; raises ValueError listing every bad line as 'SOURCE:LINE: reason'."""
    prompts, errors, bad_lines = [], [], []
    for n, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as e:
            errors.append(f"{source}:{n}: invalid JSON ({e.msg} at column {e.colno})")
            bad_lines.append(n)
            continue
        try:
            prompts.append(parse_prompt_line(obj, n))
        except ValueError as e:
            errors.append(f"{source}:{n}: {e}")
            bad_lines.append(n)
    if errors:
        shown = errors[:MAX_LISTED_ERRORS]
        more = len(errors) - len(shown)
        tail = [f"... and {more} more"] if more else []
        raise ValueError(
            f"{len(errors)} malformed line(s) in {source} (line {', '.join(map(str, bad_lines))}):\n  "
            + "\n  ".join(shown + tail)
        )
    if not prompts:
        raise ValueError(f"{source}: no prompts (expected one JSON object per line)")
    for i, p in enumerate(prompts):
        p.id = p.id or f"{p.domain}-{i + 1}"
    return prompts


def load_prompts(path: str | Path | None = None) -> list[BenchPrompt]:
    """Read a JSONL prompt file, or the built-in set when `path` is None."""
    if path is None:
        text = (
            resources.files("edgespec.data")
            .joinpath("bench_prompts.jsonl")
            .read_text(encoding="utf-8")
        )
        return parse_prompts(text, "bench_prompts.jsonl (built-in)")
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompt file not found: {path}")
    return parse_prompts(path.read_text(encoding="utf-8"), str(path))


def select_prompts(
    prompts: list[BenchPrompt], domains: list[str] | None = None, per_domain: int | None = None
) -> list[BenchPrompt]:
    """Keep the named domains (all if None) and at most `per_domain` prompts of each, in file order."""
    present = list(dict.fromkeys(p.domain for p in prompts))
    if domains:
        missing = [d for d in domains if d not in present]
        if missing:
            raise ValueError(
                f"no prompts in domain(s) {', '.join(missing)}; the prompt set has: {', '.join(present)}"
            )
    if per_domain is not None and per_domain < 1:
        raise ValueError(f"per_domain must be >= 1, got {per_domain}")
    counts: dict[str, int] = {}
    kept = []
    for p in prompts:
        if domains and p.domain not in domains:
            continue
        if per_domain is not None and counts.get(p.domain, 0) >= per_domain:
            continue
        counts[p.domain] = counts.get(p.domain, 0) + 1
        kept.append(p)
    return kept
