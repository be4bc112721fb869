"""Lossless speculative decoding: any Drafter against the verifier, optionally pipelined.

One round: the drafter proposes K tokens; the verifier scores [last] + drafts
(K+1 positions) in ONE pass; `rejection_sample` keeps a prefix and picks the next
token; the verifier cache is trimmed to the kept prefix and the drafter told.

Pipelining: while the verifier checks round r, a worker thread already drafts
round r+1 assuming every draft is kept and the bonus token equals the drafter's
own next proposal (it drafts K+1 tokens; the last is that guess). A wrong guess
throws the early work away (`drafter.sync` rolls its cache back). The drafter
only ever runs on that worker (edgespec.adaptive.pipeline.Worker, which mode `auto`
drafts ahead on too), on the worker's own MLX stream, so no MLX graph is shared
between threads; only evaluated arrays cross.

Randomness is keyed by round: round r's drafter and verifier draws come from
samplers seeded by (generation seed, r), so the work done ahead for round r+1
draws exactly what an unpipelined run would.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import replace

import mlx.core as mx

from edgespec.adaptive.estimate import Costs, DraftCost, PlainTimer
from edgespec.adaptive.pipeline import Direct as _Direct
from edgespec.adaptive.pipeline import Worker as _Worker
from edgespec.adaptive.pipeline import placement
from edgespec.adaptive.policy import policy_for
from edgespec.calibration import SIZES, cost_store, prior_curve
from edgespec.controller import CostModel, KController
from edgespec.drafters.base import Draft, request_drafter
from edgespec.errors import DrafterRequiredError
from edgespec.generate import Token, prefill, runs_alone
from edgespec.logits.rejection import rejection_sample
from edgespec.logits.sampling import Sampler
from edgespec.modes.registry import register_mode
from edgespec.modes.schema import PIPELINE

KMAX = 8  # largest K the controller considers


def _seed(base: int, *ids: int) -> int:
    h = hashlib.blake2b(repr((base,) + ids).encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") >> 1  # < 2**63


class SpeculativeMode:
    def __init__(self, model, drafter, options=None, stats_name: str = "speculative", costs=None, prior_alpha=None,
                 memory: dict | None = None):
        """options: GenerateOptions (draft_tokens 'auto'|K, mode_options['pipeline']).

        costs: a CostModel for the controller (None: a prior, learnt as it runs; `engine_costs`
        gives the engine's learnt curve, which the passes and drafts run alone then teach).
        memory: kept by the engine across requests: holds the K controller, so acceptance
        and the plain fallback learnt on earlier replies carry over to the next one.
        """
        self.memory = memory if memory is not None else {}
        self.policy = None  # the engine's Policy: the draft lengths and fallbacks (bind_engine sets it)
        self.model = model
        self.drafter = drafter
        self.name = stats_name
        opts = options.mode_options if options is not None else {}
        dt = options.draft_tokens if options is not None else "auto"
        self.fixed_k = None if dt == "auto" else int(dt)
        pipeline = opts.get("pipeline")
        if pipeline is None:
            pipeline = default_pipeline(drafter)
        # A feature drafter reads the verifier's hidden states of the committed tokens.
        caps = drafter.caps
        self.features = caps.needs_features
        if pipeline and self.features:
            pipeline = False  # drafting ahead would need features the verifier has not computed yet
            self._note = f"drafter {drafter.name!r} reads the verifier's features; pipelining off"
        elif pipeline and caps.reads_verifier:
            pipeline = False  # it drafts from the verifier's cache, which holds only verified positions
            self._note = f"drafter {drafter.name!r} reads the verifier's cache; pipelining off"
        elif pipeline and not caps.syncs:
            pipeline = False  # cannot undo a wrong guess without sync()
            self._note = f"drafter {drafter.name!r} cannot roll back a guess; pipelining off"
        else:
            self._note = None
        self._fpend: list[mx.array] = []  # verifier features not yet handed to a feature drafter
        self.pipeline = bool(pipeline)
        self.costs = costs
        self.after_request = None  # called when a request's rounds end (the engine saves learnt costs)
        self.prior_alpha = prior_alpha if prior_alpha is not None else drafter.expected_acceptance

    # ------------------------------------------------------------------ helpers
    def _now(self) -> float:
        """The time rounds are priced by: the policy's clock (a cost profile's simulated one under
        `edgespec bench --profile`, edgespec.costs.clock; a paced one in tests), else the host's."""
        return self.policy.clock() if self.policy is not None else time.perf_counter()

    def _learn_verify(self, T: int, seconds: float) -> None:
        """A verifier pass over T tokens, run alone, teaches the engine's learnt curve."""
        curve = getattr(self.costs, "curve", None)
        if curve is not None and runs_alone(self.model):
            curve.observe(T, seconds)

    def _learn_draft(self, tokens: int, seconds: float) -> None:
        drafting = getattr(self.costs, "drafting", None)
        if drafting is not None and runs_alone(self.model):
            drafting.observe(tokens, seconds)

    def _samplers(self, sampler: Sampler, base: int, r: int) -> tuple[Sampler, Sampler]:
        """(drafter, verifier) samplers of round r; greedy needs no randomness."""
        if sampler.params.greedy:
            return sampler, sampler
        p = sampler.params
        return Sampler(replace(p, seed=_seed(base, r, 0))), Sampler(replace(p, seed=_seed(base, r, 1)))

    def _draft(self, k: int, sampler, with_guess: bool):
        """Drafter call (on the worker): k drafts, plus one more as the bonus guess if asked."""
        d = self.drafter.draft(k + (1 if with_guess else 0), sampler)
        if with_guess and len(d.tokens) == k + 1:
            q = d.logprobs[:k] if d.logprobs is not None else None
            if q is not None:
                mx.eval(q)
            return Draft(d.tokens[:k], q), d.tokens[k]
        return d, None

    def _draft_after(self, n_kept: int, guess: int, k: int, sampler):
        """Early work for the next round: assume all n_kept drafts kept and `guess` follows."""
        self.drafter.accept(n_kept, guess)
        return self._draft(k, sampler, True)

    def _catch_up(self, worker, seq: list[int], told: int) -> None:
        """Tell the drafter the committed tokens seq[told:] (told < 0: its state is off-path)."""
        if told != len(seq):
            if told < 0 or self.drafter.caps.syncs:
                worker.call(self.drafter.sync, list(seq))
            else:
                for t in seq[told:]:
                    worker.call(self.drafter.accept, 0, t)
        if self.features and self._fpend:
            self._hand_features()

    def _hand_features(self) -> None:
        """Give a feature drafter the verifier features of every committed token but the last."""
        rows = mx.concatenate(self._fpend, axis=0) if len(self._fpend) > 1 else self._fpend[0]
        self._fpend = []
        need = self.drafter.features_needed()
        if rows.shape[0] != need:
            raise RuntimeError(f"feature drafter needs {need} feature rows, the verifier produced {rows.shape[0]}")
        self.drafter.add_features(rows)

    def _verifier(self, x, cache):
        """Verifier logits (T, V) of x (1, T); keeps the hidden rows for a feature drafter."""
        if not self.features:
            return self.model(x, cache)[0], None
        logits, h = self.model(x, cache, return_hidden=True)
        return logits[0], h[0]

    def steps(self, prompt, sampler, stats):
        if self._note:
            stats.notes.append(self._note)
        stats.notes.extend(getattr(self, "extra_notes", []))
        if self.fixed_k is None and self.costs is None:
            self.costs = prior_costs()
        if self.fixed_k is None:
            ctl = self.memory.setdefault("ctl", KController(self.costs, None, prior_alpha=self.prior_alpha))
            ctl.set_costs(self.costs)
        else:
            ctl = KController(self.costs, self.fixed_k, prior_alpha=self.prior_alpha)
        base = 0 if sampler.params.greedy else int.from_bytes(bytes(memoryview(sampler.next_key())), "little")
        worker = _Worker() if self.pipeline else _Direct()
        try:
            yield from self._loop(prompt, sampler, stats, ctl, base, worker)
        finally:
            worker.close()
            if self.after_request is not None:
                self.after_request()

    def _plain_steps(self, cache, last: int, sampler, base: int, r: int, ctl, stats, next_k: list):
        """Plain decoding while the controller says K=0; yields (token, logprob).

        Like PlainMode, step i+1 is queued (mx.async_eval) before token i is handed
        out, so graph building overlaps the computation; after each token the
        controller may ask for a speculative round (a probe), which ends the run
        with that K appended to `next_k`.
        """

        def queue(tok_in: int, rr: int):
            _, vs = self._samplers(sampler, base, rr)
            logits, h = self._verifier(mx.array([[tok_in]], dtype=mx.int32), cache)
            lp = vs.logprobs(logits[-1])
            tok = vs.sample(lp)
            if h is not None:
                self._fpend.append(h)
                mx.async_eval(tok, lp, h)
            else:
                mx.async_eval(tok, lp)
            return tok, lp

        pending = queue(last, r)
        timer = PlainTimer(self._now)
        while True:
            t0 = self._now()
            tok, lp = pending
            t = int(tok.item())
            lp_t = float(lp[t].item())
            dt = self._now() - t0
            stats.verify_s += dt
            stats.verifier_passes += 1
            ctl.record_plain(dt)
            step_s = timer.sample(dt)  # this device's step, when dt shows it (see PlainTimer)
            if step_s is not None:
                self._learn_verify(1, step_s)
            r += 1
            k = ctl.choose(self.policy)
            more = k == 0
            if more:
                pending = queue(t, r)
            else:
                next_k.append(k)
            yield t, lp_t
            if not more:
                return

    def _loop(self, prompt, sampler, stats, ctl, base, worker):
        model, drafter = self.model, self.drafter
        pipelined = isinstance(worker, _Worker)
        t0 = self._now()
        begun = worker.submit(drafter.begin, prompt) if pipelined else None
        cache = self.cache = model.make_cache()  # kept on the mode for inspection (tests)
        if drafter.caps.reads_verifier:  # a drafter reading the verifier's keys (Gemma 4's assistant)
            drafter.bind_verifier_cache(cache)
        self._fpend = []
        if self.features:
            logits, feats = prefill(model, cache, prompt, features=True)
            self._fpend.append(feats)
        else:
            logits = prefill(model, cache, prompt)
        lp = sampler.logprobs(logits)
        tok = sampler.sample(lp)
        mx.eval(tok, lp)
        if pipelined:
            begun.result()
        else:
            drafter.begin(prompt)
        stats.prefill_s += self._now() - t0
        last = int(tok.item())
        seq = list(prompt) + [last]
        told = len(prompt)  # the drafter knows seq[:told]; -1 = it followed a wrong guess
        yield Token(last, float(lp[last].item()), "verifier")
        ahead = None  # (future, K) of the next round's draft made early by the worker
        next_k = []  # K the controller chose at the end of a plain run (a probe)
        r = 0
        while True:
            r += 1
            ds, vs = self._samplers(sampler, base, r)
            ts = self._now()
            # ---- this round's draft: made early by the worker, or now
            draft = guess = None
            hidden = 0.0
            if ahead is not None:
                fut, k_req = ahead
                ahead = None
                (early, dt_e) = fut.result()
                stats.draft_s += dt_e
                if told == len(seq):
                    (draft, guess), hidden = early, dt_e
            else:
                k_req = next_k.pop() if next_k else ctl.choose(self.policy)
            if draft is None and k_req > 0:
                self._catch_up(worker, seq, told)
                told = len(seq)
                (draft, guess), dt = worker.call(self._draft, k_req, ds, pipelined)
                stats.draft_s += dt
                self._learn_draft(k_req + (1 if pipelined else 0), dt)
            if draft is None or not draft.tokens:
                # Plain verifier steps: speculation does not pay now (or nothing was drafted).
                if ctl.in_fallback and not any(n.startswith("controller:") for n in stats.notes):
                    stats.notes.append("controller: speculation slower than plain here; plain steps, probing now and then")
                for t, lp_t in self._plain_steps(cache, last, sampler, base, r, ctl, stats, next_k):
                    seq.append(t)
                    last = t
                    r += 1
                    yield Token(t, lp_t, "verifier")
                continue
            k = len(draft.tokens)
            # ---- start drafting round r+1 early: assume all k kept and `guess` next
            if pipelined and guess is not None:
                k_next = ctl.choose(self.policy)
                if k_next > 0:
                    dsn, _ = self._samplers(sampler, base, r + 1)
                    ahead = (worker.submit(self._draft_after, k, guess, k_next, dsn), k_next)
            # ---- verify [last] + drafts: K+1 positions in one pass
            tv = self._now()
            x = mx.array([[last] + draft.tokens], dtype=mx.int32)
            logits, h = self._verifier(x, cache)
            p = vs.logprobs(logits)  # (k+1, V)
            n, nxt = rejection_sample(draft.tokens, draft.logprobs, p, vs.next_key())
            if h is not None:
                self._fpend.append(h[: n + 1])  # features of [last] + the kept drafts
            for c in cache:
                c.trim(k - n)  # the cache holds [last] + k drafts; keep [last] + n
            out = draft.tokens[:n] + [nxt]
            if sampler.params.greedy:
                lps = [0.0] * (n + 1)  # one-hot p: every emitted token has log-prob 0
            else:
                lps = p[mx.arange(n + 1), mx.array(out)].tolist()
            stats.verify_s += self._now() - tv
            self._learn_verify(k + 1, self._now() - tv)
            stats.verifier_passes += 1
            stats.record_draft(k, n)
            stats.draft_tokens = k
            seq.extend(out)
            if ahead is not None:
                # The worker already assumed seq + drafts + guess.
                told = len(seq) if (n == k and nxt == guess) else -1
            else:
                worker.call(drafter.accept, n, nxt)
                told = len(seq)
                if self.features:
                    self._hand_features()
            stats.hidden_draft_s += hidden
            ctl.record_round(k, n, self._now() - ts, (1.0 if hidden else 0.0) if pipelined else None)
            last = nxt
            for i, t in enumerate(out):
                yield Token(t, float(lps[i]), "drafter" if i < n else "verifier")


