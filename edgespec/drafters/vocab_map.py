"""The reduced-vocabulary map of a distilled or feature drafter (vocab_map.json): for each
reduced slot the full token id, slot 0 = "other" (every token outside the kept set)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

VOCAB_MAP = "vocab_map.json"
FORMAT = "edgespec-reduced-vocab"
OTHER = 0  # reduced slot that stands for every token outside the kept set


def is_distilled_folder(path: str | Path) -> bool:
    return (Path(path) / VOCAB_MAP).is_file()


class VocabMap:
    """Maps between full and reduced ids. ids: (N,) full id per reduced slot, ids[0] = -1."""

    def __init__(self, ids, full_vocab_size: int):
        self.ids = np.asarray(ids, np.int64)
        if self.ids[0] != -1 or len(set(self.ids[1:].tolist())) != len(self.ids) - 1:
            raise ValueError("vocab map must start with -1 (other) and hold distinct ids")
        if self.ids[1:].min() < 0 or self.ids[1:].max() >= full_vocab_size:
            raise ValueError(f"vocab map ids must lie in 0..{full_vocab_size - 1}")
        self.full_vocab_size = int(full_vocab_size)
        self.to_reduced = np.full(full_vocab_size, OTHER, np.int32)  # (V,)
        self.to_reduced[self.ids[1:]] = np.arange(1, len(self.ids), dtype=np.int32)

    @property
    def size(self) -> int:
        return len(self.ids)

    def digest(self) -> str:
        """sha256 of the slot -> full id table: identifies the map in manifests."""
        return hashlib.sha256(json.dumps(self.ids.tolist(), separators=(",", ":")).encode()).hexdigest()

    def expand_logits(self, logits: np.ndarray) -> np.ndarray:
        """(..., N) reduced logits -> (..., V) full ones: -inf outside the kept set ("other" included)."""
        full = np.full(logits.shape[:-1] + (self.full_vocab_size,), -np.inf, np.float32)
        full[..., self.ids[1:]] = logits[..., 1:]
        return full

    def coverage(self, ids: np.ndarray) -> float:
        """Fraction of `ids` (full) inside the kept set."""
        ids = np.asarray(ids)
        return float((self.to_reduced[ids] != OTHER).mean()) if ids.size else 1.0

    def save(self, folder: str | Path, vocab_hash: str | None = None) -> None:
        """Write vocab_map.json; `vocab_hash` (the tokenizer's) lets loaders check the verifier."""
        data = {"format": FORMAT, "full_vocab_size": self.full_vocab_size, "vocab_hash": vocab_hash, "ids": self.ids.tolist()}
        (Path(folder) / VOCAB_MAP).write_text(json.dumps(data, separators=(",", ":")))

    @classmethod
    def load(cls, folder: str | Path) -> VocabMap:
        path = Path(folder) / VOCAB_MAP
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: unreadable vocab map ({e})") from None
        if data.get("format") != FORMAT:
            raise ValueError(f"{path}: not an edgespec reduced-vocab map (format {data.get('format')!r})")
        return cls(data["ids"], data["full_vocab_size"])
