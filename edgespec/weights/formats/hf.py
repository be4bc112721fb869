"""Read a Hugging Face model folder: config.json, *.safetensors, tokenizer files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx

from edgespec.errors import ModelLoadError


def read_config(folder: Path) -> dict[str, Any]:
    path = folder / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"{folder}: no config.json (not a Hugging Face model folder)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path}: invalid JSON ({e})") from None


def read_safetensors(files: list[Path]) -> dict[str, mx.array]:
    weights: dict[str, mx.array] = {}
    for f in files:
        try:
            weights.update(mx.load(str(f)))
        except Exception as e:  # mlx raises RuntimeError/ValueError on malformed files
            raise ModelLoadError(f"{f}: not a readable safetensors file (corrupt or truncated?): {e}") from None
    return weights


def sanitize(weights: dict[str, mx.array], config: dict[str, Any]) -> dict[str, mx.array]:
    """Drop buffers HF checkpoints carry that are not parameters."""
    out = {k: v for k, v in weights.items() if "rotary_emb.inv_freq" not in k}
    if config.get("tie_word_embeddings", False):
        out.pop("lm_head.weight", None)
    return out


def read_hf(folder: str | Path):
    """-> (config, weights as mx arrays)."""
    folder = Path(folder)
    config = read_config(folder)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder}: no *.safetensors weights (only safetensors checkpoints are supported)")
    return config, sanitize(read_safetensors(files), config)
