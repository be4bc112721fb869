"""The adaptive decoder: each round, verify whatever the sources offer that pays most.

One round, with x0 the last committed token (not yet in the verifier's cache):
1. gather candidates from the cheap sources (context n-grams, history);
2. price them (`estimate.plan_tree`: running acceptance by source, bucket and
   depth; the measured verify-cost curve) and decide whether a drafter chain
   of k tokens would add more than its drafting time costs (probed now and
   then when it does not, so a drafter that starts to pay is noticed);
3. verify the chosen tree in ONE verifier pass (`tree_forward`: tree mask and
   positions), draw at every node the token plain decoding would draw there
   (greedy: the argmax; sampling: `Sampler.sample_at`, Gumbel noise keyed by
   the sequence position, so the draw depends on (seed, position, prefix)
   only), keep the deepest path whose tokens equal those draws (`tree_accept`)
   plus the draw after it, and commit its KV entries (`commit_kv`);
4. score every candidate of the round (verified or pruned) against the
   committed tokens: the acceptance statistics learn from all of them.

What the prices choose goes through the decoder's `Policy` (edgespec.adaptive.policy);
the default one's regret guard sends the decoder back to plain steps when the
rounds realise fewer tokens/s than plain steps measured in the same window (a
busy machine the prices did not see), and prices against those paired steps.

Drafting ahead (edgespec.adaptive.pipeline): with a drafter that can draft while the verifier
runs, a round may hand the drafter the next round's premise (its own chain up to where the tree
keeps it, then its own next token) before the verifier's pass, so the next round's chain is
drafted on the drafter's worker while this round is verified. When the pass commits exactly the
premise, the next round drafts nothing (its chain is in hand, priced free); otherwise the early
chain is dropped. The planner prices the choice each drafting round (`Overlap`: the slowdown each
side causes the other, measured) and the policy carries it out (`Policy.pipeline`). Drafts are
candidates only, so whatever was drafted ahead, every committed token is plain decoding's.

When nothing is expected to beat a plain step, the decoder runs plain steps
the way plain decoding does (the next step queued before the current token
is handed out) and looks at the sources after each token, so silent sources
cost a dictionary look-up per token.

Lossless by construction: every committed token is the token plain decoding
draws at that position given the same prefix, greedy or sampled, so the output
equals plain decoding's for the same seed token for token (and so follows its
distribution). For point-mass candidates this "draw, then match" accepts a
candidate x with probability p(x), the same as recursive rejection; a drafter
token is treated as one too (drafted greedily), which gives up rejection
sampling's min(1, p/q) under sampling in exchange for seed-reproducible output
whatever the sources did.

About 520 lines: one round (plan, draft, tree, verify, score) and the plain-step loop share
the decoder's state; the pricing is estimate.py, the sources sources.py, the choices policy.py.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, replace

import mlx.core as mx
import numpy as np

from edgespec.adaptive.estimate import (
    AcceptanceStats,
    Costs,
    PlainTimer,
    closed_top,
    gain_curve,
    merge_candidates,
    plan_tree,
)
from edgespec.adaptive.pipeline import Direct, Overlap, Worker, placement, unless
from edgespec.adaptive.policy import Policy, TimedPolicy
from edgespec.adaptive.sources import Candidate, DrafterSource, JacobiSource
from edgespec.batch.cost import BatchCosts, joint_sizes
from edgespec.generate import GenerationStats, Token, prefill, runs_alone
from edgespec.kernels import commit_kv, tree_accept
from edgespec.logits.sampling import Sampler, SamplingParams
from edgespec.lookahead import StepController, tree_forward
from edgespec.tree.candidates import SourceTree

KMAX = 8  # longest drafter chain considered
# Every PROBE_EVERY-th tree round run alone verifies all its candidates (up to the cap) when that
# size's cost was never measured: sizes the prior priced too high get measured, not avoided
# (on quiet cores only: see AdaptiveDecoder._probe).
PROBE_EVERY = 8


@dataclass
class Plan:
    kind: str  # "plain" | "tree"
    cands: list[Candidate]
    draft_k: int = 0
    rate: float = 0.0
    probe: bool = False
    expected: float | None = None  # tokens the round is expected to commit (what the prices assumed)
    ahead: bool = False  # draft the next round while this one is verified (edgespec.adaptive.pipeline)


class AdaptiveDecoder:
    name = "adaptive"

    def __init__(self, model, sources, costs: Costs, drafter: DrafterSource | None = None,
                 guesses: int = 3, span: int = 16, max_tree: int = 32, probe_start: int = 8, probe_max: int = 128,
                 margin: float = 1.02, jacobi: JacobiSource | None = None, memory: dict | None = None,
                 batch_aware: bool = True, after_request=None, policy: Policy | None = None,
                 pipeline: bool = True, overlap: Overlap | None = None):
        """costs: the verify-cost curve, learnt from this decoder's passes run alone (the engine
        shares one between its decoders and persists it, edgespec.calibration).
        memory: a dict kept by the engine across requests (acceptance, the plain step's time,
        probe waits); each request starts from it and writes back what it learned.
        after_request: called once a request's rounds end (the engine publishes and saves costs).
        policy: carries out (or replaces, in tests) every timing-driven choice (edgespec.adaptive.policy).
        pipeline: allow drafting the next round while this one is verified, where the drafter
        can (edgespec.adaptive.pipeline); overlap: its pricing, fixed (tests, benchmarks), else
        the one kept in `memory` (slowdowns measured as it runs)."""
        self.model = model
        self.policy = policy if policy is not None else TimedPolicy()
        self.clock = self.policy.clock  # every duration the decoder measures (a fake one in tests)
        self.sources = list(sources) + ([jacobi] if jacobi is not None else [])
        self.jacobi = jacobi
        self.memory = memory if memory is not None else {}
        self.drafter = drafter
        if drafter is not None:
            drafter.clock = self.clock  # its draft calls are timed alike
        self.costs = costs
        self.guesses, self.span = guesses, span
        self.max_tree = max(2, min(max_tree, costs.max_tokens))
        self.probe_start, self.probe_max = probe_start, probe_max
        self.margin = margin
        self.batch_aware = batch_aware  # price trees against the running batch (edgespec.batch.cost)
        self.after_request = after_request
        self._batch_ctx = None
        self.pipeline = bool(pipeline)
        self._overlap_given = overlap
        self.overlap: Overlap | None = None  # set per request when drafting ahead is possible
        self._lane = Direct()  # where drafter calls run: the drafter's worker when drafting ahead
        self._early = None  # the next round's candidates drafted ahead, when their premise held
        self._overlapped = False  # the last tree round's pass ran beside a draft
        priors = {}  # first guesses of the per-depth acceptance, as each source declares them
        for src in self.sources:
            priors.update(src.priors)
        if drafter is not None:
            priors.update(drafter.priors)
        self.priors = priors

    # ------------------------------------------------------------------ planning
    def _cheap(self, seq: list[int]) -> list[Candidate]:
        out = []
        for s in self.sources:
            out.extend(c for c in s.propose(seq, self.guesses, self.span) if c.tokens)
        return self._vet(seq, out)

    def _vet(self, seq: list[int], cands: list[Candidate]) -> list[Candidate]:
        """Candidates trimmed by the sources that vet (caps.vets): what the request can never
        accept is not verified."""
        for s in self.sources:
            if not s.caps.vets:
                continue
            for c in cands:
                n = s.vet(seq, c.tokens)
                if n < len(c.tokens):
                    c.tokens = c.tokens[:n]
                    if c.logprobs is not None:
                        c.logprobs = c.logprobs[:n]
                    if c.token_buckets is not None:
                        c.token_buckets = c.token_buckets[:n]
            # (a runner-up cut back to its prefix is the chain's: gone with its own token)
            cands = [c for c in cands if len(c.tokens) > c.own]
        return cands

    def _probs(self, c: Candidate) -> np.ndarray:
        if c.token_buckets is not None:  # each token's own bucket (the drafter's confidence)
            return np.cumprod([self.acc.rates(c.source, b, 1)[0] for b in c.token_buckets])
        return self.acc.path_probs(c.source, c.bucket, len(c.tokens))

    def _pricing(self, nodes):
        """(costs, plain step seconds, tokens the other rows commit per step, largest tree)
        to plan `nodes` with.

        Alone: this decoder's own measured costs. Inside a batch with others (and
        batch_aware on): the rows choose the step's shape together (cost.joint_sizes:
        which rows speculate, up to how many tokens), and this row prices its tree
        against the whole step's cost with the others at their sizes in that choice,
        so a tree is chosen only when it adds more to the batch's tokens/s than the
        padding and the longer pass take away.
        """
        ctx = self._batch_ctx() if self._batch_ctx is not None else None
        if ctx is None:
            # Alone: against a plain step measured in the same window of rounds when the policy
            # has one (RegretGuard.plain_s), not an average from another moment's load.
            # The curve under the load its rounds measured lately (Costs.under_load).
            return self.costs.under_load(), self.policy.plain_s(self.plain_s), 0.0, self.max_tree
        peers, step, key = ctx
        gains = gain_curve(nodes, self.max_tree)
        extra_s = max(self._host["tree"] - self._host["plain"], 0.0)
        self.model.publish_gains(gains, extra_s)
        cap, sizes, others = joint_sizes(gains, peers, step, key, extra_s)
        bc = BatchCosts(self.costs, sizes, step)
        return bc, bc.verify(1), others, cap

    def _plan(self, seq: list[int]) -> Plan:
        """What this round does: the timed choice (`_timed_plan`), as the policy carries it out."""
        plan = self._timed_plan(seq)
        plan = self.policy.plan(plan, bool(plan.cands), self.drafter is not None, KMAX)
        if plan.kind == "tree" and plan.draft_k and self._can_ahead():
            ahead = self.policy.pipeline(plan.ahead)
            if ahead != plan.ahead:
                plan = replace(plan, ahead=ahead)
        elif plan.ahead:
            plan = replace(plan, ahead=False)
        return plan

    def _timed_plan(self, seq: list[int]) -> Plan:
        self.costs.context = None if self._in_batch() else len(seq)  # priced at it (Costs.ctx_term)
        allowed = getattr(self.model, "speculation_allowed", None) if self._batch_ctx is not None else None
        if allowed is not None and not allowed():
            # The batch measured plain steps doing better at its size (edgespec.batch.guard).
            # (A replacing policy may still choose a tree: it sees the candidates.)
            timed = isinstance(self.policy, TimedPolicy)
            return Plan("plain", [] if timed else self._cheap(seq), 0, 0.0)
        cands = self._cheap(seq)
        nodes = merge_candidates([(c.tokens, self._probs(c)) for c in cands])
        costs, plain_s, others, cap = self._pricing(nodes)
        kept, rate = plan_tree(nodes, costs, 0.0, plain_s, cap, self.margin, others)
        e_tree = 1.0 + sum(nodes[i].prob for i in kept)
        best = Plan("tree" if kept else "plain", cands, 0, rate, expected=e_tree if kept else None)
        d = self.drafter
        if d is None:
            return best
        # Would a drafter chain of k tokens pay for its drafting time? Its tokens are not
        # known yet: count what it adds where the cheap candidates are likely wrong.
        self.since_draft += 1
        ks = np.arange(1, KMAX + 1)
        pd = np.cumsum(self.acc.path_probs("drafter", 0, KMAX))
        p1 = min(1.0, sum(nodes[i].prob for i in kept if nodes[i].parent < 0))
        gain = others + e_tree + (1.0 - p1) * pd
        t_tree = 1 + len(kept)
        # Drafting runs inside this sequence's turn: in a batch every row waits for it. A call
        # first catches the drafter up on the tokens it has not seen (other sources' rounds):
        # priced apart, once per call, then k drafted tokens.
        # A chain drafted ahead (its premise held) is in hand: up to its length, drafting is free.
        free = len(self._early[0].tokens) if self._early else 0
        cost = np.where(ks <= free, 0.0, d.draft_s(seq, ks, plain_s)) \
            + np.array([costs.verify(int(t)) for t in t_tree + ks])
        rates = gain / cost
        k = int(np.argmax(rates))
        probe = False
        if rates[k] > best.rate * (1.0 if kept else self.margin):
            self.probe_wait = self.probe_start
        elif self.since_draft >= self.probe_wait:
            probe = True  # measure the drafter again, now and then (waits grow while it loses)
        else:
            return best
        kk = int(ks[k])
        ahead = self._ahead_pays(costs.verify(int(t_tree + kk)), kk, plain_s)
        return Plan("tree", cands, kk, float(rates[k]), probe, expected=float(gain[k] - others), ahead=ahead)

    def _can_ahead(self) -> bool:
        return self.overlap is not None and not self._in_batch()

    def _ahead_pays(self, verify_s: float, k: int, plain_s: float) -> bool:
        """Does drafting the next round (k + 1 tokens: k and the guess after them) during this
        round's pass (verify_s alone) beat drafting k after it (`Overlap.price`)? The premise
        holds when the chain of k and the drafter's guess are all what the verifier draws."""
        if not self._can_ahead():
            return False
        tok = self.drafter.cost.value(plain_s)
        p = float(self.acc.path_probs("drafter", 0, k + 1)[k])
        return self.overlap.choose(verify_s, k * tok, tok, p)

    # ------------------------------------------------------------------ steps
    def steps(self, prompt: list[int], sampler: Sampler, stats: GenerationStats) -> Iterator[Token]:
        model = self.model
        greedy = sampler.params.greedy
        mem = self.memory
        self.acc = mem["acc"].carried() if "acc" in mem else AcceptanceStats(self.priors)
        # EMA: seconds of a plain step. Until one is measured (here or by an earlier request or
        # process), the cost curve's T = 1, which the first measured step replaces.
        self.plain_s = mem.get("plain_s") or self.costs.verify(1)
        self._plain_measured = "plain_s" in mem or self.costs.measured(1)
        self.since_draft = 0
        self._since_probe = mem.get("since_probe", 0)  # tree rounds since a size probe (see _probe)
        self.probe_wait = mem.get("probe_wait", self.probe_start)
        # Inside a batch (edgespec.batch.SeqModel): who else is in the step, to price against.
        self._batch_ctx = getattr(self.model, "batch_context", None) if self.batch_aware else None
        self._draft_time = 0.0
        self._host = mem.get("host", {"tree": 0.0, "plain": 0.0})  # see _host_time
        self._greedy = Sampler(SamplingParams(temperature=0.0))
        self.policy.begin(mem)
        # Whether the Jacobi window rides along: measured tokens/s with ("full") and
        # without it ("lean"), the slower one re-probed now and then (lookahead's controller).
        # Kept across requests: a window that did not pay is not warmed up again for every reply.
        if self.jacobi is not None and "wctl" not in mem:
            mem["wctl"] = StepController(kinds=("full", "lean"))
        self.wctl = mem.get("wctl") if self.jacobi is not None else None
        # Drafting ahead, with a drafter that can: every drafter call then runs on the drafter's
        # worker thread; rounds draft ahead only while this row runs alone (`_can_ahead`).
        self._early, self._overlapped = None, False
        self._ahead_counts = [0, 0, 0]  # rounds drafted ahead, premises held, runner-up premises held
        d = self.drafter
        if self.pipeline and d is not None and d.ahead_refused is None:
            self.overlap = self._overlap_given or mem.setdefault("overlap", Overlap(placement(d.drafter)))
            self._lane = Worker()
        else:
            self.overlap, self._lane = None, Direct()
        cache = model.make_cache()
        if self.drafter is not None:
            self.drafter.bind_verifier_cache(cache)  # for a drafter that reads it (Gemma 4's assistant)
        t0 = self.clock()
        logits = prefill(model, cache, prompt)
        lp = sampler.logprobs(logits)
        tok = sampler.sample_at(lp[None], [len(prompt)])[0]
        mx.eval(tok, lp)
        x0 = int(tok.item())
        seq = list(prompt) + [x0]
        for s in self.sources:
            s.begin(seq)
        if self.drafter is not None:
            self.drafter.begin(prompt)  # lazy: the drafter reads the prompt at its first draft
        stats.prefill_s += self.clock() - t0
        yield Token(x0, float(lp[x0].item()), "verifier")
        try:
            yield from self._rounds(cache, seq, sampler, stats, greedy)
        finally:
            self._lane.close()  # a draft still running ahead ends before the drafter is let go
            self._early = None
            if self._ahead_counts[0]:
                o = self.overlap
                stats.notes.append(f"drafted ahead: {self._ahead_counts[0]} rounds, premise held "
                                   f"{self._ahead_counts[1]}, runner-up held {self._ahead_counts[2]}; "
                                   f"slowdown verify x{o.s_v:.2f}, draft x{o.s_d:.2f}")
            mem.update(acc=self.acc, probe_wait=self.probe_wait, host=self._host, since_probe=self._since_probe)
            if self._plain_measured:
                mem["plain_s"] = self.plain_s
            if self.after_request is not None:
                self.after_request()

    def _rounds(self, cache, seq, sampler, stats, greedy):
        while True:
            plan = self._plan(seq)
            window = self._window_now()
            if plan.kind == "plain" and not window:
                yield from self._plain_run(cache, seq, sampler, stats, greedy)
                continue
            t_round = self.clock()
            blocked = getattr(self.model, "blocked_s", 0.0)
            out = self._tree_round(cache, seq, plan, sampler, stats, window)
            if out is None:  # the drafter proposed nothing and nothing else pays: one plain step
                yield from self._plain_run(cache, seq, sampler, stats, greedy, max_steps=1)
                continue
            new, lps, srcs, T = out
            dt = self.clock() - t_round
            self._host_time("tree", dt, blocked)
            alone = not self._in_batch()
            if alone:
                # what the choice cost, and the tokens it was expected to bring (RegretGuard)
                self.policy.round_done(len(new), dt, None if window else plan.expected)
            if self.wctl is not None:
                self.wctl.record("full" if window else "lean", len(new), dt)
            # A window round's extra tokens are priced by the window controller; in a batch the
            # round's time is the whole step's, not this tree's cost alone.
            if not window and alone and not self._overlapped:  # (an overlapped pass is not alone)
                self.costs.observe(T, dt - (self._draft_time if plan.draft_k else 0.0))
            seq.extend(new)
            for t, lpv, src in zip(new, lps, srcs, strict=True):
                yield Token(t, lpv, src)

    def _host_time(self, kind: str, dt: float, blocked_before: float) -> None:
        """Inside a batch: the seconds of a round (kind "tree") or plain step spent outside
        the batched pass (its Python and small evaluations, which every other row waits for),
        as a moving average; their difference prices a tree round in the joint choice."""
        blocked = getattr(self.model, "blocked_s", None)
        if blocked is None or not self._in_batch():
            return
        host = max(dt - (blocked - blocked_before), 0.0)
        self._host[kind] = 0.8 * self._host[kind] + 0.2 * host

    def _in_batch(self) -> bool:
        ctx = getattr(self.model, "batch_context", None)
        return ctx is not None and ctx() is not None

    def _window_now(self) -> bool:
        if self.wctl is None:
            return False
        if self._batch_ctx is not None and self._batch_ctx() is not None:
            # In a batch the step's shape is chosen jointly (cost.joint_sizes), which has no
            # price for a window riding on a tree: it would pad every row past the cap.
            return False
        return self.policy.window(self.wctl.choose() == "full")

    def _drafted(self, plan: Plan) -> None:
        self.since_draft = 0
        if plan.probe:
            self.probe_wait = min(self.probe_wait * 2, self.probe_max)

    def _probe(self, nodes, kept: list[int], cap: int) -> list[int]:
        """Now and then, a larger tree than priced best: every candidate node up to the cap,
        when that size was never measured (here or persisted). It commits at least what the
        chosen tree would (a superset); it may cost more, once, and its time fills the curve.
        Not while the cores are busy (`Costs.busy`): a busy round's time does not teach the
        quiet curve, and a wide pass slows down most then, so the probe would cost the most
        for the least (waits for a quiet round)."""
        if not kept or self._in_batch() or self.costs.busy():
            return kept
        self._since_probe += 1
        n = min(len(nodes), cap - 1)
        if self._since_probe < PROBE_EVERY or n <= len(kept) or self.costs.known(n + 1):
            return kept
        self._since_probe = 0
        return closed_top(nodes, n)

    def _score(self, cands: list[Candidate], new: list[int]) -> None:
        """Learn from every candidate of the round: how far it agreed with what was committed.

        A candidate priced token by token (`token_buckets`: a ranking drafter's chain and its
        runner-ups) teaches each token's bucket, from its own first token on; and per depth
        under its `bucket`, the deepest any of its source's such candidates reached (what
        deciding to draft at all is priced with: the runner-ups count)."""
        deepest: dict[str, tuple] = {}
        for c in cands:
            m = 0
            limit = min(len(c.tokens), len(new))
            while m < limit and c.tokens[m] == new[m]:
                m += 1
            # A mismatch inside the committed tokens is a known rejection at depth m+1;
            # agreeing with all of them leaves deeper positions unknown.
            tried = m + 1 if m < limit else m
            if c.token_buckets is None:
                self.acc.record(c.source, c.bucket, m, tried)
                continue
            for i in range(c.own, tried):  # each token reached (its prefix accepted)
                self.acc.record(c.source, c.token_buckets[i], int(i < m), 1)
            best = deepest.get(c.source)
            if best is None or (m, tried) > best[:2]:
                deepest[c.source] = (m, tried, c.bucket)
        for source, (m, tried, bucket) in deepest.items():
            self.acc.record(source, bucket, m, tried)

    def _chain(self, seq, plan: Plan, stats) -> tuple[list[Candidate], list[int]]:
        """This round's drafter candidates (vetted) and the whole chain drafted (the guess
        after the planned k included when drafting ahead): drafted ahead (its premise held),
        else drafted now, on the drafter's worker when it has one."""
        k_ask = plan.draft_k + (1 if plan.ahead else 0)
        early, self._early = self._early, None
        self._draft_time = 0.0
        if early is not None and len(early[0].tokens) >= min(k_ask, plan.draft_k + 1):
            drafted = early  # drafted during the last round's pass: nothing to wait for
        else:
            self._draft_priced = self.drafter.draft_s(seq, k_ask, self.plain_s)
            td = self.clock()
            if self.overlap is not None:
                self.drafter.pin(seq)  # the verifier cache read here, on its own thread
            # Drafted greedily: its tokens are point-mass candidates like every other source's.
            drafted, _ = self._lane.call(self.drafter.draft, seq, k_ask, self._greedy)
            self._draft_time = self.clock() - td
            if not self._in_batch():
                self.drafter.observe()  # seconds per drafted token, learnt
            stats.draft_s += self._draft_time
        self._drafted(plan)
        whole = list(drafted[0].tokens)
        cut = (_cut(c, plan.draft_k) for c in drafted)
        return self._vet(seq, [c for c in cut if c is not None and c.tokens]), whole

    def _premise(self, seq, nodes, kept: list[int], chain: list[int]) -> list[int] | None:
        """What the next round drafts ahead from: seq, then the chain's tokens the tree keeps
        (all accepted) and the chain's next token (what the drafter expects the verifier to
        draw there); None when the chain has no token past the kept ones."""
        inside = set(kept)
        parent, j = -1, 0
        while j < len(chain):
            nxt = next((i for i in inside if nodes[i].parent == parent and nodes[i].token == chain[j]), None)
            if nxt is None:
                break
            parent, j = nxt, j + 1
        return list(seq) + chain[: j + 1] if j < len(chain) else None

    def _runner_up(self, seq, nodes, kept: list[int], premise: list[int]) -> tuple[list[int], float] | None:
        """The likeliest other premise than `premise`, and its estimated chance: a frontier node
        of the trie (not verified, its parent verified or the root), whose path the verifier
        may accept and whose token it may draw next (module notes, edgespec.adaptive.pipeline)."""
        inside = set(kept)
        best = None
        for i, n in enumerate(nodes):
            if i in inside or not (n.parent < 0 or n.parent in inside) or n.prob <= 0.0:
                continue
            if best is None or n.prob > nodes[best].prob:
                path, j = [], i
                while j >= 0:
                    path.append(nodes[j].token)
                    j = nodes[j].parent
                cand = list(seq) + path[::-1]
                if cand != premise:
                    best, best_seq = i, cand
        return (best_seq, float(nodes[best].prob)) if best is not None else None

    def _tree_round(self, cache, seq, plan: Plan, sampler, stats, window: bool = False):
        cands = list(plan.cands)
        self._draft_time = 0.0
        self._overlapped = False
        chain: list[int] = []
        if plan.draft_k:
            drafted, chain = self._chain(seq, plan, stats)
            cands.extend(drafted)
        elif self._early is not None:
            self._early = None  # drafted ahead for a round that does not draft: dropped
        nodes = merge_candidates([(c.tokens, self._probs(c)) for c in cands])
        costs, plain_s, others, cap = self._pricing(nodes)
        kept, _ = plan_tree(nodes, costs, 0.0, plain_s, cap, margin=0.0, others=others)
        kept = self.policy.tree(nodes, self._probe(nodes, kept, cap), cap)
        if not kept and not window:
            return None
        tree = build_tree(seq[-1], nodes, kept, cands)
        if window:
            tree.add_window(self.jacobi.levels)
        T = len(tree)
        # Draft the next round from its premise while this pass runs (plan.ahead).
        ahead = runner = second = None
        premise = self._premise(seq, nodes, kept, chain) if plan.ahead and chain and self._can_ahead() else None
        if premise is not None:
            d, k_next = self.drafter, plan.draft_k
            alone_s = d.draft_s(premise, k_next + 1, self.plain_s)  # priced now: the worker is idle
            second = self._runner_up(seq, nodes, kept, premise)
            if second is not None:
                p = float(self.acc.path_probs("drafter", 0, len(premise) - len(seq))[-1])
                pays = self.overlap.runner_up_pays(costs.verify(T), alone_s, p, second[1])
                if not self.policy.runner_up(pays):
                    second = None
            d.pin(seq, uses=2 if second is not None else 1)
            ahead = self._lane.submit(d.draft, premise, k_next + 1, self._greedy)
            if second is not None:
                ended = threading.Event()
                runner = self._lane.submit(unless, ended, d.draft, second[0], k_next + 1, self._greedy)
        tv = self.clock()
        path, nxt, lps, draws = verify_round(self.model, cache, tree, len(seq), sampler)
        if runner is not None:
            ended.set()  # a runner-up draft not started yet is not worth starting now
        if window:
            self.jacobi.harvest([draws[n] for n in tree.window[-1]])
        new = [tree.tokens[n] for n in path] + [nxt]
        verify_s = self.clock() - tv
        if ahead is not None:
            # The round ends when the early draft does: its premise held, or it is dropped.
            self._overlapped = True
            o = self.overlap
            # (against a price alone that was measured, not a prior's)
            if self.costs.known(T):
                o.observe("v_over", verify_s, costs.verify(T))
            early, dt_d = ahead.result()
            if self.drafter.cost.per_token is not None:
                o.observe("d_over", dt_d, alone_s)
            o.ran(True)
            self._ahead_counts[0] += 1
            stats.draft_s += dt_d
            late, dt_r = runner.result() if runner is not None else (None, 0.0)
            if runner is not None:
                o.runner_ups["drafted" if late is not None else "skipped"] += 1
                stats.draft_s += dt_r
            if list(seq) + new == premise:
                self._early = early
                o.hits += 1
                self._ahead_counts[1] += 1
                stats.hidden_draft_s += min(dt_d, verify_s)
            elif late is not None and list(seq) + new == second[0]:
                self._early = late
                o.runner_ups["held"] += 1
                self._ahead_counts[2] += 1
                stats.hidden_draft_s += min(dt_d + dt_r, verify_s)
        elif plan.draft_k and self.overlap is not None and not self._in_batch():
            self.overlap.ran(False)
            if self.costs.known(T):
                self.overlap.observe("v_alone", verify_s, costs.verify(T))
            if self._draft_time and self.drafter.cost.per_token is not None:
                self.overlap.observe("d_alone", self._draft_time, self._draft_priced)
        stats.verify_s += verify_s
        stats.verifier_passes += 1
        srcs = [tree.sources[n] for n in path] + ["verifier"]
        stats.record_draft(tree.depth(), len(path))
        stats.draft_tokens = T - 1
        for n in path:
            stats.accepted_by_source[tree.sources[n]] = stats.accepted_by_source.get(tree.sources[n], 0) + 1
        self._score(cands, new)
        return new, lps, srcs, T

    def _plain_run(self, cache, seq, sampler, stats, greedy, max_steps: int | None = None):
        """Plain steps, each queued before the previous token is handed out, until a plan pays."""
        model = self.model
        batch_ctx = getattr(model, "batch_context", None)

        def queue(tok, position):
            logits = model(tok.reshape(1, 1), cache)[0, -1]
            if greedy:
                t = mx.argmax(logits, axis=-1)
                return t, mx.array(0.0)
            lp = sampler.logprobs(logits)
            t = sampler.sample_at(lp[None], [position])[0]
            return t, lp[t]

        self._early = None  # a chain drafted ahead was for the sequence before these steps
        pending = None  # the step after seq's end, when already queued
        steps = 0
        go_on = True
        clock = self.clock
        timer = PlainTimer(clock)
        while True:
            t0 = clock()
            blocked = getattr(model, "blocked_s", 0.0)
            if pending is None:
                pending = queue(mx.array(seq[-1], dtype=mx.int32), len(seq))
                mx.async_eval(*pending)
            nxt = None
            # Alone, the next step is queued before this token is handed out (its graph and our
            # Python overlap the computation); in a batch a call waits for the batch's next pass,
            # so queueing ahead would only hand the token out a step late.
            tq = clock()
            if go_on and runs_alone(model):
                nxt = queue(pending[0], len(seq) + 1)
                mx.async_eval(*nxt)
            queued_s = clock() - tq
            t = int(pending[0].item())
            lp_t = float(pending[1].item())
            dt = clock() - t0
            stats.verify_s += dt
            stats.verifier_passes += 1
            step_s = timer.sample(dt, queued_s)  # this device's step, when dt shows it (see PlainTimer)
            alone = batch_ctx is None or batch_ctx() is None
            if alone:  # in a batch dt is the whole step's
                if step_s is not None:
                    self.costs.observe(1, step_s)  # the curve's T = 1 (other sizes scale with it until measured)
                # What a plain step costs this decoder: its wait (the step's time not hidden behind
                # the caller's), an average; until a step is timed, the curve's T = 1.
                if self._plain_measured:
                    self.plain_s = 0.9 * self.plain_s + 0.1 * max(dt, 1e-6)
                elif step_s is not None:
                    self.plain_s, self._plain_measured = step_s, True
                else:
                    self.plain_s = self.costs.verify(1)
            # The step's own seconds, paired with the rounds around it (RegretGuard); None when
            # the caller, not the device, was waited for, or in a batch (a step is counted, so a
            # hold the guard began alone runs out there too).
            self.policy.plain_done(step_s if alone else None)
            if self.wctl is not None:
                self.wctl.record("lean", 1, dt)
            seq.append(t)
            steps += 1
            self._host_time("plain", clock() - t0, blocked)
            yield Token(t, lp_t, "verifier")
            if not go_on:
                return
            pending = nxt
            if max_steps is not None and steps >= max_steps:
                go_on = False  # one more step if one is already queued, then back to planning
                if pending is None:
                    return
                continue
            # Would a round pay from the context after the queued step? Look now (cheap).
            go_on = self._plan(seq).kind == "plain" and not self._window_now()
            if not go_on and pending is None:
                return


