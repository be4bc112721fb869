"""Candidate sources of the adaptive decoder: one small protocol, capabilities declared.

A source proposes continuations of the committed sequence (which ends with
x0, the last committed token, not yet in the verifier's cache). What the
decoder needs to know about a source is declared, not probed:

- `point_mass`: proposals are fixed tokens, not samples of a distribution;
- `has_q`: proposals are drawn from a model distribution q that the source can
  also return (mode `speculative` uses it for rejection sampling). The adaptive
  decoder verifies every proposal by "draw, then match" (see decoder.py), so it
  asks such a source for its greedy chain and treats it as point-mass;
- `cost_per_token`: seconds per proposed token (0 for look-ups); a source
  with a cost is only asked when the planner expects it to pay;
- `catches_up`: before proposing, the source first feeds the committed tokens it has not
  seen (`unseen(seq)`, counted before the call), priced apart from its tokens
  (`catch_up_s`): a drafter that drafts rarely has much to catch up on, which says nothing
  about what its drafted tokens cost;
- `grammar`: the source follows the request's grammar (bound per request with
  `bind`, see edgespec.logits.processors.wrap_processors); it proposes nothing without one;
- `vets`: the source also trims other sources' candidates (`vet`) to the prefix the
  request can accept at all, before the verifier pass.

Sources: "context" (n-grams of this request's prompt and output, ranked by
match length: prompt lookup generalised to several candidates), "history"
(the engine's earlier prompts and replies, see `history.py`), "corpus" (a frozen
n-gram table of the verifier's own answers, see `corpus.py`), "drafter" (an
attached drafter's chain), "forced" (the grammar's single continuation: under a
JSON schema, keys, braces and enum tails; accepted with probability 1 because the
masked distribution there is a point mass).
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Protocol

import mlx.core as mx

from edgespec.adaptive.estimate import DraftCost
from edgespec.adaptive.pipeline import can_draft_ahead
from edgespec.lookahead.pool import JacobiWindow, NgramPool


@dataclass(frozen=True)
class Capabilities:
    point_mass: bool = True
    has_q: bool = False
    cost_per_token: float = 0.0
    grammar: bool = False
    vets: bool = False
    catches_up: bool = False


@dataclass
class Candidate:
    tokens: list[int]
    source: str
    bucket: object = 0  # the stats bucket (e.g. match length) its acceptance is tracked under
    logprobs: mx.array | None = None  # (k, V) q of a has_q source
    # Per token, the bucket of that token's own acceptance (given the tokens before it were
    # accepted), for a source that knows how sure it is token by token (the drafter's own
    # probability of each token): its node probabilities multiply these buckets' rates instead
    # of reading `bucket`'s per-depth rates. None: per depth under `bucket`.
    token_buckets: tuple | None = None
    # The tokens before `own` are another candidate's of the same round (a runner-up hangs
    # below the drafted chain's prefix): only tokens from `own` on are scored for this one.
    own: int = 0


class Source(Protocol):
    name: str
    caps: Capabilities
    # First guesses of the per-depth acceptance before anything is measured, by stats key
    # ("name:bucket", or "name" for every bucket); what the decoder learns replaces them.
    priors: Mapping[str, float]

    def begin(self, prompt: list[int]) -> None: ...

    def propose(self, seq: list[int], limit: int, span: int) -> list[Candidate]: ...

    def close(self) -> None: ...


class ContextSource:
    """Continuations copied from this request's own prompt and output (several, ranked)."""

    name = "context"
    caps = Capabilities()
    priors = MappingProxyType({
        "context:(4, False)": 0.8, "context:(3, False)": 0.6, "context:(2, False)": 0.45,
        "context:(1, False)": 0.3, "context:(0, False)": 0.15, "context": 0.1,
    })
    MAX_BUCKET = 4

    def __init__(self, span: int = 16):
        self.pool = NgramPool(span, 1)
        self.span = span

    def begin(self, prompt: list[int]) -> None:
        self.pool = NgramPool(self.span, 1)
        self.pool.add_text(list(prompt))

    def propose(self, seq: list[int], limit: int, span: int) -> list[Candidate]:
        self.pool.add_text(seq)
        out = []
        for rank, (k, cont) in enumerate(self.pool.text_matches(seq, limit)):
            out.append(Candidate(cont[:span], self.name, (min(k, self.MAX_BUCKET), rank > 0)))
        return out

    def close(self) -> None:
        self.pool = NgramPool(self.span, 1)


