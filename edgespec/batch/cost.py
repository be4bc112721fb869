"""What one batched step costs, for pricing speculation inside a batch.

A step runs the live rows in one pass or a few (`group_rows`), each pass over
rows padded to their longest T. With c(n) the measured time of one pass over n
tokens (the adaptive decoder's calibration, `adaptive_costs`):

    step(sizes) = sum over passes g of c(len(g) * max T in g)

A sequence choosing a tree of T tokens while the others need `others` sizes
changes the step to step(others + [T]); the batch commits (others' tokens) +
E(T). The adaptive decoder maximises that total rate, (O + E(T)) / step(others + [T]),
instead of its own E(T) / c(T): on a CPU a batch of 4 plain rows costs ~1.2x one,
so a tree that pads every row to 8 tokens must bring far more than it would alone.
"""

from __future__ import annotations

import numpy as np

from edgespec.batch.forward import group_rows


class PassCost:
    """c(n): seconds of one pass over n tokens, interpolated on a measured curve and
    extended linearly past its end; tabulated for speed (it is asked per token)."""

    def __init__(self, sizes, seconds, table: int = 1024):
        sizes, seconds = list(sizes), list(seconds)
        n = np.arange(table + 1, dtype=np.float64)
        tab = np.interp(n, sizes, seconds)
        if len(sizes) >= 2:
            slope = (seconds[-1] - seconds[-2]) / max(sizes[-1] - sizes[-2], 1)
            past = n > sizes[-1]
            tab[past] = seconds[-1] + slope * (n[past] - sizes[-1])
        self._tab = tab.tolist()
        self._slope = (self._tab[-1] - self._tab[-2])

    def __call__(self, n: int) -> float:
        if n < len(self._tab):
            return self._tab[n]
        return self._tab[-1] + self._slope * (n - len(self._tab) + 1)


class StepCost:
    """step(sizes) with a memo (the same few size lists recur step after step)."""

    def __init__(self, pass_cost):
        self.pass_cost = pass_cost
        self._memo: dict[tuple, float] = {}

    def __call__(self, sizes) -> float:
        key = tuple(sorted(sizes))
        c = self._memo.get(key)
        if c is None:
            c = sum(self.pass_cost(len(g) * max(key[i] for i in g)) for g in group_rows(list(key), self.pass_cost))
            if len(self._memo) > 4096:
                self._memo.clear()
            self._memo[key] = c
        return c


class BatchCosts:
    """The adaptive decoder's `Costs` as seen from inside a batch: verify(T) is the whole
    step's time with this row at T tokens and the others at theirs."""

    def __init__(self, base, others: list[int], step: StepCost):
        self.base, self.others, self.step = base, list(others), step
        self._cache: dict[int, float] = {}

    def verify(self, T: int) -> float:
        c = self._cache.get(T)
        if c is None:
            c = self._cache[T] = self.step(self.others + [int(T)])
        return c

    @property
    def max_tokens(self) -> int:
        return self.base.max_tokens