def _cut(c: Candidate, k: int) -> Candidate | None:
    """A drafter candidate within the first k drafted positions (the chain's guess past the
    planned k is not verified: it is the premise of the next round's early draft)."""
    if c.own >= k:
        return None
    if len(c.tokens) <= k:
        return c
    return Candidate(c.tokens[:k], c.source, c.bucket, None if c.logprobs is None else c.logprobs[:k],
                     None if c.token_buckets is None else c.token_buckets[:k], c.own)


def draw_tokens(logits: mx.array, parents: list[int], position: int, sampler: Sampler):
    """Per tree node, the token plain decoding would draw there -> (draws (T,), log-probs (T, V) or None).

    Node t sits at depth d(t) and predicts sequence position `position + d(t)`;
    greedy draws the argmax, sampling the Gumbel-max draw with that position's
    noise (`Sampler.position_noise`), the same draw plain decoding makes there.
    """
    if sampler.params.greedy:
        return mx.argmax(logits, axis=-1).astype(mx.int32), None
    depth = [0] * len(parents)
    for t in range(1, len(parents)):
        depth[t] = depth[parents[t]] + 1
    lp = sampler.logprobs(logits)
    noise = sampler.position_noise([position + d for d in range(max(depth) + 1)], lp.shape[-1])
    return mx.argmax(lp + noise[mx.array(depth)], axis=-1).astype(mx.int32), lp