class HistorySource:
    """Continuations from earlier generations of this engine (see HistoryStore)."""

    name = "history"
    caps = Capabilities()
    priors = MappingProxyType({"history": 0.4})

    def __init__(self, store):
        self.store = store

    def begin(self, prompt: list[int]) -> None:
        pass

    def propose(self, seq: list[int], limit: int, span: int) -> list[Candidate]:
        return [
            Candidate(cont, self.name, (n, rank > 0))
            for rank, (n, cont) in enumerate(self.store.lookup(seq, limit, span))
        ]

    def close(self) -> None:
        pass


class CorpusSource:
    """Chains from a frozen n-gram table of the verifier's own answers (see corpus.py)."""

    name = "corpus"
    caps = Capabilities()

    def __init__(self, table):
        self.table = table
        # Measured when the table was built (on held-out answers, by first-step bucket).
        self.priors = MappingProxyType({"corpus": 0.15, **table.priors})

    def begin(self, prompt: list[int]) -> None:
        pass

    def propose(self, seq: list[int], limit: int, span: int) -> list[Candidate]:
        if limit <= 0:
            return []
        tokens, bucket = self.table.chain(seq, span)
        return [Candidate(tokens, self.name, bucket)] if tokens else []

    def close(self) -> None:
        pass


# The drafter's own probability of a token, binned: token buckets "q<bin>" (a drafted token)
# and "r<bin>" (a runner-up at a drafted position). First guesses before anything is learnt:
# the acceptance a drafter 4/5 as sure as it thinks would have (the shipped one measured 0.04
# to 0.92 from the lowest bin to the highest on the mixed set, chain tokens).
SURE_EDGES = (0.1, 0.2, 0.3, 0.45, 0.6, 0.75, 0.9)
_MIDS = (0.05, 0.15, 0.25, 0.375, 0.525, 0.675, 0.825, 0.95)
SURE_PRIORS = {f"drafter:{kind}{i}": round(0.8 * m, 3) for kind in "qr" for i, m in enumerate(_MIDS)}
# Off by default: on the CPU (MLX, default model) they lost to the chain alone in every
# side-by-side run (docs/adaptive.md, "How sure the drafter is"); options `runner_ups` (2 was
# tried) and `draft_floor` (0.4 was best offline, 0.15 tried too) turn them on.
RUNNER_UPS = 0  # runner-ups offered per drafted position (measured: CPU, 2-core x86; a guess for Metal)
# A drafter that ranks (DrafterCaps.ranks) stops its chain once the product of its own
# probabilities of the drafted tokens falls below this; 0: the planner's k.
SURE_FLOOR = 0.0


def sure_bucket(kind: str, p: float) -> str:
    return f"{kind}{bisect.bisect(SURE_EDGES, p)}"


# A drafter that grows its own trees (DrafterCaps.trees, EAGLE-2's dynamic tree): per depth the
# TREE_WIDTH best nodes by path score are expanded, TREE_TOPK children each, and the TREE_NODES
# best nodes are offered; the planner keeps what pays of them (a guess, not measured yet).
TREE_WIDTH, TREE_TOPK, TREE_NODES = 3, 2, 16


