"""Kernels for one lookahead / tree-verification step.

A step feeds T new tokens arranged as a tree rooted at node 0 (the last
committed token): `parents` (T,) int32 with parents[0] = -1 and
0 <= parents[t] < t for t >= 1. Every speculative structure of a step (the
Jacobi window's diagonals, the trie of pooled n-grams) is such a tree: a
node attends to the cached prefix, its ancestors and itself, at RoPE
position prefix_len + depth.

- `tree_mask(parents, prefix_len)` -> mask (T, prefix_len + T) bool, positions (T,) int32.
- `tree_accept(tokens, parents, pred)` -> (best node, its depth, pred[best]) for greedy
  verification: the deepest node whose every token equals the verifier's argmax at its
  parent, found in one pass.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from edgespec.kernels.spec import KernelSpec, compare, metal, prologue, usable

# Grid (S, T, 1): one thread per mask entry. A node's ancestors have smaller
# indices, so the walk up stops as soon as it passes below the key column.
TREE_MASK = KernelSpec(
    name="edgespec_tree_mask",
    inputs=("parents", "dims"),
    outputs=("mask", "positions"),
    source=prologue("s t", "T P") + """
    int S = P + T;
    if (int(t) >= T || int(s) >= S) {
        return;
    }
    bool on = true;
    if (int(s) >= P) {
        int target = int(s) - P;
        int node = int(t);
        on = false;
        while (node >= target) {
            if (node == target) {
                on = true;
                break;
            }
            node = parents[node];
        }
    }
    mask[size_t(t) * size_t(S) + size_t(s)] = on;
    if (s == 0) {
        int depth = 0;
        int node = parents[t];
        while (node >= 0) {
            depth += 1;
            node = parents[node];
        }
        positions[t] = P + depth;
    }
""",
)

# Grid (1, 1, 1): T is at most a few hundred and paths are short, so a single
# thread scanning every node beats a reduction across threads.
TREE_ACCEPT = KernelSpec(
    name="edgespec_tree_accept",
    inputs=("tokens", "parents", "pred", "dims"),
    outputs=("result",),
    source="""
    if (thread_position_in_grid.x != 0) {
        return;
    }
    int T = dims[0];
    int best = 0;
    int best_depth = 0;
    for (int t = 1; t < T; ++t) {
        int node = t;
        int depth = 0;
        bool ok = true;
        while (parents[node] >= 0) {
            int par = parents[node];
            if (tokens[node] != pred[par]) {
                ok = false;
                break;
            }
            depth += 1;
            node = par;
        }
        if (ok && depth > best_depth) {
            best = t;
            best_depth = depth;
        }
    }
    result[0] = best;
    result[1] = best_depth;
    result[2] = pred[best];
