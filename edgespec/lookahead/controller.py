"""Lookahead's step controller: which kind of step pays, decided on the fly from measured tokens/s.

- "full": the Jacobi window plus the pooled candidates (the whole lookahead step);
- "lean": the pooled candidates only (prompt-lookup-like; cheap when copying);
- "plain": x0 alone, exactly a plain decoding step.
Each kind's speed is an exponential moving average of tokens committed per
second of step time; the fastest runs, and every other kind is re-measured
after `probe_every` steps without it, so a change of regime (chat turning into
copying) is noticed. A probe that loses doubles that kind's wait (up to
`probe_max`), so a window that never pays costs ever less; a win resets it. A lean step with no candidates is a plain step and is
recorded as one.
"""

from __future__ import annotations

KINDS = ("full", "lean", "plain")


class StepController:
    def __init__(
        self,
        adaptive: bool = True,
        probe_every: int = 12,
        alpha: float = 0.3,
        warmup: int = 3,
        kinds=KINDS,
        probe_max: int = 96,
    ):
        """kinds: the step kinds allowed (first = the one used when not adaptive)."""
        self.kinds = tuple(kinds)
        self.adaptive = adaptive
        self.probe_every = probe_every
        self.probe_max = probe_max
        self.wait = dict.fromkeys(KINDS, probe_every)  # steps a losing kind waits before a probe
        self.alpha = alpha
        self.warmup = warmup
        self.rate: dict[str, float | None] = dict.fromkeys(KINDS)
        self.count = dict.fromkeys(KINDS, 0)
        self.since = dict.fromkeys(KINDS, 0)  # steps since the kind last ran (of the allowed ones)

    def choose(self, policy=None) -> str:
        """The kind of the next step. policy: the request's edgespec.adaptive.policy.Policy,
        which carries the timed choice out or replaces it (a seeded or scripted one in tests)."""
        kind = self._timed()
        return kind if policy is None else policy.step(kind, self.kinds)

    def _timed(self) -> str:
        kinds = self.kinds
        if not self.adaptive:
            return kinds[0]
        if "full" in kinds and self.count["full"] < self.warmup:
            return "full"  # let the window fill and its n-grams reach the pool first
        for k in kinds:
            if self.rate[k] is None:
                return k
        best = max(kinds, key=lambda k: self.rate[k])
        stale = [k for k in kinds if k != best and self.since[k] >= self.wait[k]]
        return max(stale, key=lambda k: self.since[k]) if stale else best

    def record(self, kind: str, tokens: int, seconds: float) -> None:
        r = tokens / max(seconds, 1e-9)
        old = self.rate[kind]
        self.rate[kind] = r if old is None else (1 - self.alpha) * old + self.alpha * r
        if self.adaptive and old is not None and self.count[kind] >= 1:
            others = [self.rate[k] for k in self.kinds if k != kind and self.rate[k] is not None]
            won = not others or self.rate[kind] >= max(others)
            self.wait[kind] = self.probe_every if won else min(2 * self.wait[kind], self.probe_max)
        self.count[kind] += 1
        for k in self.since:
            self.since[k] = 0 if k == kind else self.since[k] + 1

    @property
    def fell_back(self) -> bool:
        """True once steps without the window outnumber full steps."""
        return (
            "full" in self.kinds and self.count["lean"] + self.count["plain"] > self.count["full"]
        )