def tree_candidates(tree, source: str) -> list[Candidate]:
    """A drafter's DraftTree -> one candidate per leaf, the chain of first children first; each
    token priced by the drafter's own probability of it given its path ("q<bin>" for the likeliest
    child kept, "r<bin>" for the others: the buckets of a chain and its runner-ups), and
    `own` from the first token no earlier candidate has."""
    kids: dict[int, list[int]] = {-1: []}
    for i, p in enumerate(tree.parents):
        kids.setdefault(i, [])
        kids[p].append(i)
    out, seen, stack = [], set(), list(reversed(kids[-1]))
    while stack:
        i = stack.pop()
        if kids[i]:
            stack.extend(reversed(kids[i]))
            continue
        path = [i]
        while tree.parents[path[-1]] >= 0:
            path.append(tree.parents[path[-1]])
        path.reverse()
        own = 0
        while own < len(path) and path[own] in seen:
            own += 1
        seen.update(path)
        buckets = tuple(sure_bucket("q" if kids[tree.parents[j]][0] == j else "r", tree.probs[j]) for j in path)
        out.append(Candidate([tree.tokens[j] for j in path], source, 0, None, buckets, own))
    return out


class DrafterSource:
    """A drafter's chain of k tokens (with its q), asked only when the planner expects it to pay.

    Asked to (`runner_ups` > 0 or `floor` > 0), a drafter that ranks its tokens
    (`DrafterCaps.ranks`) stops its chain early where it is unsure (`floor`), and each token is
    priced by how sure the drafter was of it (token buckets "q<bin>", learnt like any bucket);
    its `runner_ups` next most likely tokens at every drafted position join the round as
    one-token branches below the chain's prefix ("r<bin>"). The planner keeps what pays of
    them (`plan_tree`), as of every other source's candidates.

    A drafter that grows its own trees (`DrafterCaps.trees`: an EAGLE-3 head, EAGLE-2's dynamic
    tree) offers, when the planner asks for k tokens, a tree k levels deep instead
    (`tree_candidates`: one candidate per leaf, each token in the same "q"/"r" buckets by the
    drafter's probability of it given its path), so a node's price is its path score as the
    buckets have learnt to read it, and the planner chooses how wide to verify.

    A draft call first feeds the drafter the committed tokens it has not seen (those of the
    rounds it did not draft: its catch-up), then drafts k tokens. A drafter that declares it
    (`DrafterCaps.catches_up`) counts those tokens beforehand (`unseen`), and a call is priced
    `draft_s` = catch-up x unseen + k x per token. Both are learnt from the drafting calls it
    makes (`observe`, into a `estimate.DraftCost` the engine keeps and persists); until
    measured the planner prices them from priors (a fraction of a plain step,
    `estimate.DRAFT_PRIOR`; a fraction of a drafted token, `estimate.CATCH_UP_PRIOR`).

    Drafting ahead (edgespec.adaptive.pipeline): the decoder may call `draft` on the drafter's
    worker thread with a premise past the committed sequence while the verifier's pass runs;
    `ahead_refused` says why a drafter cannot (None: it can), and `pin` comes first, on the
    decoder's thread, for a drafter that reads the verifier's cache."""

    name = "drafter"

    def __init__(self, drafter, draft_s=None, clock=time.perf_counter, runner_ups: int = RUNNER_UPS,
                 floor: float = SURE_FLOOR, trees: bool = True):
        """draft_s: seconds per drafted token (a number: fixed), a estimate.DraftCost (learnt),
        or None (learnt from nothing). clock: what draft calls are timed with (the adaptive
        decoder hands it its policy's clock). runner_ups, floor: for a drafter that ranks its
        tokens (see the class). trees: a drafter that grows its own trees (DrafterCaps.trees)
        offers them (`tree_candidates`, k levels deep) instead of a chain, unless runner_ups
        or floor ask for its ranked chain."""
        if drafter.caps.needs_features:
            raise ValueError(f"drafter {drafter.name!r} reads verifier features; it drafts in mode 'speculative' only")
        if not drafter.caps.syncs:
            raise ValueError(f"drafter {drafter.name!r} cannot follow another source's tokens (no sync)")
        self.drafter = drafter
        self.cost = draft_s if isinstance(draft_s, DraftCost) else DraftCost(
            None if draft_s is None else float(draft_s))
        self.expected_acceptance = float(drafter.expected_acceptance)
        # ranked drafting (and each token priced by the drafter's probability) only when asked
        self.ranks = 1 + int(runner_ups) if drafter.caps.ranks and (runner_ups > 0 or floor > 0.0) else 0
        self.floor = float(floor)
        # a tree of its own unless ranked chains were asked for (runner_ups, floor)
        self.trees = bool(trees) and drafter.caps.trees and not self.ranks
        self.priors = MappingProxyType({"drafter": self.expected_acceptance,
                                        **(SURE_PRIORS if self.ranks or self.trees else {})})
        self._prompt: list[int] | None = None
        self.clock = clock
        self.last_s = 0.0  # seconds of the last draft call, the drafter's prefill of the prompt excluded
        self.last_unseen = 0  # committed tokens the last draft call fed before drafting
        self.last_k = 0  # tokens the last draft call drafted (a ranking drafter may stop early)
        # Why it cannot draft while the verifier runs (None: it can; edgespec.adaptive.pipeline)
        self.ahead_refused = can_draft_ahead(drafter)

    @property
    def caps(self) -> Capabilities:
        return Capabilities(point_mass=False, has_q=True, cost_per_token=self.cost.per_token or 0.0,
                            catches_up=self.drafter.caps.catches_up)

    def cost_per_token(self, plain_s: float) -> float:
        """Seconds per drafted token: measured, else the prior relative to a plain step."""
        return self.cost.value(plain_s)

    def unseen(self, seq: list[int]) -> int:
        """Committed tokens of `seq` (but its last) a draft call now would feed before drafting:
        0 for a drafter that does not declare a catch-up. Before the request's first draft the
        drafter has not begun: it will read the prompt (unpriced, as in `draft`) and catch up
        on every token committed after it."""
        if not self.drafter.caps.catches_up:
            return 0
        if self._prompt is not None:
            return max(len(seq) - len(self._prompt), 0)
        return self.drafter.unseen(seq)

    def draft_s(self, seq: list[int], k, plain_s: float):
        """Seconds of a draft call of k tokens (a number or an array) after `seq`: its catch-up
        on the tokens it has not seen, plus k drafted tokens."""
        return self.cost.catch_up_s(self.unseen(seq), plain_s) + k * self.cost.value(plain_s)

    def bind_verifier_cache(self, cache) -> None:
        """The verifier cache of this generation, for a drafter that drafts from it."""
        if self.drafter.caps.reads_verifier:
            self.drafter.bind_verifier_cache(cache)

    def begin(self, prompt: list[int]) -> None:
        # Deferred to the first draft: a request the drafter never drafts for costs it nothing.
        self._prompt = list(prompt)

    def draft(self, seq: list[int], k: int, sampler) -> list[Candidate]:
        """The chain drafted after `seq` (up to k tokens) and, from a ranking drafter, its
        runner-ups: the chain first."""
        self.last_unseen = self.unseen(seq)
        if self._prompt is not None:
            self.drafter.begin(self._prompt)
            self._prompt = None
        t0 = self.clock()
        self.drafter.sync(list(seq))
        if self.trees:  # one drafter call a level: priced per level as a chain's per token
            tree = self.drafter.draft_tree(k, TREE_WIDTH, TREE_TOPK, TREE_NODES)
            self.last_s = self.clock() - t0
            self.last_k = tree.levels if len(tree) else 0
            return tree_candidates(tree, self.name) or [Candidate([], self.name, 0)]
        if self.ranks:
            d = self.drafter.draft(k, sampler, ranks=self.ranks, floor=self.floor)
        else:
            d = self.drafter.draft(k, sampler)
        self.last_s = self.clock() - t0
        self.last_k = len(d.tokens)
        chain = Candidate(list(d.tokens), self.name, 0, d.logprobs)
        if d.ranked is None or not d.tokens:
            return [chain]
        ids, probs = d.ranked
        chain.token_buckets = tuple(sure_bucket("q", float(p)) for p in probs[: len(d.tokens), 0])
        out = [chain]
        for j in range(len(d.tokens)):
            for r in range(1, ids.shape[1]):
                p = float(probs[j, r])
                if p <= 0.0:
                    continue  # outside the drafter's vocabulary
                out.append(Candidate(list(d.tokens[:j]) + [int(ids[j, r])], self.name, 0, None,
                                     chain.token_buckets[:j] + (sure_bucket("r", p),), own=j))
        return out

    def pin(self, seq: list[int], uses: int = 1) -> None:
        """Before the verifier's pass that a draft ahead overlaps: a drafter that reads the
        verifier's cache reads its verified positions (those of `seq` but its last) now
        (`DrafterCaps.ahead`), for its next `uses` drafts (the runner-up premise's too); any
        other needs nothing."""
        if self.drafter.caps.ahead:
            if self._prompt is not None:
                self.drafter.begin(self._prompt)
                self._prompt = None
            self.drafter.sync(list(seq))
            self.drafter.pin(uses)

    def observe(self) -> None:
        """Learn the costs from the last draft call (`last_k` tokens drafted after feeding
        `last_unseen`)."""
        self.cost.observe(self.last_k, self.last_s, self.last_unseen)

    def propose(self, seq: list[int], limit: int, span: int) -> list[Candidate]:
        return []  # costly: drafted on the planner's request only (see draft)

    def close(self) -> None:
        pass  # the drafter belongs to the engine