def build_tree(x0: int, nodes, kept: list[int], cands: list[Candidate]) -> SourceTree:
    """The verifier's tree: root x0 and the kept trie nodes, each tagged with the source
    that proposed it first (for stats and Token.source)."""
    src_of: dict[tuple, str] = {}
    for c in cands:
        for j in range(len(c.tokens)):
            src_of.setdefault(tuple(c.tokens[: j + 1]), c.source)
    tree = SourceTree.rooted(x0)
    node_of, prefix_of = {-1: 0}, {-1: ()}
    for i in kept:
        n = nodes[i]
        prefix_of[i] = prefix_of[n.parent] + (n.token,)
        node_of[i] = tree.child(node_of[n.parent], n.token, src_of.get(prefix_of[i], "drafter"))
    return tree


def verify_round(model, cache, tree: SourceTree, position: int, sampler: Sampler):
    """Verify, accept, commit: one verifier pass over `tree` (root = the last committed token,
    which predicts sequence position `position`).

    Draws at every node the token plain decoding would draw there (`draw_tokens`), keeps
    the deepest path whose tokens match those draws (`tree_accept`) and the draw after it,
    and packs the path's KV entries into place. Returns (path nodes, next token, log-probs
    of the path's tokens and the next one, every node's draw).
    """
    start = cache[0].offset
    logits = tree_forward(model, cache, tree)  # (T, V)
    draws, lp = draw_tokens(logits, tree.parents, position, sampler)
    result = tree_accept(mx.array(tree.tokens, dtype=mx.int32), mx.array(tree.parents, dtype=mx.int32), draws)
    mx.eval(result, draws)
    best, _, nxt = (int(v) for v in result.tolist())
    path = tree.path_to(best)
    commit_kv(cache, start, [0] + path)
    new = [tree.tokens[n] for n in path] + [nxt]
    if lp is None:
        lps = [0.0] * len(new)
    else:
        rows = [0] + path  # the node whose distribution drew each new token
        lps = lp[mx.array(rows), mx.array(new)].tolist()
    return path, nxt, lps, draws.tolist()
