"""How many tokens a tree pass should verify, from the measured cost of verifying them.

`calibrate_tree` times verifier passes over T tree tokens (a tree mask with
tree positions, as a real pass) for a grid of T on this device; `TreeBudget`
interpolates that curve. For a dynamic tree whose candidate nodes have drafter
path scores s_1 >= s_2 >= ..., keeping the best n nodes is expected to commit
    E(n) = 1 + c * (s_1 + ... + s_n)
tokens (each node is accepted about as often as its path probability; c is a
running calibration: accepted / predicted, since a drafter's confidence is not
its acceptance) in draft_s + verify(n + 1) seconds. The budget is the n that
maximises E(n) / cost(n). Whether drafting pays at all (tree vs weight-free
candidates vs plain steps) is the lookahead `StepController`'s job: it
measures each kind's tokens per second and probes the losers now and then.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from edgespec.kernels import tree_mask

SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)  # a guess: a grid dense where CPU costs bend, not measured


@dataclass
class TreeCosts:
    sizes: list[int]  # tree tokens T per measured pass (ascending)
    verify_s: list[float]  # seconds of one verifier pass over T tree tokens

    def verify(self, T: int) -> float:
        return float(np.interp(T, self.sizes, self.verify_s))


def calibrate_tree(model, max_tokens: int = 64, context: int = 64, reps: int = 2, sizes=SIZES,
                   monotone: bool = True) -> TreeCosts:
    """Time verifier passes over chain-shaped trees of each size in `sizes` up to `max_tokens`.

    monotone: raise every cost to at least the previous size's (noise must not favour big
    trees); off, the curve keeps real dips (a CPU BLAS may run 16 rows faster than 12)."""
    V = model.args.vocab_size
    ids = [(7 * i + 3) % V for i in range(context + max_tokens)]
    cache = model.make_cache()
    mx.eval(model(mx.array(ids[:context], dtype=mx.int32)[None], cache))
    sizes = [s for s in sizes if s <= max_tokens] or [1]
    best = {}
    for r in range(reps + 1):  # the first round warms up
        for T in sizes:
            x = mx.array(ids[context : context + T], dtype=mx.int32)[None]
            mask, pos = tree_mask(mx.array([-1] + list(range(T - 1)), dtype=mx.int32), context)
            mx.eval(mask, pos)
            t0 = time.perf_counter()
            mx.eval(model(x, cache, mask=mask, positions=pos) if T > 1 else model(x, cache))
            dt = time.perf_counter() - t0
            for c in cache:
                c.trim(T)
            if r:
                best[T] = min(best.get(T, dt), dt)  # load only adds time: keep the fastest
    verify = [best[T] for T in sizes]
    for i in range(1, len(verify) if monotone else 0):
        verify[i] = max(verify[i], verify[i - 1])
    return TreeCosts(sizes, verify)


class TreeBudget:
    """Chooses how many drafted nodes a dynamic tree keeps; learns its calibration c online."""

    def __init__(self, costs: TreeCosts | None, fixed: int | None = None, max_tokens: int = 64):
        if costs is None and fixed is None:
            raise ValueError("the tree budget needs measured costs unless it is fixed")
        self.costs = costs
        self.fixed = fixed
        self.max_tokens = max_tokens
        self.c = 1.0
        self._pred = 1.0  # EMAs of predicted and actual accepted tokens per pass
        self._got = 1.0
        self.draft_s = 0.0  # EMA of drafting seconds per pass
        self.last_pred = 0.0

    def pick(self, scores: list[float], policy=None) -> int:
        """scores sorted best first -> how many to keep (so the tree has that many + 1 tokens).
        policy: the request's edgespec.adaptive.policy.Policy (carries the choice out or
        replaces it: a seeded or scripted one in tests)."""
        n_max = min(len(scores), self.max_tokens - 1)
        if self.fixed is not None:
            n = min(n_max, self.fixed - 1)
        else:
            gain = 1.0 + self.c * np.cumsum([0.0] + list(scores[:n_max]))  # E(n), n = 0..n_max
            cost = np.array([self.draft_s + self.costs.verify(n + 1) for n in range(n_max + 1)])
            n = int(np.argmax(gain / cost))
        if policy is not None:
            n = min(max(policy.tree_size(n, n_max), 0), n_max)
        self.last_pred = float(sum(scores[:n]))
        return n

    def record(self, accepted: int, draft_s: float) -> None:
        self.draft_s = draft_s if self.draft_s == 0.0 else 0.8 * self.draft_s + 0.2 * draft_s
        self._pred = 0.9 * self._pred + 0.1 * self.last_pred
        self._got = 0.9 * self._got + 0.1 * accepted
        self.c = min(max(self._got / max(self._pred, 1e-6), 0.05), 2.0)