class JacobiSource:
    """Lookahead's Jacobi window and the n-grams it harvests (weight-free, for open-ended text).

    The window (W columns x N-1 levels of guesses, `JacobiWindow`) rides along in a
    verifier pass when the decoder's window controller says it pays; each such pass
    advances it one Jacobi level and stores every column's N-gram in a pool keyed by
    its first token. `propose` offers the pooled continuations of x0.
    """

    name = "jacobi"
    caps = Capabilities()
    priors = MappingProxyType({})  # the decoder's default guess

    def __init__(self, window: int, ngram: int):
        if window < 1 or ngram < 2:
            raise ValueError("the Jacobi source needs window >= 1 and ngram >= 2")
        self.W, self.N = window, ngram
        self.pool = NgramPool(1, ngram - 1)
        self.window: JacobiWindow | None = None

    @property
    def levels(self) -> list[list[int]]:
        return self.window.levels

    def begin(self, prompt: list[int]) -> None:
        self.pool = NgramPool(1, self.N - 1)
        self.window = JacobiWindow(self.W, self.N, prompt)

    def propose(self, seq: list[int], limit: int, span: int) -> list[Candidate]:
        return [Candidate(c[:span], self.name, 0) for c in self.pool.jacobi_candidates(seq[-1], limit)]

    def harvest(self, top: list[int]) -> None:
        """Advance the window: `top` are the verifier's draws at the top level's nodes."""
        self.window.advance(self.pool, top)

    def close(self) -> None:
        self.window = None


