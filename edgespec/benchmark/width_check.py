"""Does a verifier pass over T positions give each row bitwise what one-token passes give?

Used by tests/test_bitwise.py and benchmarks/bitwise_probe.py. Each check runs a wide pass
and the one-token passes of the same prefixes on a fresh cache after the same prompt
prefill, and returns the rows whose logits differ (an empty list: bitwise equal).
- `chain_rows`: a chain of T tokens (a speculative draft with its bonus row, a plain
  verification of K + 1 positions), one causal pass;
- `tree_rows`: a tree of T nodes (`parents`), one pass with the tree mask and per-node
  positions (edgespec.lookahead.verify.tree_forward); node i against one-token passes along
  its path from the root;
- `prefill_rows`: a prompt chunk of T tokens in one pass against T one-token passes from
  an empty cache.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from edgespec.lookahead.tree import StepTree
from edgespec.lookahead.verify import tree_forward


def _fresh(model, prompt: list[int]) -> list:
    cache = model.make_cache()
    if prompt:
        mx.eval(model(mx.array([prompt], dtype=mx.int32), cache))
    return cache


def _step(model, cache, token: int) -> np.ndarray:
    out = model(mx.array([[token]], dtype=mx.int32), cache)[0, -1]
    mx.eval(out)
    return np.array(out)


def chain_rows(model, prompt: list[int], tokens: list[int]) -> list[int]:
    """Rows of a causal pass over `tokens` after `prompt` that differ from one-token passes."""
    cache = _fresh(model, prompt)
    wide = np.array(model(mx.array([tokens], dtype=mx.int32), cache)[0])
    cache = _fresh(model, prompt)
    return [t for t, tok in enumerate(tokens) if not np.array_equal(_step(model, cache, tok), wide[t])]


def tree_rows(model, prompt: list[int], tokens: list[int], parents: list[int]) -> list[int]:
    """Nodes of a tree pass (node 0 the root, parents[i] < i) after `prompt` whose logits differ
    from a one-token pass at the end of their root path."""
    tree = StepTree.rooted(tokens[0])
    for tok, parent in zip(tokens[1:], parents[1:], strict=True):
        tree.add_node(tok, parent)
    cache = _fresh(model, prompt)
    wide = np.array(tree_forward(model, cache, tree))
    bad = []
    for i in range(len(tokens)):
        path, node = [], i
        while node >= 0:
            path.append(tokens[node])
            node = parents[node]
        cache = _fresh(model, prompt)
        for tok in reversed(path):
            row = _step(model, cache, tok)
        if not np.array_equal(row, wide[i]):
            bad.append(i)
    return bad


def prefill_rows(model, tokens: list[int]) -> list[int]:
    """Rows of one prompt pass over `tokens` that differ from one-token passes from empty."""
    return chain_rows(model, [], tokens)


def random_tree(rng: np.random.Generator, size: int) -> list[int]:
    """Parents of a random tree of `size` nodes: each node hangs under an earlier one, biased
    towards recent nodes so trees have depth as well as width."""
    parents = [-1]
    for i in range(1, size):
        lo = max(0, i - 4) if rng.random() < 0.7 else 0
        parents.append(int(rng.integers(lo, i)))
    return parents
