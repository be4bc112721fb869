"""Choosing the draft length K (or plain decoding) from measured costs and running acceptance.

With per-token acceptance alpha (each draft kept with probability alpha given
the previous ones were), one round of K drafts yields
    E[tokens](alpha, K) = 1 + alpha + ... + alpha^K = (1 - alpha^(K+1)) / (1 - alpha)
tokens (accepted drafts plus the correction/bonus) and costs
    t_verify(K+1) + K * t_draft * (1 - hidden)
seconds, `hidden` being the fraction of drafting overlapped with verification.
The controller picks K maximising E / cost, and decodes plainly when even the
best K is not faster than 1 / t_verify(1), probing a speculative round now and
then (with growing intervals) in case acceptance has improved.

The costs come from the engine's learnt curve (edgespec.calibration, via
`modes.speculative.engine_costs`), not from a measurement before the first token;
`calibrate` remains for benchmarks. Costs that are still a prior (`measured`
False: nothing timed on this machine yet) are put in this machine's seconds by the
first step timed: its ratio to the prior becomes the round-time factor.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from edgespec.logits.sampling import Sampler, SamplingParams


@dataclass
class CostModel:
    verify_s: list[float]  # verify_s[T-1]: seconds of one verifier pass over T new tokens
    draft_s: float  # seconds per drafted token
    measured: bool = True  # False: a prior, in no machine's seconds yet
    curve: Any = None  # the engine's learnt curve (estimate.Costs) that passes run alone teach
    drafting: Any = None  # the drafter's learnt cost (estimate.DraftCost) that drafting calls teach

    @property
    def kmax(self) -> int:
        return len(self.verify_s) - 1


def _best(xs: list[float]) -> float:
    # The minimum: background load only ever adds time, so the fastest repeat is
    # the closest to the device's real cost (and both sides are measured alike).
    return min(xs)


def calibrate(model, drafter, kmax: int = 8, context: int = 64, reps: int = 3) -> CostModel:
    """Time verifier passes of 1..kmax+1 tokens and the drafter's per-token cost on this device.

    Runs on a dummy context of `context` tokens; a few hundred milliseconds for
    SmolLM2-135M. The drafter is left in an arbitrary state (callers `begin` it).
    """
    V = model.args.vocab_size
    ids = [(7 * i + 3) % V for i in range(context)]
    cache = model.make_cache()
    mx.eval(model(mx.array(ids, dtype=mx.int32)[None], cache))
    sampler = Sampler(SamplingParams(temperature=0.0))
    drafter.begin(ids)
    # A feature drafter reads verifier features; any values cost the same to draft from.
    feed = drafter.caps.needs_features
    if feed:
        drafter.add_features(mx.zeros((drafter.features_needed(), model.args.hidden_size)))
    k = max(2, min(kmax, 4))
    verify = [[] for _ in range(kmax + 1)]
    draft = []
    # Interleave drafter and verifier timings in every repeat, so a load spike
    # hits both alike; the first repeat only warms up.
    for r in range(reps + 1):
        t0 = time.perf_counter()
        drafter.draft(k, sampler)
        dt = time.perf_counter() - t0
        drafter.accept(0, ids[-1])
        if feed:
            drafter.add_features(mx.zeros((drafter.features_needed(), model.args.hidden_size)))
        if r:
            draft.append(dt / k)
        for T in range(1, kmax + 2):
            x = mx.array(ids[:T], dtype=mx.int32)[None]
            t0 = time.perf_counter()
            mx.eval(model(x, cache))
            dt = time.perf_counter() - t0
            for c in cache:
                c.trim(T)
            if r:
                verify[T - 1].append(dt)
    verify = [_best(v) for v in verify]
    # Keep the curve monotone: noise must not make a longer pass look cheaper.
    for i in range(1, len(verify)):
        verify[i] = max(verify[i], verify[i - 1])
    return CostModel(verify, _best(draft))


def expected_tokens(alpha: float, k: int) -> float:
    """E[accepted + 1] for k drafts at per-token acceptance alpha."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


