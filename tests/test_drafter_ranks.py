"""A drafter that ranks its tokens (DrafterCaps.ranks): how sure it is of each drafted token,
its runner-ups, and its chain stopping where it is unsure; what `auto` makes of them."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from conftest import make_paced_engine, make_tiny_model, paced, random_prompts

from edgespec.adaptive.policy import SeededPolicy
from edgespec.adaptive.sources import SURE_EDGES, DrafterSource, sure_bucket
from edgespec.drafters.base import ModelDrafter, ranked_tokens
from edgespec.logits.sampling import Sampler, SamplingParams

GREEDY = Sampler(SamplingParams(temperature=0.0))


class Tiny(ModelDrafter):
    name = "tiny"


class SecondGuess(ModelDrafter):
    """The verifier's own model, its favourite pushed just below its second choice: every
    drafted token is the verifier's runner-up and the verifier's token is the drafter's."""

    name = "second-guess"

    def _forward(self, x: mx.array, last_only: bool = False) -> mx.array:
        logits = super()._forward(x, last_only)
        top = mx.max(logits, axis=-1, keepdims=True)
        first = logits == top
        second = mx.max(mx.where(first, -mx.inf, logits), axis=-1, keepdims=True)
        return mx.where(first, second - 1e-3, logits)


def test_ranked_tokens_put_the_drafted_token_first_then_the_most_likely():
    rng = np.random.default_rng(0)
    logits = mx.array(rng.normal(size=64).astype(np.float32) * 3)
    p = np.array(mx.softmax(logits))
    order = np.argsort(-p)
    ids, probs = ranked_tokens(logits, mx.array(int(order[0])), 4)
    assert np.array(ids).tolist() == order[:4].tolist()
    np.testing.assert_allclose(np.array(probs), p[order[:4]], rtol=1e-5)
    # a drafted token that is not the favourite (a sampled one) still comes first
    ids, probs = ranked_tokens(logits, mx.array(int(order[5])), 3)
    assert np.array(ids).tolist() == [int(order[5]), int(order[0]), int(order[1])]


def _drafter(seed: int = 3) -> Tiny:
    return Tiny(make_tiny_model(seed, scale=2.0, num_hidden_layers=1))


@pytest.mark.parametrize("floor", [0.0, 0.3, 0.9])
def test_a_ranking_draft_is_the_chain_and_stops_where_the_drafter_is_unsure(floor):
    prompt = random_prompts(1, seed=7)[0] + [5, 9]
    plain = _drafter()
    plain.begin(prompt)
    chain = plain.draft(6, GREEDY).tokens
    d = _drafter()
    d.begin(prompt)
    got = d.draft(6, GREEDY, ranks=3, floor=floor)
    ids, probs = got.ranked
    n = len(got.tokens)
    assert got.tokens == chain[:n] and ids.shape == (n, 3) and probs.shape == (n, 3)
    assert ids[:, 0].tolist() == got.tokens
    assert np.all(np.diff(probs[:, 1:], axis=1) <= 0)  # runner-ups by falling probability
    sure = np.cumprod(probs[:, 0])
    # it stops right after the first token whose running product is below the floor
    below = np.flatnonzero(sure < floor)
    assert n == (below[0] + 1 if below.size else 6)
    # the drafter's state after an early stop is the committed path's: the next call equals a
    # fresh drafter's on the same committed tokens
    committed = prompt + chain[:2] + [11]
    d.sync(committed)
    fresh = _drafter()
    fresh.begin(committed)
    assert d.draft(4, GREEDY).tokens == fresh.draft(4, GREEDY).tokens


def test_the_source_prices_each_drafted_token_by_how_sure_the_drafter_was():
    d = _drafter()
    src = DrafterSource(d, 0.001, runner_ups=2, floor=0.0)
    prompt = random_prompts(1, seed=2)[0] + [4]
    src.begin(prompt)
    cands = src.draft(prompt, 3, GREEDY)
    chain, rest = cands[0], cands[1:]
    assert len(chain.tokens) == 3 and chain.own == 0 and len(chain.token_buckets) == 3
    assert len(rest) == 6  # two runner-ups at each of the 3 positions
    for c in rest:
        j = c.own
        assert c.tokens[:j] == chain.tokens[:j] and c.tokens[j] != chain.tokens[j]
        assert c.token_buckets[:j] == chain.token_buckets[:j] and c.token_buckets[j].startswith("r")
    assert {b[0] for b in chain.token_buckets} == {"q"}
    # a drafter that does not rank: its chain alone, priced per depth
    src0 = DrafterSource(_drafter(), 0.001, runner_ups=0, floor=0.0)
    src0.begin(prompt)
    only = src0.draft(prompt, 3, GREEDY)
    assert len(only) == 1 and only[0].tokens == chain.tokens


