"""Verifier features for feature-conditioned (EAGLE-style) drafters.

A feature drafter reads the verifier's last hidden state (after the final norm,
the vector the LM head multiplies) at every committed position. Training needs
those features for every position of every distillation sequence; they are a
pure function of the tokens, so they are computed once, teacher-forced, and kept
beside the data: `features-NNNNN.npy` (float16, (sum of lengths, E)) next to each
`shard-NNNNN.npz`, rows in the shard's token order. Each file is written
atomically, so an interrupted run resumes at the first missing shard.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import numpy as np


def hidden_features(model, x: mx.array) -> mx.array:
    """(B, T) ids -> (B, T, E) final-norm hidden states (the LM head's input), causal, no cache."""
    h = model.model.embed_tokens(x)
    mask = "causal" if x.shape[1] > 1 else None
    for layer in model.layers:
        h = layer(h, mask, None, None)
    return model.model.norm(h)


def sequence_features(model, seqs: list[np.ndarray], batch_tokens: int = 4096) -> list[np.ndarray]:
    """Features (L_i, E) float16 of each sequence. Sequences are batched by similar
    length and right-padded: with a causal mask, padding after a sequence cannot
    change its positions."""
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    out: list[np.ndarray | None] = [None] * len(seqs)
    i = 0
    while i < len(order):
        L = len(seqs[order[i]])
        j = i + 1
        while j < len(order) and len(seqs[order[j]]) * (j - i + 1) <= max(batch_tokens, L):
            j += 1
        group = order[i:j]
        Lmax = max(len(seqs[g]) for g in group)
        x = np.zeros((len(group), Lmax), np.int32)
        for b, g in enumerate(group):
            x[b, : len(seqs[g])] = seqs[g]
        f = np.array(hidden_features(model, mx.array(x)).astype(mx.float16))
        for b, g in enumerate(group):
            out[g] = f[b, : len(seqs[g])]
        i = j
    return out  # type: ignore[return-value]


def feature_path(shard: Path) -> Path:
    return shard.with_name(shard.name.replace("shard-", "features-").replace(".npz", ".npy"))


def build_features(model, folder: str | Path, progress: Callable[[int, int], None] | None = None) -> None:
    """Write features-NNNNN.npy for every shard of a finished data folder (skips existing ones)."""
    folder = Path(folder)
    if not (folder / "complete").is_file():
        raise ValueError(f"{folder}: not a finished distillation data folder")
    n = int((folder / "complete").read_text())
    for s in range(n):
        shard = folder / f"shard-{s:05d}.npz"
        path = feature_path(shard)
        if not path.is_file():
            z = np.load(shard)
            lens = z["lens"]
            offs = np.concatenate([[0], np.cumsum(lens)])
            seqs = [z["tokens"][offs[i] : offs[i + 1]] for i in range(len(lens))]
            feats = sequence_features(model, seqs)
            tmp = path.with_name(path.name + ".part.npy")
            np.save(tmp, np.concatenate(feats).astype(np.float16))
            os.replace(tmp, path)
        if progress:
            progress(s + 1, n)


def load_features(folder: str | Path) -> list[np.ndarray]:
    """Per-example features (L, E), in the same order as data.load_dataset(folder)."""
    folder = Path(folder)
    n = int((folder / "complete").read_text())
    out = []
    for s in range(n):
        shard = folder / f"shard-{s:05d}.npz"
        path = feature_path(shard)
        if not path.is_file():
            raise ValueError(f"{path}: missing features (run the feature stage first)")
        lens = np.load(shard)["lens"]
        f = np.load(path, mmap_mode="r")
        if f.shape[0] != int(lens.sum()):
            raise ValueError(f"{path}: {f.shape[0]} feature rows for {int(lens.sum())} tokens (stale or corrupt)")
        offs = np.concatenate([[0], np.cumsum(lens)])
        out += [np.asarray(f[offs[i] : offs[i + 1]]) for i in range(len(lens))]
    return out