def default_pipeline(drafter) -> bool:
    """Pipeline when drafter and verifier sit on different devices; on one CPU they compete."""
    return placement(drafter) == "apart"


def engine_memory(engine, drafter, name: str) -> dict:
    """The per-engine dict a speculative mode keeps its controller in, per drafter and mode."""
    return engine.memory.speculative.setdefault((id(drafter), name), {})


def prior_costs(curve=None, drafting=None) -> CostModel:
    """Costs from a learnt curve (estimate.Costs) and drafting cost (estimate.DraftCost),
    fresh priors when not given: nothing is measured here."""
    curve = curve if curve is not None else Costs(list(SIZES), prior_curve(SIZES))
    drafting = drafting if drafting is not None else DraftCost()
    verify = [curve.verify(T) for T in range(1, KMAX + 2)]
    return CostModel(verify, drafting.value(verify[0]), measured=curve.in_seconds(),
                     curve=curve, drafting=drafting)


def after_request(engine):
    """What a mode calls when a request's rounds end: the engine's learnt costs are
    published for the batcher and written when enough is new (edgespec.calibration)."""
    def done():
        store = cost_store(engine)
        store.publish(engine)
        store.maybe_save()

    return done


def bind_engine(mode, engine):
    """What a mode made for a request takes from its engine: the hook that publishes and saves
    the learnt costs when the request's rounds end, and the policy that carries out (or, in
    tests, replaces) its timing-driven choices (edgespec.adaptive.policy)."""
    mode.after_request = after_request(engine)
    mode.policy = policy_for(engine)
    return mode


