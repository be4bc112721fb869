"""Prompt sets for distillation: built-in (shipped JSONL) or the user's own file.

A prompt file is JSONL with one object per line: {"prompt": str, "domain": str?}
(the verifier answers it through its chat template) or {"text": str, "domain": str?}
(raw text the verifier only scores, teacher-forced: use it for a domain drafter
trained on your own documents). A .txt file holds one prompt per non-empty line.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

BUILTIN_TRAIN = "distill_prompts.jsonl"
BUILTIN_HELDOUT = "distill_prompts_heldout.jsonl"


@dataclass(frozen=True)
class PromptItem:
    text: str
    domain: str = "user"
    kind: str = "prompt"  # "prompt": chat-templated, verifier generates; "text": scored as is


def builtin_path(name: str = BUILTIN_TRAIN) -> Path:
    return Path(str(resources.files("edgespec.data") / name))


def jsonl_rows(path: Path):
    """(line number, parsed value) for each non-blank line; bad JSON is an error naming file:line."""
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            yield n, json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: invalid JSON ({e})") from None


def read_prompts(path: str | Path | None = None) -> list[PromptItem]:
    """Items of a prompt file; None = the built-in training set."""
    path = builtin_path() if path is None else Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such prompt file (JSONL with 'prompt' or 'text', or .txt)")
    items: list[PromptItem] = []
    if path.suffix == ".txt":
        for line in path.read_text().splitlines():
            if line.strip():
                items.append(PromptItem(line.strip()))
        return items
    for n, row in jsonl_rows(path):
        if not isinstance(row, dict) or not (("prompt" in row) ^ ("text" in row)):
            raise ValueError(f"{path}:{n}: each line needs exactly one of 'prompt' or 'text'")
        kind = "prompt" if "prompt" in row else "text"
        items.append(PromptItem(str(row[kind]), str(row.get("domain", "user")), kind))
    if not items:
        raise ValueError(f"{path}: holds no prompts")
    return items


def encode_item(tokenizer, item: PromptItem, max_len: int) -> list[int]:
    """Token ids the verifier starts from (prompts get the chat template), cut to max_len."""
    if item.kind == "prompt":
        ids = tokenizer.encode_chat([{"role": "user", "content": item.text}])
    else:
        ids = tokenizer.encode(item.text)
    return ids[-max_len:] if item.kind == "prompt" else ids[:max_len]
