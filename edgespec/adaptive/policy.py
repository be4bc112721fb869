"""Every timing-driven decision of a decoding round, in one replaceable object.

What the adaptive decoder does each round is decided from measured timings (the
verify-cost curve, the plain step's time, drafting cost, batch pricing): whether a
round is a plain step or a tree, how long a drafter chain is, which trie nodes
the tree keeps, whether lookahead's Jacobi window rides along. None of these may
change the output (every committed token is the one plain decoding draws there),
and to *show* that, a test must be able to replay and explore them. So the
decoder computes its timed choice and hands it to its `Policy`, which returns
what to do:

- `TimedPolicy` (the default) returns the timed choice unchanged;
- `SeededPolicy(seed)` replaces each choice by a seeded random one (exploring tree
  shapes, draft lengths and plain/tree switches no timing would pick);
- `ScriptedPolicy(decisions)` replays a recorded list exactly.

Every policy records what it returned (`decisions`): a failing test prints the
seed and the decisions, and `ScriptedPolicy(decisions)` replays them.

The timed policy also holds a `RegretGuard`: prices learnt at one moment can be
wrong at the next (another process takes the cores, the verify-cost curve and the
plain step's time were measured before), so the guard compares what the choices
actually realise (tokens per second of the speculative rounds) with plain steps
measured in the same window of rounds, interleaving a plain step when none is
recent, and sends the decoder back to plain steps when the choices lose, probing
again later with a growing wait. The decoder reads time through the policy's
`clock`, so tests run it on a fake clock.

Decision kinds (the tuple recorded):
- ("plan", kind, draft_k): "plain" or "tree", and the drafter chain's length (0: none);
- ("tree", kept): the trie node indices verified (ancestor-closed, topological);
- ("window", on): whether the Jacobi window rides along this round;
- ("spec_k", k): modes speculative's, prompt_lookup's and cascade's draft length for the next
  round (0: a plain step);
- ("step", kind): modes tree's and lookahead's step kind ("full", "lean" or "plain");
- ("tree_size", n): the drafted nodes a dynamic tree of mode tree keeps;
- ("pipeline", on): whether `auto` drafts the next round while this one is verified
  (edgespec.adaptive.pipeline; asked only in rounds that draft and can draft ahead);
- ("runner_up", on): whether such a round also drafts ahead from its runner-up premise (asked
  only where the tree has one).
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import replace

from edgespec.costs.clock import default_clock


class RegretGuard:
    """Realised tokens/s of speculative rounds against plain steps of the same window.

    Fed by the decoder (`round_done`: a tree round's committed tokens and seconds;
    `plain_done`: a plain step's seconds), it answers two questions each round:
    `want_plain` (a plain step now, instead of what the prices chose) and
    `plain_s()` (a plain step's seconds as measured recently, for the planner).

    - Paired: a verdict compares the last `rounds` speculative rounds with plain steps
      measured no more than `rounds` rounds before the oldest of them (the same
      window). When no plain step is that recent and the rounds look worse than the
      last one, or every `refresh` speculative rounds in any case, one plain step is
      interleaved (`want_plain` for one step), so both sides are measured under the
      same load.
    - Regret: when the rounds' tokens/s fall below `margin` times the paired plain
      rate (after at least `min_rounds` rounds), the guard trips: plain steps for
      `hold` steps, `hold` doubling at every trip up to `max_hold` (back off while
      speculation keeps losing), then speculation is probed again on fresh samples.
      A window that pays resets `hold`.
    - Time is judged quickly, luck slowly: after `min_rounds` rounds the verdict takes the
      tokens the rounds' prices expected (`round_done(..., expected)`) over their measured
      seconds, so rounds that run slower than priced (contention) trip it at once; the
      tokens they committed count only over a full window of `rounds` (acceptance estimates
      that are wrong for this content lose round after round; a few unlucky rounds do not).
      Judged on 3 committed rounds, the guard tripped on an idle machine whenever a few
      chat rounds were unlucky; judged on expected tokens alone, it let a busy machine's
      chat replies draft 50 tokens for 2 accepted (0.73x plain).

    The plain steps' timings are kept across requests (a busy machine stays busy); the hold
    and the verdict's rounds are not (`new_request`: a request's content says nothing about
    the next one's; a hold carried over, doubled to 1024 steps, kept whole requests plain).
    Times come from `clock`.
    Counts only, no timing: `trips`, `releases`, `interleaves`, `events` (each
    ("trip"|"release"|"interleave", tokens so far)) for tests and reports.
    """

    def __init__(self, rounds: int = 8, min_rounds: int = 3, margin: float = 0.9, hold: int = 16,
                 max_hold: int = 1024, refresh: int = 64, plain_keep: int = 4):
        self.rounds, self.min_rounds, self.margin = rounds, min_rounds, margin
        self.base_hold, self.max_hold, self.refresh = hold, max_hold, refresh
        self.hold = hold  # plain steps of the next trip
        self.spec: deque = deque(maxlen=rounds)  # (round index, tokens, expected tokens, seconds)
        self.plain: deque = deque(maxlen=plain_keep)  # (round index at the time, seconds)
        self.round_no = 0  # speculative rounds seen (the window's clock: load changes by rounds)
        self.hold_left = 0  # plain steps still to run before probing again
        self.interleave = False  # one plain step asked for (a paired sample)
        self.want_plain = False  # hold_left > 0 or interleave: the only thing the hot path reads
        self.tokens = 0
        self.trips = self.releases = self.interleaves = 0
        self.events: list[tuple[str, int]] = []
        self._tripped = False  # since the last trip, no window has paid yet

    # ------------------------------------------------------------ fed by the decoder
    def plain_done(self, seconds: float | None) -> None:
        """A plain step ran; `seconds` None when its time says nothing (a slow caller)."""
        self.tokens += 1
        if seconds is not None:
            self.plain.append((self.round_no, max(seconds, 1e-9)))
        if self.interleave:
            self.interleave = False
        elif self.hold_left > 0:
            self.hold_left -= 1
        self.want_plain = self.hold_left > 0

    def new_request(self) -> None:
        """A request starts: the plain steps measured before still say what the load is (kept),
        but what the last request's content did says nothing about this one's: no hold, no
        backed-off wait, its verdicts on its own rounds."""
        self.spec.clear()
        self.hold, self.hold_left = self.base_hold, 0
        self.interleave = self.want_plain = self._tripped = False

    def round_done(self, tokens: int, seconds: float, expected: float | None = None) -> None:
        """A speculative round committed `tokens` in `seconds`; `expected`: the tokens its
        prices assumed (see the class docstring: time and luck are judged apart)."""
        self.tokens += tokens
        self.round_no += 1
        self.spec.append((self.round_no, tokens, tokens if expected is None else expected, seconds))
        if len(self.spec) < self.min_rounds:
            return
        plain = self._paired()
        secs = max(sum(r[3] for r in self.spec), 1e-12)
        # Time: what the prices expected, at the speed the rounds ran (quick: min_rounds).
        # Luck and time: what the rounds committed, over a full window only (a few unlucky
        # rounds are not a verdict; a window of them is: the acceptance estimates are wrong).
        spec_rate = sum(r[2] for r in self.spec) / secs
        if len(self.spec) == self.rounds:
            spec_rate = min(spec_rate, sum(r[1] for r in self.spec) / secs)
        if plain is None:
            last = self.plain[-1][1] if self.plain else None
            # Looks worse than the last plain step, or no plain step for `refresh` rounds:
            # measure one now (the verdict waits for it).
            if last is None or spec_rate < self.margin / last or self.round_no - self.plain[-1][0] >= self.refresh:
                self._ask("interleave")
            return
        if spec_rate < self.margin / plain:
            self._trip()
        elif self._tripped and len(self.spec) >= self.min_rounds:
            self._tripped = False
            self.hold = self.base_hold  # speculation pays again: the next trip starts short
            self.releases += 1
            self.events.append(("release", self.tokens))
        if not self.want_plain and self.round_no - self.plain[-1][0] >= self.refresh:
            self._ask("interleave")

    # ------------------------------------------------------------ read by the policy
    def plain_s(self) -> float | None:
        """Seconds of a plain step measured within the last `refresh` speculative rounds
        (the median of the recent ones), or None when none is that recent."""
        if not self.plain or self.round_no - self.plain[-1][0] > self.refresh:
            return None
        recent = sorted(s for r, s in self.plain if self.round_no - r <= self.refresh)
        return recent[len(recent) // 2]

    def _paired(self) -> float | None:
        """The plain step's seconds measured in the current window of rounds, or None."""
        oldest = self.spec[0][0]
        same = [s for r, s in self.plain if r >= oldest - self.rounds]
        if not same:
            return None
        same.sort()
        return same[len(same) // 2]

    def _ask(self, why: str) -> None:
        self.interleave = True
        self.want_plain = True
        self.interleaves += 1
        self.events.append((why, self.tokens))

    def _trip(self) -> None:
        self.hold_left = self.hold
        self.hold = min(self.hold * 2, self.max_hold)
        self.want_plain = True
        self.spec.clear()  # the probe after the hold is judged on its own rounds
        self._tripped = True
        self.trips += 1
        self.events.append(("trip", self.tokens))


class Policy:
    """The default: what the timings chose (subclasses override `choose`).

    clock: the decoder's time source (seconds); a test passes a fake one."""

    def __init__(self, clock=None):
        self.decisions: list[tuple] = []
        self.clock = clock if clock is not None else default_clock()  # a profile's simulated one

    # What the decoder tells the policy after each round run alone (not inside a batch,
    # whose own guard compares step shapes: edgespec.batch.guard). Default: nothing kept.
    def begin(self, memory: dict) -> None:
        """A request starts; `memory` is the decoder's, kept across requests."""

    def plain_done(self, seconds: float | None) -> None:
        pass

    def round_done(self, tokens: int, seconds: float, expected: float | None = None) -> None:
        pass

    def plain_s(self, default: float) -> float:
        """Seconds of a plain step to price rounds against (default: the decoder's average)."""
        return default

    # The decoder's hooks: each gets the timed choice and returns the one to carry out.
    def plan(self, default, can_tree: bool, can_draft: bool, kmax: int):
        kind, k = self.choose("plan", (default.kind, default.draft_k), can_tree=can_tree,
                              can_draft=can_draft, kmax=kmax)
        if (kind, k) != (default.kind, default.draft_k):
            default = replace(default, kind=kind, draft_k=k, probe=False)
        self.decisions.append(("plan", kind, k))
        return default

    def tree(self, nodes, default: list[int], cap: int) -> list[int]:
        return list(self._decide("tree", default, tuple, nodes=nodes, cap=cap))

    def window(self, default: bool) -> bool:
        return self._decide("window", default, bool)

    def spec_k(self, default: int, kmax: int) -> int:
        return self._decide("spec_k", default, int, kmax=kmax)

    def step(self, default: str, kinds: tuple[str, ...]) -> str:
        """A step controller's kind (modes tree and lookahead: edgespec.lookahead.StepController)."""
        return self._decide("step", default, str, kinds=tuple(kinds))

    def tree_size(self, default: int, n_max: int) -> int:
        """How many drafted nodes a dynamic tree of mode tree keeps (edgespec.tree.TreeBudget)."""
        return self._decide("tree_size", default, int, n_max=n_max)

    def pipeline(self, default: bool) -> bool:
        """Whether `auto` drafts the next round while this round's tree is verified."""
        return self._decide("pipeline", default, bool)

    def runner_up(self, default: bool) -> bool:
        """Whether a round that drafts ahead also drafts from the runner-up premise."""
        return self._decide("runner_up", default, bool)

    def _decide(self, kind: str, default, cast, **ctx):
        """`choose`'s answer to a hook, as `cast`, recorded in `decisions` (replays read them)."""
        value = cast(self.choose(kind, default, **ctx))
        self.decisions.append((kind, value))
        return value

    def choose(self, kind: str, default, **ctx):
        return default


class TimedPolicy(Policy):
    """What the measured timings chose (the default), overruled by a `RegretGuard` when
    the choices realise fewer tokens/s than plain steps measured in the same window.

    guard: the guard to use; None takes the one kept in the decoder's memory (made at
    the first request), so what a request learnt about the load carries to the next."""

    def __init__(self, guard: RegretGuard | None = None, clock=None):
        super().__init__(clock)
        self.guard = guard
        self._own = guard is not None

    def begin(self, memory):
        if not self._own:
            self.guard = memory.setdefault("guard", RegretGuard())
        self.guard.new_request()

    def prefer(self, default, can_tree, can_draft, kmax):
        """The priced choice before the guard looks at it (a test overrides it to stand for
        prices that contention fooled)."""
        return default

    def plan(self, default, can_tree, can_draft, kmax):  # nothing recorded: the hot path stays lean
        plan = self.prefer(default, can_tree, can_draft, kmax)
        g = self.guard
        if g is not None and g.want_plain and plan.kind != "plain":
            return replace(plan, kind="plain", draft_k=0, probe=False)
        return plan

    def tree(self, nodes, default, cap):
        return default

    def window(self, default):
        g = self.guard
        return default and not (g is not None and g.want_plain)

    def plain_done(self, seconds):
        if self.guard is not None:
            self.guard.plain_done(seconds)

    def round_done(self, tokens, seconds, expected=None):
        if self.guard is not None:
            self.guard.round_done(tokens, seconds, expected)

    def plain_s(self, default):
        s = self.guard.plain_s() if self.guard is not None else None
        return default if s is None else s

    def spec_k(self, default, kmax):
        return default

    def step(self, default, kinds):
        return default

    def tree_size(self, default, n_max):
        return default

    def pipeline(self, default):
        return default

    def runner_up(self, default):
        return default


class SeededPolicy(Policy):
    """Seeded random choices: plain or tree rounds, any draft length, any ancestor-closed
    tree up to the pass's cap, the window on or off. The same seed and the same calls give
    the same decisions."""

    def __init__(self, seed: int, p_plain: float = 0.25):
        super().__init__()
        self.seed = seed
        self.rng = random.Random(seed)
        # drawn apart: the other choices of a seed stay what they were before this kind existed
        self.pipe_rng = random.Random(seed + 1)
        self.runner_rng = random.Random(seed + 2)
        self.p_plain = p_plain

    def choose(self, kind, default, **ctx):
        r = self.rng
        if kind == "plan":
            options = [("plain", 0)]
            if ctx["can_tree"]:
                options.append(("tree", 0))
            if ctx["can_draft"]:
                options += [("tree", k) for k in range(1, ctx["kmax"] + 1)]
            if len(options) == 1 or r.random() < self.p_plain:
                return options[0]
            return r.choice(options[1:])
        if kind == "tree":
            nodes, cap = ctx["nodes"], ctx["cap"]
            n = r.randint(0, min(len(nodes), cap - 1))
            keep_p = r.choice((0.3, 0.6, 1.0))
            kept: list[int] = []
            inside: set[int] = set()
            for i, node in enumerate(nodes):
                if len(kept) >= n:
                    break
                if (node.parent < 0 or node.parent in inside) and r.random() < keep_p:
                    kept.append(i)
                    inside.add(i)
            return kept
        if kind == "window":
            return r.random() < 0.5
        if kind == "spec_k":  # 0: a plain step (the fallback)
            return 0 if r.random() < self.p_plain else r.randint(1, ctx["kmax"])
        if kind == "step":
            return r.choice(ctx["kinds"])
        if kind == "tree_size":
            return r.randint(0, ctx["n_max"])
        if kind == "pipeline":
            return self.pipe_rng.random() < 0.5
        if kind == "runner_up":
            return self.runner_rng.random() < 0.5
        return default

    def describe(self) -> str:
        return f"SeededPolicy(seed={self.seed}): {len(self.decisions)} decisions: {self.decisions!r}"


class ScriptedPolicy(Policy):
    """Replays recorded decisions in order (`Policy.decisions` of an earlier run); past their
    end, or where a recorded decision does not fit the call, the timed choice."""

    def __init__(self, decisions: list[tuple]):
        super().__init__()
        self.script = list(decisions)
        self.pos = 0

    def choose(self, kind, default, **ctx):
        while self.pos < len(self.script):
            d = self.script[self.pos]
            self.pos += 1
            if d[0] != kind:
                continue  # a call the replayed run did not make here: skip to the next of this kind
            if kind == "plan":
                return d[1], d[2]
            if kind == "tree":
                nodes = ctx["nodes"]
                return [i for i in d[1] if i < len(nodes)]
            if kind == "step":
                return d[1] if d[1] in ctx["kinds"] else default
            if kind == "tree_size":
                return min(d[1], ctx["n_max"])
            return d[1]
        return default


def policy_for(engine) -> Policy:
    """The engine's policy (Engine.policy), or the timed default."""
    p = getattr(engine, "policy", None)
    return p if p is not None else TimedPolicy()