def test_sure_buckets_cover_every_probability():
    assert sure_bucket("q", 0.0) == "q0" and sure_bucket("q", 1.0) == f"q{len(SURE_EDGES)}"
    assert sure_bucket("r", SURE_EDGES[2]) == "r3"


@pytest.fixture(scope="module")
def second_guess_engine():
    # Paced: a verifier pass costs ~3 ms whatever its width (an accelerator's regime).
    engine = make_paced_engine(0, 0.003, scale=3.0)
    engine.drafter = SecondGuess(paced(engine, make_tiny_model(0, scale=3.0), 0.0003))
    prompts = random_prompts(6, seed=11)
    refs = [engine.generate(p, max_tokens=24, mode="plain").tokens for p in prompts]
    return engine, prompts, refs


@pytest.mark.parametrize("runner_ups", [0, 2])
def test_runner_ups_carry_a_drafter_that_is_second_best(second_guess_engine, runner_ups):
    """Every drafted token is wrong and every first runner-up right: with runner-ups the drafter
    commits tokens (and its buckets learn which of its guesses to trust), without them none;
    the output is plain's either way."""
    engine, prompts, refs = second_guess_engine
    engine.memory.adaptive.clear()
    from_drafter = passes = total = 0
    for p, ref in zip(prompts, refs, strict=True):
        r = engine.generate(p, max_tokens=24, mode="adaptive", sources="drafter", runner_ups=runner_ups)
        assert r.tokens == ref
        from_drafter += r.stats.accepted_by_source.get("drafter", 0)
        passes += r.stats.verifier_passes
        total += len(r.tokens)
    if runner_ups == 0:
        assert from_drafter == 0
        return
    assert from_drafter >= total // 3, (from_drafter, total)
    assert passes < total * 0.7
    acc = next(iter(engine.memory.adaptive.values()))["acc"]
    # the buckets some drafted token reached (one never reached keeps its first guess)
    rates = {b: r for (s, b) in acc.tables if s == "drafter" and isinstance(b, str)
             if abs((r := acc.rates("drafter", b, 1)[0]) - acc.prior("drafter", b)) > 1e-9}
    runner = [v for b, v in rates.items() if b.startswith("r")]
    drafted = [v for b, v in rates.items() if b.startswith("q")]
    assert runner and drafted and max(drafted) < 0.2 < max(runner), rates


def test_seeded_sampling_with_runner_ups_is_plain_sampling(second_guess_engine):
    engine, prompts, _ = second_guess_engine
    for i, p in enumerate(prompts[:4]):
        kw = dict(max_tokens=20, temperature=0.8, seed=40 + i)
        ref = engine.generate(p, mode="plain", **kw).tokens
        assert engine.generate(p, mode="adaptive", sources="drafter+context", runner_ups=2, draft_floor=0.4,
                               **kw).tokens == ref


@pytest.mark.parametrize("options", [{"runner_ups": 2, "draft_floor": 0.4}, {"runner_ups": 4}, {"draft_floor": 0.7}])
def test_greedy_with_a_ranking_drafter_equals_plain(options):
    engine = make_paced_engine(1, 0.002, scale=3.0)
    # the verifier's weights, flattened: often its token, not always, less sure
    engine.drafter = Tiny(make_tiny_model(1, scale=2.5))
    drafted = 0
    for i, p in enumerate(random_prompts(8, seed=21)):
        # seeded rounds, not timed ones: the drafter drafts whatever the machine's load (timed,
        # a loaded CI machine priced it out of all 8 requests)
        engine.policy = SeededPolicy(100 + i)
        ref = engine.generate(p, max_tokens=24, mode="plain").tokens
        r = engine.generate(p, max_tokens=24, mode="adaptive", sources="drafter+context", **options)
        assert r.tokens == ref, (options, p)
        drafted += r.stats.accepted_by_source.get("drafter", 0)
    assert drafted > 0  # the drafter took part


def test_ranking_is_off_by_default():
    src = DrafterSource(_drafter(), 0.001)
    assert src.ranks == 0 and "drafter:q0" not in src.priors
    assert DrafterSource(_drafter(), 0.001, floor=0.4).ranks == 1
