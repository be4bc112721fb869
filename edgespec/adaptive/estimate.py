"""What a round of candidates is worth: running acceptance per source, and the best tree to verify.

Every candidate continuation comes from a source and a *bucket* of that
source (e.g. how long the context match behind it was). For each
(source, bucket) the `AcceptanceStats` keep, per draft depth d, the running
conditional acceptance a(d) = P(token d accepted | tokens 1..d-1 accepted),
as exponentially forgotten successes / trials started from a prior.

A candidate's node at depth d is then kept with probability
P(node) = a(1) * ... * a(d); where candidates share a prefix (one trie) a
node takes the highest estimate of any candidate through it, and sibling
estimates are scaled down when they sum past their parent's (the verifier's
next token is one token: siblings are disjoint events). Verifying the n most
probable nodes (an ancestor-closed set: P never grows along a path) commits
    E(n) = 1 + sum of their P
tokens, in verify(n + 1) seconds (the measured cost curve) plus fixed costs.
`plan_tree` picks the n maximising E(n) / cost(n); n = 0 is a plain step.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

MAX_DEPTH = 32


@dataclass
class _Table:
    succ: np.ndarray
    trials: np.ndarray


class AcceptanceStats:
    """Running per-depth conditional acceptance of each (source, bucket)."""

    def __init__(self, priors: dict[str, float] | None = None, decay: float = 0.97, prior_weight: float = 2.0,
                 default_prior: float = 0.3):
        self.priors = dict(priors or {})
        self.default_prior = default_prior
        self.decay = decay
        self.prior_weight = prior_weight
        self.tables: dict[tuple[str, object], _Table] = {}

    def _table(self, source: str, bucket) -> _Table:
        key = (source, bucket)
        t = self.tables.get(key)
        if t is None:
            a = self.prior(source, bucket)
            w = self.prior_weight
            t = _Table(np.full(MAX_DEPTH, a * w), np.full(MAX_DEPTH, w))
            self.tables[key] = t
        return t

    def prior(self, source: str, bucket) -> float:
        for key in ((source, bucket), source):
            name = f"{key[0]}:{key[1]}" if isinstance(key, tuple) else key
            if name in self.priors:
                return self.priors[name]
        return self.default_prior

    def rates(self, source: str, bucket, depth: int) -> np.ndarray:
        """a(1..depth) for this source and bucket."""
        t = self._table(source, bucket)
        d = min(depth, MAX_DEPTH)
        return t.succ[:d] / t.trials[:d]

    def path_probs(self, source: str, bucket, depth: int) -> np.ndarray:
        """P(node at depth 1..depth kept) = cumulative product of the conditional rates."""
        return np.cumprod(self.rates(source, bucket, depth))

    def carried(self, weight: float = 6.0) -> AcceptanceStats:
        """A copy for the next request: the same rates, worth at most `weight` trials per depth,
        so what earlier traffic taught is the starting point and new traffic soon outweighs it."""
        out = AcceptanceStats(self.priors, self.decay, self.prior_weight, self.default_prior)
        for key, t in self.tables.items():
            f = np.minimum(1.0, weight / np.maximum(t.trials, 1e-9))
            out.tables[key] = _Table(t.succ * f, t.trials * f)
        return out

    def record(self, source: str, bucket, accepted: int, tried: int) -> None:
        """Depths 1..accepted were kept; depth accepted+1 was rejected if accepted < tried."""
        t = self._table(source, bucket)
        n = min(accepted, MAX_DEPTH)
        end = min(tried, MAX_DEPTH)
        seen = min(n + (1 if accepted < tried else 0), end)
        if seen <= 0:
            return
        d = self.decay
        t.succ[:seen] *= d
        t.trials[:seen] *= d
        t.succ[:n] += 1.0
        t.trials[:seen] += 1.0


# The contention model (below to BUSY): guesses tuned on the 2-core x86 machine under other
# processes' load (docs/adaptive.md); nothing of it was measured on a Mac.
SCALE_MAX = 4.0  # how far a load change since a size was measured may move its price, either way
LOAD_WEIGHT = 0.3  # a round's weight in Costs.load (as a sample's in a size's own average)
LOAD_EASE = 0.98  # per timed plain step, log(load) shrinks by this factor (back to the curve)
# The quiet plain step (Costs.plain_floor): a low expectile of the plain steps' seconds. It
# follows a faster step (FLOOR_DOWN of the gap per step: one outlier moves it little) and a
# slower one only over hundreds of steps (FLOOR_UP), so minutes of contention are not taken
# for the machine's own speed; a machine that did get slower is, within ~1/FLOOR_UP steps.
FLOOR_DOWN, FLOOR_UP = 0.1, 0.002
BUSY = 1.5  # plain steps averaging this much over the quiet one: the cores are shared (Costs.busy)
# The context's price (Costs.ctx_s): fitted from plain steps at different context lengths once
# their lengths spread by CTX_SPREAD positions (standard deviation), forgotten by CTX_DECAY a step.
CTX_SPREAD = 128.0
CTX_DECAY = 0.995


@dataclass
class Costs:
    """Seconds of one verifier pass over T tokens, learnt from the passes actually run.

    Starts from a base curve (`sizes`, `verify_s`, interpolated): a persisted measurement
    of this model on this machine, or a prior shape (edgespec.calibration), or, in tests,
    any curve. Every pass run alone teaches it (`observe`): a size seen in use takes its
    measured time (a moving average, the first measurement replacing the base), and a size
    not seen yet takes the base scaled by how far the measured sizes around it ran from
    the base (interpolated between the nearest measured sizes below and above it, the
    nearest one's ratio beyond them). So one measured plain step puts the whole curve in
    this machine's seconds, and every size used fills in its own point.

    Prices that contention cannot fool: a size's time is kept with the plain step's time of
    the moment it was measured (`ref`), and priced as that time scaled by the plain step's
    time now. Plain steps are measured all the time, wider passes only when chosen: without
    this, a size measured while other processes held the cores stayed dear after they left
    (so it was not chosen again, and not measured again), and one measured on quiet cores
    stayed cheap under load.

    The curve is kept at quiet prices (`busy`): a wider pass slows down more than the plain
    step under contention, so a size timed then would stay dear, scaled by the plain step or
    not, until it was chosen again, and the planner does not choose a dear size. Persisted, it
    did so for good: on this machine, after a contention benchmark, the calibration file priced
    sizes 6 to 32 at 5-20 plain steps, where a quiet pass costs 1.5-3. So while the plain
    step runs BUSY times over its quiet value (`plain_floor`, a low expectile of the plain
    steps), a round's time teaches only `load` below; a size with no quiet value yet takes the
    sample until one comes (and such a size is not persisted). What is persisted (`quiet`) is
    on the quiet plain step's scale.

    What that scaling misses, priced apart (`load`): a wider pass does not slow down with
    the plain step in proportion. With two busy processes on this machine's two cores a plain
    step took 2x its idle time and a tree round 3-5x (several threads wait on each other), so
    rounds ran 1.5-2x dearer than priced, round after round, until the regret guard tripped.
    Every round run alone compares its measured seconds with the curve's price before teaching
    the curve (`observe`); the running ratio (a moving average in log space, bounded by
    SCALE_MAX either way) multiplies every size > 1 where the decoder prices its rounds
    (`under_load`), so a measured size moves every other size at once, and the planner keeps
    only the trees that pay at today's prices (long copies still do; a guess at 1.3 tokens does
    not). Each timed plain step eases it back towards 1 (LOAD_EASE): while no round is run, the
    curve's own prices return, and a round run then measures the load again. Not persisted: a
    load is this moment's.
    """

    sizes: list[int]
    verify_s: list[float]
    draft_s: float = 0.0
    seen: dict[int, float] = field(default_factory=dict)
    counts: dict[int, int] = field(default_factory=dict)  # measurements per size (this process)
    # Sizes whose base value is itself a measurement (persisted by an earlier process): the first
    # measurement here is averaged into it instead of replacing it.
    anchored: set[int] = field(default_factory=set)
    # Per measured size T > 1: the plain step's seconds (seen[1]) when its samples were taken,
    # averaged as they are; verify(T) = seen[T] * seen[1] / ref[T], that factor bounded by SCALE_MAX.
    ref: dict[int, float] = field(default_factory=dict)

    # The load's factor on sizes > 1 (see the class docstring): log of measured / priced, averaged.
    log_load: float = 0.0
    # The quiet plain step's seconds (None until a plain step is known), and the sizes whose
    # value so far comes only from rounds timed while the cores were busy.
    plain_floor: float | None = None
    contended: set[int] = field(default_factory=set)

    # The context: a pass after L cached positions costs the curve's price (at an empty context)
    # plus ctx_s x L x (1 + ctx_share x (T - 1)). ctx_s is fitted from the plain steps' seconds
    # against the context they ran at (a least-squares slope, never below 0); ctx_share is how
    # much of it grows with the pass's width (attention over L for each of the T positions: 1.0
    # on a CPU, where it is compute; a guess). `context` is the L of the request being priced,
    # set by the decoder before it plans (None: passes priced and learnt as before, context-free).
    ctx_s: float = 0.0
    ctx_share: float = 1.0
    context: int | None = None

    def __post_init__(self):
        self._table: list[float] | None = None  # verify(T) for T = 0..max_tokens, rebuilt after observe
        self._ctx_sums = [0.0] * 5  # decayed sums over plain steps: n, L, s, L*L, L*s

    @property
    def load(self) -> float:
        """How much dearer than the curve rounds of T > 1 run now (1.0: as priced)."""
        return math.exp(self.log_load)

    def under_load(self) -> LoadedCosts:
        """The curve as rounds are priced now: sizes > 1 times `load`."""
        return LoadedCosts(self, self.load)

    def calibrated(self, T: int) -> float:
        """The base curve at T (before anything was measured)."""
        return float(np.interp(T, self.sizes, self.verify_s))

    def _build(self) -> list[float]:
        n = np.arange(self.max_tokens + 1, dtype=np.float64)
        base = np.interp(n, self.sizes, self.verify_s)
        if self.seen:
            ks = sorted(self.seen)
            now = {k: self._now(k) for k in ks}
            ratio = [now[k] / max(self.calibrated(k), 1e-12) for k in ks]
            base = base * np.interp(n, ks, ratio)  # clamps: the nearest measured ratio outside
            for k in ks:
                if k <= self.max_tokens:
                    base[k] = now[k]
        return base.tolist()

    def _now(self, T: int) -> float:
        """A measured size's seconds at the plain step's current time (see `ref`)."""
        s, r, one = self.seen[T], self.ref.get(T), self.seen.get(1)
        if not (r and one) or T == 1:
            return s
        return s * min(max(one / r, 1 / SCALE_MAX), SCALE_MAX)

    def ctx_term(self, T: int, L: int | None = None) -> float:
        """Seconds a pass over T tokens costs for its context (L; default `context`)."""
        L = self.context if L is None else L
        if not L or not self.ctx_s:
            return 0.0
        return self.ctx_s * L * (1.0 + self.ctx_share * (max(int(T), 1) - 1))

    def verify(self, T: int) -> float:
        return self._verify(T) + self.ctx_term(T)

    def verify_at(self, T: int, L: int) -> float:
        """A pass over T tokens after L cached positions, whatever `context` is."""
        return self._verify(T) + self.ctx_term(T, L)

    def _learn_context(self, seconds: float, L: int) -> None:
        """A plain step at context L took `seconds`: the least-squares slope of seconds over L."""
        sums, d = self._ctx_sums, CTX_DECAY
        for i, v in enumerate((1.0, L, seconds, L * L, L * seconds)):
            sums[i] = d * sums[i] + v
        n, sl, ss, sll, sls = sums
        var = sll / n - (sl / n) ** 2
        if var >= CTX_SPREAD ** 2:
            self.ctx_s = max((sls / n - (sl / n) * (ss / n)) / var, 0.0)

    def _verify(self, T: int) -> float:
        T = int(T)
        if T in self.seen:
            return self._now(T)
        if self._table is None:
            self._table = self._build()
        if 0 <= T < len(self._table):
            return self._table[T]
        ks = sorted(self.seen)
        r = self._now(ks[-1]) / max(self.calibrated(ks[-1]), 1e-12) if ks else 1.0
        return self.calibrated(T) * r

    def quiet(self) -> dict[int, float]:
        """The measured sizes' seconds on quiet cores, what a later process starts from: priced
        at the quiet plain step (`plain_floor`), leaving out sizes timed only while busy."""
        one, floor = self.seen.get(1), self.plain_floor
        f = floor / one if one and floor else 1.0
        out = {T: self._now(T) * f for T in self.seen if T not in self.contended}
        if one is not None and floor is not None:
            out[1] = floor
        return out

    def busy(self) -> bool:
        """Whether plain steps run well over their quiet time now (other work holds the cores)."""
        one, floor = self.seen.get(1), self.plain_floor
        return one is not None and floor is not None and one > BUSY * floor

    def replace(self, T: int, seconds: float) -> None:
        """A measurement that stands for size T alone (an explicit calibration): what was
        learnt of T before is dropped."""
        T = int(T)
        self.seen.pop(T, None)
        self.ref.pop(T, None)
        self.contended.discard(T)
        self.observe(T, seconds)

    def observe(self, T: int, seconds: float) -> None:
        """A pass over T tokens, run alone, took `seconds` (all the round's work but drafting),
        at the context `context` (the curve keeps it at an empty context: `ctx_term` taken off)."""
        if not seconds > 0 or not np.isfinite(seconds):
            return
        T, seconds = int(T), float(seconds)
        if self.context is not None:
            if T == 1 and not self.busy():
                self._learn_context(seconds, self.context)
            if T > 1:  # the load compares like with like: the price at this context
                r = math.log(seconds / max(self.verify(T), 1e-12))
            seconds = max(seconds - self.ctx_term(T), 0.25 * seconds)
        busy = False
        if T == 1:
            self.log_load *= LOAD_EASE
            floor = self.plain_floor
            if floor is None:  # a persisted plain step is a quiet one (`quiet`)
                floor = self._verify(1) if 1 in self.anchored else seconds
            self.plain_floor = floor + (FLOOR_DOWN if seconds < floor else FLOOR_UP) * (seconds - floor)
        else:  # before the curve learns from it: how far the price was off
            if self.context is None:
                r = math.log(seconds / max(self.verify(T), 1e-12))
            lim = math.log(SCALE_MAX)
            self.log_load = min(max((1 - LOAD_WEIGHT) * self.log_load + LOAD_WEIGHT * r, -lim), lim)
            busy = self.busy()
        self.counts[T] = self.counts.get(T, 0) + 1
        old = self.seen.get(T)
        if busy:
            if (old is not None or T in self.anchored) and T not in self.contended:
                return  # a quiet value stands; `load` carries this moment's excess
            self.contended.add(T)  # nothing quiet known of T: the busy samples stand for now
        elif T in self.contended:  # the first quiet sample replaces the busy ones
            self.contended.discard(T)
            self.seen.pop(T)
            self.ref.pop(T, None)
            old = None
        if old is None and T in self.anchored:
            old = self._verify(T)
        one = self.seen.get(1)  # the plain step's seconds as this sample is taken
        if T != 1 and one is not None:
            r = self.ref.get(T)
            self.ref[T] = one if r is None or old is None else 0.7 * r + 0.3 * one
        self.seen[T] = seconds if old is None else 0.7 * old + 0.3 * seconds
        self._table = None

    def in_seconds(self) -> bool:
        """Whether the curve is this machine's seconds (a size measured here or persisted),
        not only a prior."""
        return bool(self.seen) or bool(self.anchored)

    def known(self, T: int) -> bool:
        """Whether size T has been measured, here or by an earlier process (persisted)."""
        return T in self.seen or T in self.anchored

    def measured(self, T: int | None = None) -> bool:
        """Whether size T (None: any size) has been measured here."""
        return bool(self.seen) if T is None else T in self.seen

    @property
    def max_tokens(self) -> int:
        return int(self.sizes[-1])


class LoadedCosts:
    """A `Costs` curve priced under the current load (`Costs.under_load`): verify(T) of sizes
    > 1 times the load's factor; the plain step (T = 1) is measured all the time already."""

    def __init__(self, costs: Costs, load: float):
        self.costs, self.load = costs, load

    def verify(self, T: int) -> float:
        v = self.costs.verify(T)
        return v * self.load if int(T) > 1 else v

    @property
    def max_tokens(self) -> int:
        return self.costs.max_tokens


class PlainTimer:
    """Seconds of a plain step on this device, timed from pipelined steps (each queued
    before the previous token is handed out), for the cost curve's T = 1.

    A step's cost is the interval between successive tokens becoming ready, when the device
    was what the decoder waited for. When the caller holding the token was slower (a server
    waiting for its reader, a slow consumer), the next step finished meanwhile and the wait
    is next to nothing: such a step says nothing about its cost and gives no sample (the
    interval would be the caller's time, the wait almost zero). The first step of a run has
    no interval: its wait, less the time spent queueing the step after it meanwhile
    (`overlapped_s`), stands for it.
    """

    WAITED = 0.25  # the wait must be at least this fraction of the interval

    def __init__(self, clock=time.perf_counter):
        self.clock = clock  # the decoder's (a fake one in tests)
        self.last: float | None = None

    def sample(self, waited_s: float, overlapped_s: float = 0.0) -> float | None:
        """Called when a token is read, `waited_s` the wait for it -> seconds of its step, or None."""
        now = self.clock()
        prev, self.last = self.last, now
        if prev is None:  # the first step of a run
            return max(waited_s - overlapped_s, 1e-6)
        interval = now - prev
        return interval if waited_s >= self.WAITED * interval else None


@dataclass
class Node:
    token: int
    parent: int  # index in the node list; -1 = the root (the last committed token)
    prob: float
    children: dict[int, int] = field(default_factory=dict)


def merge_candidates(cands: list[tuple[list[int], np.ndarray]]) -> list[Node]:
    """Candidates (tokens, P per depth) -> trie nodes (topological order) with normalised P.

    A node shared by several candidates takes the largest estimate; children whose
    estimates sum past their parent's are scaled to it, recursively.
    """
    nodes: list[Node] = []
    root_children: dict[int, int] = {}
    for tokens, probs in cands:
        kids = root_children
        parent = -1
        for tok, p in zip(tokens, probs, strict=False):
            i = kids.get(tok)
            if i is None:
                i = len(nodes)
                nodes.append(Node(int(tok), parent, float(p)))
                kids[tok] = i
            else:
                nodes[i].prob = max(nodes[i].prob, float(p))
            parent, kids = i, nodes[i].children
    # Scale siblings top-down (parents precede children in `nodes`).
    def scale(kids: dict[int, int], cap: float) -> None:
        total = sum(nodes[i].prob for i in kids.values())
        if total > cap > 0:
            f = cap / total
            for i in kids.values():
                nodes[i].prob *= f
        for i in kids.values():
            nodes[i].prob = min(nodes[i].prob, cap)

    scale(root_children, 1.0)
    for n in nodes:
        scale(n.children, n.prob)
    return nodes


def _order(nodes: list[Node], cap: int) -> list[int]:
    """The nodes a tree of n+1 tokens keeps first: most probable first (a node is never
    likelier than its parent, so every prefix is a tree up to ties, which the depth breaks)."""
    depth = [0] * len(nodes)
    for i, n in enumerate(nodes):
        depth[i] = 1 + (depth[n.parent] if n.parent >= 0 else 0)
    return sorted(range(len(nodes)), key=lambda i: (-nodes[i].prob, depth[i], i))[:max(cap, 0)]


def gain_curve(nodes: list[Node], max_tokens: int) -> np.ndarray:
    """Expected tokens one round commits with the best tree of T tokens, for T = 1..:
    out[T - 1] (out[0] = 1.0, a plain step). What a row offers a batched step
    (edgespec.batch.cost.joint_sizes)."""
    order = _order(nodes, max_tokens - 1)
    return np.concatenate([[1.0], 1.0 + np.cumsum([nodes[i].prob for i in order])])


def closed_top(nodes: list[Node], n: int) -> list[int]:
    """The n most probable nodes, ancestor-closed, in topological order (a tree to verify)."""
    keep = set(_order(nodes, n))
    kept: list[int] = []
    for i in range(len(nodes)):
        if i in keep and (nodes[i].parent < 0 or nodes[i].parent in kept):
            kept.append(i)
    return kept


def plan_tree(nodes: list[Node], costs: Costs, fixed_s: float = 0.0, plain_s: float | None = None,
              max_tokens: int | None = None, margin: float = 1.0, others: float = 0.0) -> tuple[list[int], float]:
    """Choose the nodes to verify -> (kept node indices in topological order, expected tokens/s).

    fixed_s: seconds the round costs beyond the verifier pass (drafting, host work).
    plain_s: seconds of a plain step (default verify(1)); an empty choice means a plain step.
    The chosen set must beat the plain rate by `margin`.
    others: inside a batch, the tokens the other rows commit in the same step (costs are
    then the whole step's, edgespec.batch.cost): the rate maximised is the batch's,
    (others + E(n)) / step(n).
    """
    plain_s = costs.verify(1) if plain_s is None else plain_s
    plain_rate = (others + 1.0) / plain_s
    if not nodes:
        return [], plain_rate
    order = _order(nodes, (max_tokens or costs.max_tokens) - 1)
    if not order:
        return [], plain_rate
    gain = others + 1.0 + np.cumsum([nodes[i].prob for i in order])
    cost = np.array([fixed_s + costs.verify(n + 2) for n in range(len(order))])
    rate = gain / cost
    best = int(np.argmax(rate))
    if rate[best] <= margin * plain_rate:
        return [], plain_rate
    keep = set(order[: best + 1])
    # Ancestor closure (ties could break a path): drop any node whose parent is not kept.
    kept: list[int] = []
    have: set[int] = set()
    for i in range(len(nodes)):
        if i in keep and (nodes[i].parent < 0 or nodes[i].parent in have):
            kept.append(i)
            have.add(i)
    return kept, float(rate[best])


# ------------------------------------------------------------------ a drafter's cost
DRAFT_PRIOR = 0.5  # seconds per drafted token before one is measured, in plain steps (share unknown)
CATCH_UP_PRIOR = 0.25  # seconds per unseen token fed before drafting, before measured, in drafted tokens
FIT_DECAY = 0.85  # forgetting per draft call of DraftCost's least-squares fit
FIT_RIDGE = 0.5  # pull of a loaded DraftCost value on that fit, in tokens^2


@dataclass
class DraftCost:
    """One drafter's learnt costs: seconds per drafted token (`per_token`) and seconds per
    committed token it had not seen (`catch_up`: fed before drafting, the tokens other sources'
    rounds committed since it last drafted).

    A draft call of k tokens after c unseen ones takes about catch_up x c + per_token x k.
    Where a drafter feeds its catch-up inside its first drafting pass (the MLX and Core ML
    drafters: one pass over the unseen tokens and the last one), a call's time cannot be split
    by timing, so both terms are fitted to the calls' (c, k, seconds) by least squares with
    exponential forgetting (FIT_DECAY per call): calls of different c and k tell them apart.
    Values loaded from a file pull the fit weakly (FIT_RIDGE tokens^2); with no call that had
    unseen tokens the catch-up stays unmeasured (CATCH_UP_PRIOR of a drafted token applies),
    and calls with c = 0 (mode speculative's) teach per_token alone, as seconds / tokens.

    As the verify curve keeps quiet prices (`Costs.busy`), what is persisted (`quiet`) is
    fitted to the calls made while the cores were not busy (`busy`, the engine's curve's), so
    a busy spell does not price the drafter out of the next process's plans; the fit the
    planner uses now (`per_token`, `catch_up`) takes every call."""

    per_token: float | None = None  # None: not measured (the prior applies)
    catch_up: float | None = None  # seconds per unseen token; None: not measured
    prior: float = DRAFT_PRIOR  # seconds per token before one is measured, in plain steps
    count: int = 0  # measurements in this process
    fresh: bool = False  # measured in this process on quiet cores (persist `quiet()`)
    busy: Callable[[], bool] | None = field(default=None, repr=False, compare=False)

    def __post_init__(self):
        self._anchor = (self.catch_up, self.per_token)  # what it started from (a file's values)
        self._sums = [0.0] * 5  # decayed sums of c*c, c*k, k*k, c*t, k*t over the calls
        self._quiet_sums = [0.0] * 5  # the same over the calls made while not busy
        self._quiet: tuple[float | None, float] | None = None  # (catch_up, per_token) fitted to them

    def observe(self, tokens: int, seconds: float, unseen: int = 0) -> None:
        """A draft call of `tokens` tokens that first fed `unseen` committed tokens took `seconds`."""
        if tokens <= 0 or not seconds > 0 or not math.isfinite(seconds):
            return
        c, k, t = max(int(unseen), 0), int(tokens), float(seconds)
        terms = (c * c, c * k, k * k, c * t, k * t)
        quiet = self.busy is None or not self.busy()
        for sums in (self._sums, self._quiet_sums) if quiet else (self._sums,):
            for i, v in enumerate(terms):
                sums[i] = FIT_DECAY * sums[i] + v
        self.catch_up, self.per_token = self._fit(self._sums, self.catch_up, self.per_token)
        if quiet:
            before = self._quiet or (self._anchor[0], self._anchor[1])
            self._quiet = self._fit(self._quiet_sums, *before)
            self.fresh = True
        self.count += 1

    def quiet(self) -> tuple[float | None, float] | None:
        """(catch_up, per_token) fitted to this process's calls on quiet cores (None: none)."""
        return self._quiet

    def _fit(self, sums, catch_up, per_token) -> tuple[float | None, float]:
        """The least-squares (catch_up, per_token) of these sums; the arguments: the values so far."""
        cc, ck, kk, ct, kt = sums
        a0, b0 = self._anchor
        # A loaded value pulls its term weakly; an unmeasured catch-up is pulled to 0 only
        # infinitesimally (it decides a only where no call had c > 0, or c/k never varied).
        la, a0 = (FIT_RIDGE, a0) if a0 is not None else (1e-9, 0.0)
        lb, b0 = (FIT_RIDGE, b0) if b0 is not None else (0.0, 0.0)
        m11, m12, m22 = cc + la, ck, kk + lb
        r1, r2 = ct + la * a0, kt + lb * b0
        det = m11 * m22 - m12 * m12
        a = (r1 * m22 - m12 * r2) / det
        b = (m11 * r2 - m12 * r1) / det
        if a < 0:  # noise: no catch-up cost, the steps alone
            a, b = 0.0, r2 / m22
        if not b > 0:  # noise the other way: keep the steps' price, the catch-up takes the rest
            b = per_token if per_token is not None else r2 / m22
            a = max((r1 - m12 * b) / m11, 0.0)
        return (float(a) if cc > 0 or catch_up is not None else catch_up), float(b)

    def value(self, plain_s: float) -> float:
        """Seconds per drafted token: measured, else the prior relative to a plain step."""
        return self.per_token if self.per_token is not None else self.prior * plain_s

    def catch_up_s(self, unseen, plain_s: float):
        """Seconds to feed `unseen` committed tokens before drafting (a number or an array)."""
        per = self.catch_up if self.catch_up is not None else CATCH_UP_PRIOR * self.value(plain_s)
        return unseen * per