""",
)


def check_parents(parents: list[int]) -> None:
    """Raise ValueError unless `parents` is a tree rooted at node 0 in topological order."""
    if not parents or parents[0] != -1:
        raise ValueError("tree parents must start with -1 (node 0 is the root)")
    for t, p in enumerate(parents[1:], start=1):
        if not 0 <= p < t:
            raise ValueError(
                f"node {t} has parent {p}; each parent must be an earlier node (0 <= parent < node)"
            )


def _reach(parents: mx.array) -> mx.array:
    """(T, T) float 0/1: R[t, s] = 1 iff s is t or an ancestor of t.

    Pointer doubling: R0 = I + parent one-hot covers paths of length <= 1;
    squaring k times covers <= 2^k, and no path is longer than T - 1.
    """
    T = parents.shape[0]
    ar = mx.arange(T)
    R = ((parents[:, None] == ar[None, :]) | (ar[:, None] == ar[None, :])).astype(mx.float32)
    for _ in range((T - 2).bit_length() if T > 2 else 0):
        R = ((R @ R) > 0).astype(mx.float32)
    return R


def tree_mask_reference(parents: mx.array, prefix_len: int) -> tuple[mx.array, mx.array]:
    """Pure-MLX twin of TREE_MASK: parents (T,) -> mask (T, prefix_len+T) bool, positions (T,) int32."""
    T = parents.shape[0]
    R = _reach(parents)
    mask = mx.concatenate([mx.ones((T, prefix_len), dtype=mx.bool_), R > 0], axis=1)
    positions = (prefix_len + R.sum(axis=1) - 1).astype(mx.int32)
    return mask, positions


def tree_accept_reference(tokens: mx.array, parents: mx.array, pred: mx.array) -> mx.array:
    """Pure-MLX twin of TREE_ACCEPT: -> int32 (3,) [best node, depth, pred[best]]."""
    R = _reach(parents) > 0
    has_parent = parents >= 0
    match = (tokens == pred[mx.maximum(parents, 0)]) | ~has_parent
    ok = mx.all(mx.where(R, match[None, :], True), axis=1)
    depth = R.sum(axis=1).astype(mx.int32) - 1
    score = mx.where(ok, depth, -1)
    best = mx.argmax(score).astype(mx.int32)  # first maximum, like the kernel's strict '>'
    return mx.stack([best, score[best], pred[best]]).astype(mx.int32)


# The self-checks' trees: a chain, a bushy tree, a lone root.
_CHECK_TREES = ([-1, 0, 1, 2, 3], [-1, 0, 0, 1, 1, 2, 5, 0, 7], [-1])


def _check_mask() -> None:
    for parents in _CHECK_TREES:
        p = mx.array(parents, dtype=mx.int32)
        for prefix in (0, 3):
            got, want = _tree_mask_metal(p, prefix), tree_mask_reference(p, prefix)
            compare("tree_mask mask", got[0], want[0])
            compare("tree_mask positions", got[1], want[1])


def _check_accept() -> None:
    rng = np.random.default_rng(0)
    for parents in _CHECK_TREES:
        T = len(parents)
        for _ in range(4):
            tokens = mx.array(rng.integers(0, 3, T), dtype=mx.int32)
            pred = mx.array(rng.integers(0, 3, T), dtype=mx.int32)
            p = mx.array(parents, dtype=mx.int32)
            compare("tree_accept", _tree_accept_metal(tokens, p, pred), tree_accept_reference(tokens, p, pred))


def tree_mask(parents: mx.array, prefix_len: int) -> tuple[mx.array, mx.array]:
    """Mask (T, prefix_len + T) bool and RoPE positions (T,) int32 of a tree step."""
    if not usable(TREE_MASK, "int32", _check_mask):
        return tree_mask_reference(parents, prefix_len)
    return _tree_mask_metal(parents, prefix_len)


def _tree_mask_metal(parents: mx.array, prefix_len: int) -> tuple[mx.array, mx.array]:
    T = parents.shape[0]
    S = prefix_len + T
    dims = mx.array([T, prefix_len], dtype=mx.int32)
    mask, positions = metal(TREE_MASK)(
        inputs=[parents.astype(mx.int32), dims],
        grid=(S, T, 1),
        threadgroup=(min(S, 256), 1, 1),
        output_shapes=[(T, S), (T,)],
        output_dtypes=[mx.bool_, mx.int32],
    )
    return mask, positions


def tree_accept(tokens: mx.array, parents: mx.array, pred: mx.array) -> mx.array:
    """Greedy verification of a token tree in one pass: int32 (3,) [best, depth, bonus]."""
    if not usable(TREE_ACCEPT, "int32", _check_accept):
        return tree_accept_reference(tokens, parents, pred)
    return _tree_accept_metal(tokens, parents, pred)


def _tree_accept_metal(tokens: mx.array, parents: mx.array, pred: mx.array) -> mx.array:
    dims = mx.array([tokens.shape[0]], dtype=mx.int32)
    (result,) = metal(TREE_ACCEPT)(
        inputs=[tokens.astype(mx.int32), parents.astype(mx.int32), pred.astype(mx.int32), dims],
        grid=(1, 1, 1),
        threadgroup=(1, 1, 1),
        output_shapes=[(3,)],
        output_dtypes=[mx.int32],
    )
    return result