class ForcedSource:
    """The tokens a request's grammar forces next (llguidance's fast-forward tokens).

    Where the grammar allows a single continuation (a key, a closing brace, the rest of an
    enum value), the constrained distribution is a point mass at each of its tokens, so the
    whole run is a candidate the verifier always accepts, checked in the same pass as the
    other sources' candidates. It also vets the others' candidates: a drafted token the
    grammar forbids (and everything after it) is dropped before the verifier pass."""

    name = "forced"
    caps = Capabilities(grammar=True, vets=True)
    priors = MappingProxyType({"forced": 0.99})  # a point mass of the masked distribution: always kept

    def __init__(self):
        self.grammar = None
        self.prompt_len = 0

    def bind(self, grammar, prompt_len: int) -> None:
        """The request's grammar (an edgespec.logits.processors.GrammarProcessor, or None)."""
        self.grammar, self.prompt_len = grammar, prompt_len

    def begin(self, prompt: list[int]) -> None:
        pass

    def propose(self, seq: list[int], limit: int, span: int) -> list[Candidate]:
        if self.grammar is None:
            return []
        toks = self.grammar.forced(seq[self.prompt_len:], span)
        return [Candidate(toks, self.name, 0)] if toks else []

    def vet(self, seq: list[int], tokens: list[int]) -> int:
        """How many of `tokens` (a continuation of seq) the grammar allows."""
        if self.grammar is None or not tokens:
            return len(tokens)
        return self.grammar.allowed_prefix(seq[self.prompt_len:], tokens)

    def close(self) -> None:
        self.grammar = None
