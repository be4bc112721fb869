"""Deciding on the fly whether the lookahead window pays.

A "full" step feeds the Jacobi window plus the pooled candidates; a "lean"
step feeds only the candidates (just x0 when there are none: a plain step).
Each kind's speed is tracked as an exponential moving average of
tokens committed per second of step time; the faster kind runs, and the
other is re-measured every `probe_every` steps so a change of regime (chat
turning into copying) is noticed.
"""

from __future__ import annotations


class StepController:
    def __init__(self, adaptive: bool = True, probe_every: int = 12, alpha: float = 0.3, warmup: int = 3):
        self.adaptive = adaptive
        self.probe_every = probe_every
        self.alpha = alpha
        self.warmup = warmup
        self.rate: dict[str, float | None] = {"full": None, "lean": None}
        self.count = {"full": 0, "lean": 0}
        self.since = {"full": 0, "lean": 0}  # steps since the kind last ran

    def choose(self) -> str:
        if not self.adaptive:
            return "full"
        if self.count["full"] < self.warmup:
            return "full"  # let the window fill and its n-grams reach the pool first
        if self.rate["lean"] is None:
            return "lean"
        best = "full" if self.rate["full"] >= self.rate["lean"] else "lean"
        other = "lean" if best == "full" else "full"
        return other if self.since[other] >= self.probe_every else best

    def record(self, kind: str, tokens: int, seconds: float) -> None:
        r = tokens / max(seconds, 1e-9)
        old = self.rate[kind]
        self.rate[kind] = r if old is None else (1 - self.alpha) * old + self.alpha * r
        self.count[kind] += 1
        for k in self.since:
            self.since[k] = 0 if k == kind else self.since[k] + 1

    @property
    def fell_back(self) -> bool:
        return self.count["lean"] > self.count["full"]