def engine_costs(engine, drafter) -> CostModel:
    """Costs for this engine/drafter pair from what the engine has learnt so far (its cost
    store, edgespec.calibration: persisted by an earlier process, else a prior that the
    first steps put in seconds); nothing is measured before the first token. Each
    request takes the latest, and its passes and drafts run alone teach the store."""
    store = cost_store(engine)
    return prior_costs(store.costs, store.draft(drafter))


@register_mode(
    "speculative", "draft with the attached drafter, verify K+1 tokens per pass (lossless)", options=[PIPELINE]
)
def make_speculative(engine, options):
    drafter = engine.drafter
    if drafter is None:
        raise DrafterRequiredError(
            "mode 'speculative' needs a drafter: load with drafter='self' (skip layers of the "
            "verifier), 'prompt_lookup', or a drafter folder/bundle"
        )
    costs = engine_costs(engine, drafter) if options.draft_tokens == "auto" else None
    # The request drafts with its own fork of the drafter (its state apart from the batch's
    # other rows); what is learnt stays keyed to the engine's drafter.
    mode = SpeculativeMode(engine.model, request_drafter(drafter), options, costs=costs,
                           memory=engine_memory(engine, drafter, "speculative"))
    mode.request_drafter = mode.drafter  # the batch binds its prefix reuse
    bind_engine(mode, engine)
    # Notes from attaching the drafter (e.g. Core ML unavailable -> MLX copy); apps show each once.
    mode.extra_notes = list(engine.drafter_notes)
    return mode
