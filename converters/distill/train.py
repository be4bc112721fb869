"""Distillation trainer: KL from the verifier's top-k distribution to the drafter.

Loss per target position: -sum_i p_i log q(x_i) over the verifier's top-k ids x_i,
p renormalised over those k (cross-entropy to the soft targets = KL up to a
constant). Ids outside the reduced vocabulary map to slot "other", so the drafter
also learns how much mass it cannot name.

Exact resume: the batch at step s is a pure function of (seed, s) (a per-epoch
permutation), there is no dropout, and a checkpoint stores weights + optimizer
state (Adam moments, step); resuming from step s therefore replays the same
updates as the uninterrupted run. Checkpoints are one safetensors file replaced
atomically.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from edgespec.converters.distill.data import Example
from mlx.utils import tree_flatten, tree_unflatten

from edgespec.drafters.distilled import VocabMap


@dataclass
class TrainConfig:
    steps: int = 600
    batch_size: int = 8  # sequences per step
    lr: float = 3e-4
    warmup: int = 20
    weight_decay: float = 0.0
    seed: int = 0
    checkpoint_every: int = 25
    max_len: int = 512  # tokens per sequence (longer ones are cut)
    freeze_embedding: bool = False  # keep the verifier's (tied) embedding/head rows fixed


@dataclass
class Prepared:
    """One example in reduced ids with its targets. x (L,), cols (M,), tids/tp (M, k)."""

    x: np.ndarray
    cols: np.ndarray  # positions whose output predicts a target
    tids: np.ndarray
    tp: np.ndarray


def prepare(examples: list[Example], vmap: VocabMap, max_len: int) -> list[Prepared]:
    out = []
    for e in examples:
        L = min(len(e.tokens), max_len)
        n = L - e.start  # targets that fit
        if n <= 0:
            continue
        p = np.exp(e.topk_lp[:n].astype(np.float32))
        out.append(
            Prepared(
                vmap.to_reduced[e.tokens[:L]].astype(np.int32),
                np.arange(e.start - 1, L - 1, dtype=np.int32),
                vmap.to_reduced[e.topk_ids[:n]].astype(np.int32),
                p / p.sum(axis=1, keepdims=True),
            )
        )
    if not out:
        raise ValueError("no training targets (every example is empty or longer prompts than --max-len)")
    return out


def batch_indices(n_examples: int, batch_size: int, seed: int, step: int) -> np.ndarray:
    """Example indices of `step`: walk per-epoch permutations seeded by (seed, epoch)."""
    per_epoch = max(1, n_examples // batch_size)
    epoch, i = divmod(step, per_epoch)
    perm = np.random.default_rng([seed, epoch]).permutation(n_examples)
    return perm[i * batch_size : (i + 1) * batch_size]


def collate(items: list[Prepared]):
    """Right-padded (B, Lmax) inputs; flat gather index (M,) into (B*Lmax); targets (M, k)."""
    Lmax = max(len(it.x) for it in items)
    x = np.zeros((len(items), Lmax), np.int32)
    flat = []
    for b, it in enumerate(items):
        x[b, : len(it.x)] = it.x
        flat.append(b * Lmax + it.cols)
    tids = np.concatenate([it.tids for it in items])
    tp = np.concatenate([it.tp for it in items])
    return mx.array(x), mx.array(np.concatenate(flat)), mx.array(tids), mx.array(tp)


def distill_loss(model, x, flat, tids, tp):
    """Mean over targets of -sum_k p_k log q(id_k). Head runs only on target positions."""
    h = model.model.embed_tokens(x)
    for layer in model.layers:
        h = layer(h, "causal", None, None)
    h = h.reshape(-1, h.shape[-1])[flat]  # (M, E)
    logits = model.head(h[None])[0].astype(mx.float32)  # (M, N)
    logq = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return -(tp * mx.take_along_axis(logq, tids, axis=-1)).sum(axis=-1).mean()


def make_optimizer(cfg: TrainConfig):
    warm = optim.linear_schedule(cfg.lr * 0.01, cfg.lr, max(1, cfg.warmup))
    decay = optim.cosine_decay(cfg.lr, max(1, cfg.steps - cfg.warmup), cfg.lr * 0.1)
    sched = optim.join_schedules([warm, decay], [max(1, cfg.warmup)])
    return optim.AdamW(learning_rate=sched, weight_decay=cfg.weight_decay)


def save_checkpoint(path: Path, model, opt, step: int, cfg: TrainConfig) -> None:
    arrays = {f"w.{k}": v for k, v in tree_flatten(model.parameters())}
    arrays.update({f"o.{k}": v for k, v in tree_flatten(opt.state)})
    tmp = path.with_name(path.name + ".part.safetensors")
    mx.save_safetensors(str(tmp), arrays, metadata={"step": str(step), "config": repr(sorted(asdict(cfg).items()))})
    os.replace(tmp, path)


def load_checkpoint(path: Path, model, opt, cfg: TrainConfig) -> int:
    arrays, meta = mx.load(str(path), return_metadata=True)
    if meta.get("config") != repr(sorted(asdict(cfg).items())):
        raise ValueError(f"{path} was written with other training settings; remove it or use the same ones")
    model.update(tree_unflatten([(k[2:], v) for k, v in arrays.items() if k.startswith("w.")]))
    opt.state = tree_unflatten([(k[2:], v) for k, v in arrays.items() if k.startswith("o.")])
    return int(meta["step"])


def train(
    model,
    data: list[Prepared],
    cfg: TrainConfig,
    checkpoint: str | Path | None = None,
    progress: Callable[[int, int, float], None] | None = None,
    stop_after: int | None = None,
    loss_fn: Callable | None = None,
    make_batch: Callable | None = None,
) -> list[float]:
    """Train `model` in place for cfg.steps (resuming from `checkpoint` if it exists).

    `progress(step, steps, loss)` after every step. `stop_after` ends early after that
    many steps of this call (tests use it to simulate an interruption). Returns the losses.
    `loss_fn(model, *make_batch(items))` defaults to the KL of a reduced-vocab student
    (distill_loss over collate); feature drafters pass their own (feature_train.py).
    """
    if cfg.freeze_embedding:
        model.model.embed_tokens.freeze()
    opt = make_optimizer(cfg)
    step = 0
    ckpt = Path(checkpoint) if checkpoint else None
    if ckpt is not None and ckpt.is_file():
        step = load_checkpoint(ckpt, model, opt, cfg)
    else:
        opt.init(model.trainable_parameters())
    loss_grad = nn.value_and_grad(model, loss_fn or distill_loss)
    make_batch = make_batch or collate
    losses, done_here = [], 0
    while step < cfg.steps:
        idx = batch_indices(len(data), cfg.batch_size, cfg.seed, step)
        loss, grads = loss_grad(model, *make_batch([data[i] for i in idx]))
        opt.update(model, grads)
        mx.eval(model.parameters(), opt.state, loss)
        step += 1
        done_here += 1
        losses.append(float(loss))
        if progress:
            progress(step, cfg.steps, losses[-1])
        if ckpt is not None and (step % cfg.checkpoint_every == 0 or step == cfg.steps):
            save_checkpoint(ckpt, model, opt, step, cfg)
        if stop_after is not None and done_here >= stop_after:
            break
    return losses
