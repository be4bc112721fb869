"""Choosing what a tree step commits: greedy longest match, or lossless sampling.

Sampling uses recursive rejection over point-mass candidates. At a node with
target distribution p (the verifier's filtered probabilities there) and
children with distinct tokens x1, x2, ... (fixed before any random draw of
this step), keep a residual r = p and for each child in turn accept x_k with
probability r(x_k) / sum(r). On rejection set r(x_k) = 0 (the general residual
max(0, r - q) for a point mass q at x_k, renormalised) and try the next.
If all fail, sample the output from r and stop; if x_k is accepted, move to
that child and repeat with its distribution.

Why the output at a node is distributed exactly as p: with one candidate x,
P(out = x) = r(x) and, for y != x, P(out = y) = (1 - r(x)) * r(y) / (1 - r(x)) = r(y),
all for normalised r. So a candidate round turns "sample from r" into "accept x
with r(x), else sample from r with x removed", which is the same distribution;
by induction over the candidates, the node's output ~ p. Candidates and the tree
depend only on the past, and the child reached after accepting x holds the
verifier's distribution given the prefix extended by x, so the whole committed
sequence follows plain sampling's law. Duplicate tokens among children add
nothing (r(x) is already 0), so only the first child per token is tried.
Greedy is the one-hot limit: accept x iff x = argmax, else emit the argmax.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from edgespec.kernels import commit_kv, tree_accept, tree_mask
from edgespec.lookahead.tree import StepTree


def tree_forward(model, cache, tree: StepTree) -> mx.array:
    """Logits (T, V) of every tree node in one verifier pass after the cached prefix.

    A one-node tree is exactly a plain step, and a chain a causal pass at contiguous positions
    (a speculative verification's): the fused mask and RoPE's contiguous form, with none of
    the ops a tree mask and per-node positions add in every layer (1-3% of a pass of 2-8
    tokens of SmolLM2, the same logits bitwise: benchmarks/results/adaptive.md), and on recurrent layers
    no branch bookkeeping. Otherwise the tree mask and per-node RoPE positions let each node
    see only its ancestors.
    """
    inputs = mx.array(tree.tokens, dtype=mx.int32)[None]
    if tree.is_chain():
        return model(inputs, cache)[0]
    mask, positions = tree_mask(mx.array(tree.parents, dtype=mx.int32), cache[0].offset)
    return model(inputs, cache, mask=mask, positions=positions)[0]


def greedy_pass(tree: StepTree, logits: mx.array) -> tuple[mx.array, mx.array]:
    """Queue argmax per node (T,) and the tree's [best, depth, bonus] (3,) (lazy arrays)."""
    pred = mx.argmax(logits, axis=-1).astype(mx.int32)
    result = tree_accept(
        mx.array(tree.tokens, dtype=mx.int32), mx.array(tree.parents, dtype=mx.int32), pred
    )
    return pred, result


def sample_walk(tree: StepTree, logits: mx.array, sampler) -> tuple[list[int], int, list[float]]:
    """Lossless walk from the root -> (accepted nodes, next token, log-probs of path + next).

    logits: (T, V) raw verifier logits of the step's nodes.
    """
    node, path, lps = 0, [], []
    while True:
        children = tree.children[node]  # token -> first child with it, in insertion order
        # One evaluation per node: the filtered log-probs and one uniform per candidate
        # plus one for the residual draw (independent uniforms, drawn up front).
        lp, u = sampler.logprobs(logits[node]), sampler.uniform((len(children) + 1,))
        mx.eval(lp, u)
        lp_np = np.array(lp, dtype=np.float64)
        u = np.array(u, dtype=np.float64)
        r = np.exp(lp_np)
        total = r.sum()
        chosen = None
        for i, (tok, child) in enumerate(children.items()):
            if u[i] * total < r[tok]:
                chosen = (tok, child)
                break
            total -= r[tok]
            r[tok] = 0.0
        if chosen is None:
            # Inverse-CDF draw from the residual r (unnormalised; cdf[-1] is its mass).
            cdf = np.cumsum(r)
            tok = int(min(np.searchsorted(cdf, u[-1] * cdf[-1], side="right"), len(r) - 1))
            while r[tok] == 0.0 and tok > 0:  # float edge: never emit a removed / filtered token
                tok -= 1
            lps.append(float(lp_np[tok]))
            return path, tok, lps
        tok, child = chosen
        path.append(child)
        lps.append(float(lp_np[tok]))
        node = child


def verify_step(model, cache, tree: StepTree, sampler, want_pred: bool = False):
    """One verifier pass over `tree` after the cached prefix, accepted path committed to the cache.

    Greedy keeps the deepest node the verifier agrees with (`tree_accept`); sampling walks
    the tree with recursive rejection (`sample_walk`). Returns (accepted nodes, next token,
    log-probs of the path's tokens and the next one, per-node argmax list when `want_pred`:
    what a Jacobi window advances to).
    """
    p = cache[0].offset
    out = tree_forward(model, cache, tree)  # (T, V)
    if sampler.params.greedy:
        pred, result = greedy_pass(tree, out)
        mx.eval(pred, result)
        best, _, nxt = (int(v) for v in result.tolist())
        path = tree.path_to(best)
        lps = [0.0] * (len(path) + 1)
        pred_l = pred.tolist() if want_pred else None
    else:
        path, nxt, lps = sample_walk(tree, out, sampler)
        pred_l = mx.argmax(out, axis=-1).tolist() if want_pred else None
    commit_kv(cache, p, [0] + path)
    return path, nxt, lps, pred_l
