"""Whether speculation pays in this batch, measured: the goodput guard over the joint choice.

The joint choice (`cost.joint_sizes`) prices trees from each row's *expected* gain and the
*estimated* cost of the step. Both can be wrong in ways a model of the step does not
see: short chat replies accept fewer tokens than a fresh request's acceptance priors
promise, a step with rows of mixed sizes splits into passes, a tree round's host work
grows with the batch. In a batch every row pays for such a mistake, and on a CPU the
batch of 4 plain rows that costs ~1.3x one row is hard to beat.

So the batch measures what it gets. Per batch size n, two regimes:

    "spec"   every adaptive row plans as the joint choice says (trees where they pay)
    "plain"  every adaptive row makes plain steps

and the worker keeps, for each, the tokens committed, the seconds spent and the steps
taken under it (decayed sums, so the rate follows the traffic). The regime with the
better measured rate runs, in runs of `run_steps` steps; the other is measured again for
one run after a wait of the winner's steps: at least `wait`, and long enough that
re-measuring costs at most `explore` of the rate. A run of a loser whose rate is a
fraction x below the winner's and whose steps take s times as long costs
run_steps * s * x winner-steps' worth of tokens, so the wait is run_steps * s * x /
explore. Counting steps alone under-counts a loser whose steps are long (speculation in
a batch of 8: benchmarks/results/batching.md). The base of that wait doubles (to `wait_max`) each time
the loser loses again.

A win on one short run can be luck (a run of steps whose rows happened to accept much),
so it is checked: the winner runs once more (its rate now from more than one run), the
regime it displaced is measured again right after, and if that one wins back, the lucky
regime returns to its doubled wait instead of starting over. Only a win that holds
resets the waits.

A batch size seen for the first time starts from the rates of the nearest one measured
(tokens scaled by the row counts) and re-measures the other regime after `wait` steps, so
a batch that grows from 4 to 5 rows does not pay to learn again what 4 rows taught, and a
wrong guess costs at most `wait` steps; with nothing measured yet it measures both (the
joint choice first). Rows of other modes are unaffected; a row alone never asks (it
prices with its own costs, `AdaptiveDecoder._pricing`).

Outputs do not depend on the regime: it only decides which verifier calls a row makes,
and every call sequence of the adaptive decoder yields plain decoding's tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

KINDS = ("spec", "plain")


@dataclass
class _Size:
    tokens: dict = field(default_factory=lambda: dict.fromkeys(KINDS, 0.0))
    seconds: dict = field(default_factory=lambda: dict.fromkeys(KINDS, 0.0))
    steps: dict = field(default_factory=lambda: dict.fromkeys(KINDS, 0.0))  # decayed like the two above
    own: dict = field(default_factory=lambda: dict.fromkeys(KINDS, 0))  # steps measured at this size
    level: dict = field(default_factory=dict)  # base of each regime's wait as the loser (doubles)
    wait: dict = field(default_factory=dict)  # steps of the winner before the loser's next run
    since: dict = field(default_factory=lambda: dict.fromkeys(KINDS, 0))  # steps since it last ran
    kind: str = "spec"  # the regime of the current run
    left: int = 0  # steps left in the current run
    probing: str | None = None  # the loser being re-measured in the current run
    unconfirmed: str | None = None  # won its last run as the loser; not yet checked again
    settled: bool = False  # both regimes measured (or taken over from a neighbouring size)


class SpecGuard:
    """Per batch size, the measured better of speculation as chosen and plain steps.

    `choose(n)` is asked once per step of n live rows in which an adaptive row asks (steps
    nobody asks about, such as a batch of plain-mode rows, do not run the schedule);
    `record(n, kind, tokens, seconds)` gives a step's result to the regime that planned it (the worker attributes the tokens
    a pass commits, and the step in which they are committed, to the regime of the step
    that built the pass)."""

    def __init__(self, run_steps: int = 6, wait: int = 24, wait_max: int = 384, decay: float = 0.85,
                 explore: float = 0.03):
        if run_steps < 1 or wait < 1 or wait_max < wait or not 0.0 < decay <= 1.0 or not 0.0 < explore < 1.0:
            raise ValueError("SpecGuard needs run_steps >= 1, 1 <= wait <= wait_max, 0 < decay <= 1, "
                             "0 < explore < 1")
        self.run_steps, self.wait0, self.wait_max, self.decay = run_steps, wait, wait_max, decay
        self.explore = explore
        self._sizes: dict[int, _Size] = {}

    def _size(self, n: int) -> _Size:
        s = self._sizes.get(n)
        if s is None:
            s = self._sizes[n] = _Size(wait=dict.fromkeys(KINDS, self.wait0),
                                       level=dict.fromkeys(KINDS, self.wait0))
            known = [m for m, t in self._sizes.items() if m != n and t.settled]
            if known:  # the nearest measured size's rates (ties: the larger), tokens scaled to n rows
                m = min(known, key=lambda m: (abs(m - n), -m))
                t = self._sizes[m]
                for k in KINDS:
                    s.tokens[k], s.seconds[k], s.steps[k] = t.tokens[k] * n / m, t.seconds[k], t.steps[k]
                s.settled = True  # the loser waits `wait` steps here (a neighbour's verdict is a guess)
        return s

    def _loser_wait(self, n: int, loser: str, wait: int) -> int:
        """The wait before re-measuring `loser`: `wait`, or longer where one run of it every
        `wait` steps would spend more than `explore` of the rate (its loss per step, times
        how much longer its steps take)."""
        winner = KINDS[1 - KINDS.index(loser)]
        r, w = self.rate(n, loser), self.rate(n, winner)
        loss = 1.0 - r / w if r is not None and w else 0.0
        tl, tw = self.step_seconds(n, loser), self.step_seconds(n, winner)
        longer = tl / tw if tl is not None and tw else 1.0
        return int(min(max(wait, self.run_steps * longer * loss / self.explore), self.wait_max))

    def step_seconds(self, n: int, kind: str) -> float | None:
        """Measured seconds of a step of `kind` at batch size n; None before it has run."""
        s = self._sizes.get(n)
        if s is None or s.steps[kind] <= 0:
            return None
        return s.seconds[kind] / s.steps[kind]

    def rate(self, n: int, kind: str) -> float | None:
        """Measured tokens/s of `kind` at batch size n; None before it has run."""
        s = self._sizes.get(n)
        if s is None or s.seconds[kind] <= 0:
            return None
        return s.tokens[kind] / s.seconds[kind]

    def best(self, n: int) -> str:
        """The regime with the better measured rate (spec while either is unmeasured)."""
        r = {k: self.rate(n, k) for k in KINDS}
        if any(v is None for v in r.values()):
            return "spec"
        return "plain" if r["plain"] > r["spec"] else "spec"

    def choose(self, n: int) -> str:
        s = self._size(n)
        if s.left <= 0:
            self._next_run(n, s)
        s.left -= 1
        for k in KINDS:
            s.since[k] = 0 if k == s.kind else s.since[k] + 1
        return s.kind

    def _next_run(self, n: int, s: _Size) -> None:
        if s.probing is not None:
            self._probed(n, s)
        elif s.unconfirmed is not None and self.best(n) != s.unconfirmed:
            self._lucky(n, s)  # its own next run took its lead away
        fresh = [] if s.settled else [k for k in KINDS if s.own[k] < self.run_steps]
        if fresh:  # a new batch size: measure both (the joint choice first)
            s.kind = fresh[0]
        else:
            best = self.best(n)
            other = KINDS[1 - KINDS.index(best)]
            if not s.settled:  # both just measured: the loser's first wait
                s.wait[other] = self._loser_wait(n, other, s.level[other])
                s.settled = True
            if s.since[other] >= s.wait[other]:
                s.kind, s.probing = other, other
            else:
                s.kind = best
        s.left = self.run_steps

    def _probed(self, n: int, s: _Size) -> None:
        """A loser's run ended: the waits after it, by whether it won and whether the other
        regime's own last win was still unconfirmed."""
        k = s.probing
        o = KINDS[1 - KINDS.index(k)]
        s.probing = None
        if self.best(n) == k:
            if s.unconfirmed == o:  # o's recent win did not hold
                self._lucky(n, s)
            else:  # k beat the regime in place: k runs once more (fresh steps of its own), then o
                s.unconfirmed = k
                s.wait[o] = s.since[o] + self.run_steps
        else:
            if s.unconfirmed == o:  # o's win held: a real change, k waits from the start
                s.level[k] = s.level[o] = self.wait0
            else:
                s.level[k] = min(2 * s.level[k], self.wait_max)
            s.unconfirmed = None
            s.wait[k] = self._loser_wait(n, k, s.level[k])

    def _lucky(self, n: int, s: _Size) -> None:
        """The unconfirmed winner lost its lead: back to its wait as the loser, doubled."""
        o, s.unconfirmed = s.unconfirmed, None
        s.level[o] = min(2 * s.level[o], self.wait_max)
        s.wait[o] = self._loser_wait(n, o, s.level[o])

    def record(self, n: int, kind: str, tokens: int, seconds: float) -> None:
        if kind not in KINDS:
            raise ValueError(f"unknown regime {kind!r}")
        if seconds <= 0:
            return
        s = self._size(n)
        s.tokens[kind] = self.decay * s.tokens[kind] + tokens
        s.seconds[kind] = self.decay * s.seconds[kind] + seconds
        s.steps[kind] = self.decay * s.steps[kind] + 1.0
        s.own[kind] += 1

    def summary(self) -> dict[int, dict]:
        """Per batch size: measured rates, steps and the regime that runs now (for reports)."""
        return {n: {"spec_tps": self.rate(n, "spec"), "plain_tps": self.rate(n, "plain"),
                    "spec_steps": s.own["spec"], "plain_steps": s.own["plain"], "best": self.best(n)}
                for n, s in sorted(self._sizes.items())}