class KController:
    """Online choice of K; K = 0 means "take a plain verifier step"."""

    def __init__(
        self,
        costs: CostModel | None,
        fixed_k: int | None = None,
        prior_alpha: float = 0.5,
        decay: float = 0.9,
        probe_start: int = 16,
        probe_max: int = 256,
        margin: float = 1.03,
    ):
        if fixed_k is None and costs is None:
            raise ValueError("the controller needs a CostModel unless K is fixed")
        self.costs = costs
        self.fixed_k = fixed_k
        self.margin = margin  # speculate only when predicted this much faster than plain
        self.decay = decay
        # Running acceptance: successes / trials with exponential forgetting, started
        # from a prior worth two trials.
        self.succ = 2.0 * prior_alpha
        self.trials = 2.0
        self.hidden = 0.0  # EMA of the hidden drafting fraction (pipelining)
        self.spec_factor = 1.0  # EMA of measured / predicted round time
        self.plain_s = costs.verify_s[0] if costs else 0.0  # EMA of measured plain step time
        self.scaled = costs is None or costs.measured  # False until a prior is put in seconds
        self.probe_interval = probe_start
        self.probe_max = probe_max
        self.plain_run = 0  # plain steps since the last speculative round
        self.in_fallback = False

    @property
    def alpha(self) -> float:
        return self.succ / self.trials

    def round_cost(self, k: int) -> float:
        c = self.costs
        t = c.verify_s[min(k, c.kmax)] + k * c.draft_s * (1.0 - self.hidden)
        return t * self.spec_factor

    def best_k(self) -> tuple[int, float]:
        """(K, expected tokens/s) maximising the speculative rate."""
        a = self.alpha
        best = max(range(1, self.costs.kmax + 1), key=lambda k: expected_tokens(a, k) / self.round_cost(k))
        return best, expected_tokens(a, best) / self.round_cost(best)

    def choose(self, policy=None) -> int:
        """K for the next round (0: a plain step). policy: the request's
        edgespec.adaptive.policy.Policy, which carries the timed choice out or replaces it."""
        k = self._timed()
        if policy is None or self.fixed_k is not None:  # a K the user fixed is not timing-driven
            return k
        return policy.spec_k(k, self.costs.kmax)

    def _timed(self) -> int:
        if self.fixed_k is not None:
            return self.fixed_k
        k, rate = self.best_k()
        if rate > self.margin / self.plain_s:
            self.in_fallback = False
            self.probe_interval = 16
            return k
        self.in_fallback = True
        if self.plain_run >= self.probe_interval:
            self.probe_interval = min(self.probe_interval * 2, self.probe_max)
            return k  # probe
        return 0

    def set_costs(self, costs: CostModel) -> None:
        """Newer costs for the next request: taken when the current ones are still a prior."""
        if self.costs is not None and not self.costs.measured and costs.measured:
            self.costs = costs
            self.spec_factor = 1.0
            if not self.scaled:
                self.plain_s = costs.verify_s[0]
            self.scaled = True

    def record_round(self, k: int, n: int, seconds: float, hidden_frac: float | None = None) -> None:
        d = self.decay
        self.succ = d * self.succ + n
        self.trials = d * self.trials + n + (1 if n < k else 0)
        self.plain_run = 0
        if hidden_frac is not None:
            self.hidden = 0.7 * self.hidden + 0.3 * hidden_frac
        if self.costs is not None and seconds > 0:
            predicted = self.round_cost(k) / self.spec_factor
            if not self.scaled:  # a prior: the first round timed sets the scale
                self.spec_factor = seconds / predicted
                self.plain_s *= self.spec_factor
                self.scaled = True
            else:
                self.spec_factor = 0.8 * self.spec_factor + 0.2 * (seconds / predicted)

    def record_plain(self, seconds: float) -> None:
        self.plain_run += 1
        if seconds > 0:
            if not self.scaled and self.costs is not None:  # a prior: the first step timed sets the scale
                self.spec_factor = seconds / self.costs.verify_s[0]
                self.plain_s = seconds
                self.scaled = True
            else:
                self.plain_s = 0.8 * self.plain_s + 0.2 * seconds
