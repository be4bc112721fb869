"""A distilled drafter with a reduced output vocabulary (see `edgespec distill`).

The folder holds config.json + model.safetensors (a small Llama-family model whose
vocab_size is N, the reduced vocabulary) and vocab_map.json: for each reduced slot
the full token id, slot 0 = "other" (every token outside the kept set).

Interface to the speculative engine: inputs are mapped full -> reduced (tokens
outside the set become "other"); the (N,) logits are expanded to the verifier's
full vocabulary V by scattering into a row of -inf, "other" included. So q(x) = 0
for any token the drafter cannot name; the verifier's filtered p is unchanged and
rejection sampling stays exact (the residual max(p - q, 0) covers those tokens).
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np

from edgespec.drafters.base import ModelDrafter
from edgespec.errors import ModelLoadError

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
        import hashlib

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


def check_map_vocabulary(folder: Path, vmap: VocabMap, verifier) -> None:
    """Refuse a drafter folder whose vocab map names another vocabulary than the verifier's
    (size, and tokenizer hash when both sides know theirs). verifier: Engine or LoadedModel."""
    from edgespec.drafters.mlx_drafter import check_vocabulary

    loaded = getattr(verifier, "loaded", verifier)
    d_hash = json.loads((Path(folder) / VOCAB_MAP).read_text()).get("vocab_hash")
    v_hash = (loaded.manifest or {}).get("vocab_hash")
    if v_hash is None and loaded.tokenizer is not None and d_hash:
        v_hash = loaded.tokenizer.vocab_hash()
    check_vocabulary(vmap.full_vocab_size, loaded.model.args.vocab_size, d_hash, v_hash)


class DistilledDrafter(ModelDrafter):
    """ModelDrafter over a reduced-vocab model; speaks full-vocabulary ids and (k, V) q."""

    name = "distilled"

    def __init__(self, model, vocab_map: VocabMap, name: str = "distilled"):
        super().__init__(model)
        if model.args.vocab_size != vocab_map.size:
            raise ModelLoadError(
                f"drafter model has {model.args.vocab_size} output slots but its vocab map {vocab_map.size}"
            )
        self.name = name
        self.device = "gpu" if mx.default_device().type == mx.DeviceType.gpu else "cpu"
        self.vocab_map = vocab_map
        self.vocab_size = vocab_map.full_vocab_size
        self._to_reduced = mx.array(vocab_map.to_reduced)  # (V,) int32
        self._kept = mx.array(vocab_map.ids[1:].astype(np.int32))  # (N-1,) full ids of slots 1..

    def _forward(self, x: mx.array) -> mx.array:
        """x (1, T) full ids -> logits (T, V) over the full vocabulary (-inf where q = 0)."""
        logits = self.model(self._to_reduced[x], self.cache)[0]  # (T, N)
        full = mx.full((logits.shape[0], self.vocab_size), -mx.inf, dtype=logits.dtype)
        full[:, self._kept] = logits[:, 1:]
        return full

    @classmethod
    def load(cls, path: str | Path, verifier=None) -> DistilledDrafter:
        """From a distilled folder; `verifier` (Engine or LoadedModel) checks the vocabulary."""
        from edgespec.loader import load_model_folder

        path = Path(path).expanduser()
        for name in ("config.json", "model.safetensors", VOCAB_MAP):
            if not (path / name).is_file():
                raise ModelLoadError(f"{path}: a distilled drafter folder needs {name}")
        try:
            vmap = VocabMap.load(path)
        except ValueError as e:
            raise ModelLoadError(str(e)) from None
        if verifier is not None:
            check_map_vocabulary(path, vmap, verifier)
        # Weights ship in fp16 (size); the CPU computes fp16 several times slower than
        # fp32 (measured ~3.5x for this drafter), so widen them there.
        on_cpu = mx.default_device().type == mx.DeviceType.cpu
        model = load_model_folder(path, dtype=mx.float32 if on_cpu else None)
        return cls(model, vmap, name=f"distilled:{path.name}")
