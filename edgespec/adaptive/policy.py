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

Decision kinds (the tuple recorded):
- ("plan", kind, draft_k): "plain" or "tree", and the drafter chain's length (0: none);
- ("tree", kept): the trie node indices verified (ancestor-closed, topological);
- ("window", on): whether the Jacobi window rides along this round;
- ("spec_k", k): mode speculative's draft length for the next round.
"""

from __future__ import annotations

import random
from dataclasses import replace


class Policy:
    """The default: what the timings chose (subclasses override `choose`)."""

    def __init__(self):
        self.decisions: list[tuple] = []

    # The decoder's hooks: each gets the timed choice and returns the one to carry out.
    def plan(self, default, can_tree: bool, can_draft: bool, kmax: int):
        kind, k = self.choose("plan", (default.kind, default.draft_k), can_tree=can_tree,
                              can_draft=can_draft, kmax=kmax)
        if (kind, k) != (default.kind, default.draft_k):
            default = replace(default, kind=kind, draft_k=k, probe=False)
        self.decisions.append(("plan", kind, k))
        return default

    def tree(self, nodes, default: list[int], cap: int) -> list[int]:
        kept = list(self.choose("tree", default, nodes=nodes, cap=cap))
        self.decisions.append(("tree", tuple(kept)))
        return kept

    def window(self, default: bool) -> bool:
        on = bool(self.choose("window", default))
        self.decisions.append(("window", on))
        return on

    def spec_k(self, default: int, kmax: int) -> int:
        k = int(self.choose("spec_k", default, kmax=kmax))
        self.decisions.append(("spec_k", k))
        return k

    def choose(self, kind: str, default, **ctx):
        return default


class TimedPolicy(Policy):
    """What the measured timings chose (the default)."""

    def plan(self, default, can_tree, can_draft, kmax):  # nothing recorded: the hot path stays lean
        return default

    def tree(self, nodes, default, cap):
        return default

    def window(self, default):
        return default

    def spec_k(self, default, kmax):
        return default


class SeededPolicy(Policy):
    """Seeded random choices: plain or tree rounds, any draft length, any ancestor-closed
    tree up to the pass's cap, the window on or off. The same seed and the same calls give
    the same decisions."""

    def __init__(self, seed: int, p_plain: float = 0.25):
        super().__init__()
        self.seed = seed
        self.rng = random.Random(seed)
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
        if kind == "spec_k":
            return r.randint(1, ctx["kmax"])
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
            return d[1]
        return default


def policy_for(engine) -> Policy:
    """The engine's policy (Engine.policy), or the timed default."""
    p = getattr(engine, "policy", None)
    return p if p is not None else TimedPolicy()
