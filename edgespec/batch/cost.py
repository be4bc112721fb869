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

Priced one row at a time against the others' sizes as they stand, the batch drifts
to everyone speculating: once one row pads the pass to 8 tokens, every other row's
tree of 8 looks free, and no row alone can make the pass short again by staying
plain. So the rows choose together (`joint_sizes`): each adaptive row publishes its
gain curve (expected tokens for a tree of T tokens, `estimate.gain_curve`) when it
plans, and a row planning picks the configuration of the whole step (a cap C, and
which rows speculate up to it) with the best batch rate, from the latest curves;
then it plans its own tree within its part of that configuration. Every row
computes the same choice from the same curves, so they agree without a round of
messages.
"""

from __future__ import annotations

from dataclasses import dataclass

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


MEMO_REFRESH = 8  # observations between recomputations of the memoised step costs


class StepCost:
    """step(sizes) with a memo (the same few size lists recur step after step).

    A pass of B rows padded to T tokens costs what passes of that shape were measured to
    cost (`observe`, a moving average); between widths measured for B rows, interpolated;
    beyond them, the nearest measured one scaled along the one-sequence curve c(n); with
    nothing measured for B rows, c(B * T) times how far measured passes of the nearest
    row count ran from it. Rows are not free tokens (each has its own positions, mask
    and cache row; on this CPU 4 rows of 3 tokens cost 1.9x 4 rows of 1, while one row
    of 12 costs 1.1x one of 4)."""

    def __init__(self, pass_cost):
        self.pass_cost = pass_cost
        self.seen: dict[tuple[int, int], float] = {}
        self.factor: dict[int, float] = {}  # rows -> measured / c(rows * T)
        self._memo: dict[tuple, float] = {}
        self._stale = 0  # observations since the memo was last cleared

    def shape(self, rows: int, T: int) -> float:
        s = self.seen.get((rows, T))
        if s is not None:
            return s
        c = self.pass_cost
        known = sorted((t, v) for (b, t), v in self.seen.items() if b == rows)
        if known:  # between measured widths: interpolated; outside: scaled along the curve
            if known[0][0] < T < known[-1][0]:
                return float(np.interp(T, [t for t, _ in known], [v for _, v in known]))
            t, v = known[0] if T < known[0][0] else known[-1]
            return v * c(rows * T) / max(c(rows * t), 1e-12)
        f = self.factor.get(rows)
        if f is None and self.factor:  # the nearest row count measured
            f = self.factor[min(self.factor, key=lambda b: (abs(b - rows), b))]
        return c(rows * T) * (1.0 if f is None else f)

    def observe(self, rows: int, T: int, seconds: float) -> None:
        """A pass of `rows` rows of T tokens took `seconds`. Memoised step costs are
        recomputed when a shape is seen for the first time and every MEMO_REFRESH
        observations otherwise: one more measurement moves its shape's average by a few
        percent, while recomputing every row's joint choice from scratch each step cost
        3.2 ms a row at 8 rows against 0.3 with the memo kept (`benchmarks/cpu_kernels.py`,
        its "joint choice" lines), some 5% of an 8-row step."""
        if seconds <= 0:
            return
        old = self.seen.get((rows, T))
        self.seen[(rows, T)] = seconds if old is None else 0.7 * old + 0.3 * seconds
        ratio = seconds / max(self.pass_cost(rows * T), 1e-9)
        f = self.factor.get(rows)
        self.factor[rows] = ratio if f is None else 0.9 * f + 0.1 * ratio
        self._stale += 1
        if old is None or self._stale >= MEMO_REFRESH:
            self._memo.clear()
            self._stale = 0

    def __call__(self, sizes) -> float:
        key = tuple(sorted(sizes))
        c = self._memo.get(key)
        if c is None:
            c = sum(self.shape(len(g), max(key[i] for i in g)) for g in group_rows(list(key), self.pass_cost))
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


@dataclass
class Peer:
    """Another row of the step, as a row planning sees it."""

    size: int  # tokens of its latest call
    gains: np.ndarray | None = None  # its published gain curve; None: its size is its own (commits 1)
    key: int = 0  # breaks ties in the same order in every row's computation (admission order)
    extra_s: float = 0.0  # host seconds its tree round costs beyond a plain step (every row waits)


CAPS = (2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)  # tree sizes a step may be capped at


def joint_sizes(mine: np.ndarray, peers: list[Peer], step: StepCost, key: int = 0,
                extra_s: float = 0.0) -> tuple[int, list[int], float]:
    """The step configuration with the best batch rate -> (this row's tree size at most,
    the peers' sizes in it, the tokens the peers commit in it).

    Rows with a gain curve (this one and adaptive peers) either speculate up to a cap C or
    run plain; for each C the ones that gain most from C speculate, the top k for every k.
    Peers without a curve (other modes, prompt chunks) keep their sizes. Ties go by `key`
    (this row's) and the peers' keys, so every row ranks the rows alike.
    rate = (sum of expected tokens) / (step(sizes) + the speculating rows' extra host
    seconds: a tree round's drawing, accepting and committing run in the worker while
    every other row waits; `extra_s` is this row's).
    """
    flex = [mine] + [p.gains for p in peers if p.gains is not None]
    keys = [key] + [p.key for p in peers if p.gains is not None]
    extras = [extra_s] + [p.extra_s for p in peers if p.gains is not None]
    fixed = [p.size for p in peers if p.gains is None]
    nf = len(flex)
    base_gain = float(len(fixed))
    plain = [1] * nf
    best_rate = (base_gain + nf) / step(fixed + plain)
    best = plain
    longest = max(len(g) for g in flex)
    for C in CAPS:
        if C > longest and C != CAPS[0]:
            break
        sizes = [min(C, len(g)) for g in flex]
        extra = [float(g[s - 1]) - 1.0 for g, s in zip(flex, sizes, strict=True)]
        order = sorted(range(nf), key=lambda i: (-extra[i], keys[i]))
        conf, gain, host = list(plain), base_gain + nf, 0.0
        for i in order:
            if extra[i] <= 0.0:
                break
            conf[i], gain, host = sizes[i], gain + extra[i], host + extras[i]
            rate = gain / (step(fixed + conf) + host)
            if rate > best_rate:
                best_rate, best = rate, list(conf)
    # Peers' sizes, in `peers` order, and the tokens they commit in the chosen configuration.
    out, k, peer_gain = [], 1, 0.0
    for p in peers:
        if p.gains is None:
            out.append(p.size)
            peer_gain += 1.0
        else:
            out.append(best[k])
            peer_gain += float(p.gains[best[k] - 1])
            k += 1
    return best[0], out, peer_gain
