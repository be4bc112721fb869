"""Training a feature drafter (models/feature_drafter.py) on the verifier's own features.

Per position i the drafter reads (x_{i+1}, f_i) and must output g_{i+1} ~ f_{i+1}.
Targets come from the features themselves, so every position of a sequence (prompt
included) is a target: the verifier's distribution over the kept vocabulary,
p = softmax(W f_{i+1}) with W the verifier's head rows of the kept ids. Loss:
cross-entropy of softmax(W g_{i+1}) to p, plus `reg_weight` x smooth-L1(g, f)
(Li et al., EAGLE: regressing the feature keeps later draft steps on track).

Unrolled training ("training-time test"). At draft time only the first step sees
a true feature; step s reads the drafter's own guess from step s-1, and attends to
true entries before the round plus its own earlier guesses. `unroll` S trains
exactly that: step s's input at i is step (s-1)'s output at i-1, and a boolean
mask over the keys of all steps lets the query (s, i) see step-1 entries j <=
i-s+1 and the step-t entry at j = i-s+t for 1 < t <= s, the very keys an
incremental draft would have in its cache. The drafter thus learns to correct its
own errors instead of meeting them first at inference.

Checkpoints, schedule and exact resume come from train.py (the batch at step s is
a pure function of (seed, s)).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np


@dataclass
class FeatureItem:
    x: np.ndarray  # (L,) full token ids
    f: np.ndarray  # (L, E) float16 verifier features


def prepare_features(examples, features, max_len: int) -> list[FeatureItem]:
    out = []
    for e, f in zip(examples, features, strict=True):
        L = min(len(e.tokens), max_len)
        if L >= 3:
            out.append(FeatureItem(np.asarray(e.tokens[:L], np.int32), np.asarray(f[:L])))
    if not out:
        raise ValueError("no training sequences of 3 tokens or more")
    return out


def unroll_masks(T: int, unroll: int) -> list[mx.array]:
    """Boolean (T, s*T) masks for steps s = 1..unroll (see the module docstring)."""
    i = np.arange(T)[:, None]
    j = np.arange(T)[None, :]
    out = []
    for s in range(1, unroll + 1):
        blocks = [j <= i - s + 1] + [j == i - s + t for t in range(2, s + 1)]
        out.append(mx.array(np.concatenate(blocks, axis=1)))
    return out


class FeatureBatch:
    """Right-padded batch: emb (B, T, E) of x[1:], feat (B, T, E) f[:-1], tgt f[1:], valid (B, T)."""

    def __init__(self, items: list[FeatureItem], embed: mx.array):
        T = max(len(it.x) for it in items) - 1
        B, E = len(items), items[0].f.shape[1]
        ids = np.zeros((B, T), np.int32)
        feat = np.zeros((B, T, E), np.float16)
        tgt = np.zeros((B, T, E), np.float16)
        valid = np.zeros((B, T), bool)
        for b, it in enumerate(items):
            n = len(it.x) - 1
            ids[b, :n] = it.x[1:]
            feat[b, :n] = it.f[:-1]
            tgt[b, :n] = it.f[1:]
            valid[b, :n] = True
        self.emb = embed[mx.array(ids)].astype(mx.float32)
        self.feat = mx.array(feat).astype(mx.float32)
        self.tgt = mx.array(tgt).astype(mx.float32)
        self.valid = mx.array(valid)


def _attend(layer, h, kv: list, mask):
    """One decoder layer whose attention sees this step's keys plus the earlier steps' (kv)."""
    attn = layer.self_attn
    B, T, _ = h.shape
    x = layer.input_layernorm(h)
    q = attn.q_proj(x).reshape(B, T, attn.n_heads, -1).transpose(0, 2, 1, 3)
    k = attn.k_proj(x).reshape(B, T, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
    v = attn.v_proj(x).reshape(B, T, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
    q, k = attn.rope(q, 0, None), attn.rope(k, 0, None)
    kv.append((k, v))
    K = mx.concatenate([a for a, _ in kv], axis=2)
    V = mx.concatenate([b for _, b in kv], axis=2)
    out = mx.fast.scaled_dot_product_attention(q, K, V, scale=attn.scale, mask=mask)
    h = h + attn.o_proj(out.transpose(0, 2, 1, 3).reshape(B, T, -1))
    return h + layer.mlp(layer.post_attention_layernorm(h))


def unrolled(model, emb, feat, unroll: int) -> list[mx.array]:
    """Outputs g (B, T, E) of draft steps 1..unroll, as an incremental draft would compute them."""
    T = emb.shape[1]
    masks = unroll_masks(T, unroll)
    kv: list[list] = [[] for _ in model.layers]
    outs = []
    x_feat = feat
    for s in range(unroll):
        h = model.mix(emb, x_feat)
        for li, layer in enumerate(model.layers):
            h = _attend(layer, h, kv[li], masks[s])
        g = model.norm(h)
        outs.append(g)
        x_feat = mx.concatenate([feat[:, :1], g[:, :-1]], axis=1)  # step s+1 at i reads step s at i-1
    return outs


def feature_loss(model, batch: FeatureBatch, head: mx.array, unroll: int, reg_weight: float):
    """Mean over steps and valid positions of CE(p_verifier, q_drafter) + reg_weight * smooth-L1."""
    logp = batch.tgt @ head.T
    p = mx.stop_gradient(mx.softmax(logp, axis=-1))  # (B, T, N)
    total = 0.0
    for s, g in enumerate(unrolled(model, batch.emb, batch.feat, unroll)):
        logq = g @ head.T
        logq = logq - mx.logsumexp(logq, axis=-1, keepdims=True)
        ce = -(p * logq).sum(axis=-1)  # (B, T)
        reg = nn.losses.smooth_l1_loss(g, batch.tgt, reduction="none").mean(axis=-1)
        w = batch.valid & (mx.arange(g.shape[1]) >= s)[None]  # step s+1 needs s earlier guesses
        w = w.astype(mx.float32)
        total = total + ((ce + reg_weight * reg) * w).sum() / mx.maximum(w.sum(), 1.0)
    return total / unroll


def step_agreement(model, batch: FeatureBatch, head: mx.array, unroll: int) -> list[float]:
    """Top-1 agreement with the verifier (over the kept vocabulary) per draft step: a cheap progress signal."""
    want = mx.argmax(batch.tgt @ head.T, axis=-1)
    out = []
    for s, g in enumerate(unrolled(model, batch.emb, batch.feat, unroll)):
        w = batch.valid & (mx.arange(g.shape[1]) >= s)[None]
        hit = (mx.argmax(g @ head.T, axis=-1) == want) & w
        out.append(float(hit.sum()) / max(1.0, float(w.sum())))
    return out
