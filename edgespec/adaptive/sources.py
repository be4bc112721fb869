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

import time
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Protocol

import mlx.core as mx

from edgespec.adaptive.estimate import DraftCost
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


class DrafterSource:
    """A drafter's chain of k tokens (with its q), asked only when the planner expects it to pay.

    A draft call first feeds the drafter the committed tokens it has not seen (those of the
    rounds it did not draft: its catch-up), then drafts k tokens. A drafter that declares it
    (`DrafterCaps.catches_up`) counts those tokens beforehand (`unseen`), and a call is priced
    `draft_s` = catch-up x unseen + k x per token. Both are learnt from the drafting calls it
    makes (`observe`, into a `estimate.DraftCost` the engine keeps and persists); until
    measured the planner prices them from priors (a fraction of a plain step,
    `estimate.DRAFT_PRIOR`; a fraction of a drafted token, `estimate.CATCH_UP_PRIOR`)."""

    name = "drafter"

    def __init__(self, drafter, draft_s=None, clock=time.perf_counter):
        """draft_s: seconds per drafted token (a number: fixed), a estimate.DraftCost (learnt),
        or None (learnt from nothing). clock: what draft calls are timed with (the adaptive
        decoder hands it its policy's clock)."""
        if drafter.caps.needs_features:
            raise ValueError(f"drafter {drafter.name!r} reads verifier features; it drafts in mode 'speculative' only")
        if not drafter.caps.syncs:
            raise ValueError(f"drafter {drafter.name!r} cannot follow another source's tokens (no sync)")
        self.drafter = drafter
        self.cost = draft_s if isinstance(draft_s, DraftCost) else DraftCost(
            None if draft_s is None else float(draft_s))
        self.expected_acceptance = float(drafter.expected_acceptance)
        self.priors = MappingProxyType({"drafter": self.expected_acceptance})
        self._prompt: list[int] | None = None
        self.clock = clock
        self.last_s = 0.0  # seconds of the last draft call, the drafter's prefill of the prompt excluded
        self.last_unseen = 0  # committed tokens the last draft call fed before drafting

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

    def draft(self, seq: list[int], k: int, sampler) -> Candidate:
        self.last_unseen = self.unseen(seq)
        if self._prompt is not None:
            self.drafter.begin(self._prompt)
            self._prompt = None
        t0 = self.clock()
        self.drafter.sync(list(seq))
        d = self.drafter.draft(k, sampler)
        self.last_s = self.clock() - t0
        return Candidate(list(d.tokens), self.name, 0, d.logprobs)

    def observe(self, tokens: int) -> None:
        """Learn the costs from the last draft call (`tokens` asked for, after `last_unseen`)."""
        self.cost.observe(tokens, self.last_s, self.last_unseen)

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
