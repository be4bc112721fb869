"""A drafter's catch-up priced apart from its drafted tokens (issue #45, `auto` on free text).

Before drafting, a drafter is fed the committed tokens it has not seen (those of the rounds
other sources won). Folded into the cost per drafted token, that catch-up made a drafter that
drafts rarely look dear, so it drafted even less. Here: the catch-up is counted before the
call (`unseen`), learnt as its own term, priced once per call, and persisted beside the
per-token cost (an older file still loads). Fake clocks only: no timing of real work."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
from conftest import make_tiny_model, make_tiny_tokenizer

import edgespec.adaptive.estimate as estimate
import edgespec.calibration as cal
from edgespec import sealed
from edgespec.adaptive.decoder import AdaptiveDecoder
from edgespec.adaptive.estimate import AcceptanceStats, Costs
from edgespec.adaptive.policy import TimedPolicy
from edgespec.adaptive.sources import DrafterSource
from edgespec.drafters.base import Draft, DrafterCaps, ModelDrafter, common_prefix
from edgespec.engine import Engine
from edgespec.logits.sampling import Sampler, SamplingParams
from edgespec.weights.loader import LoadedModel

GREEDY = Sampler(SamplingParams(temperature=0.0))


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class CatchingUpDrafter:
    """A drafter whose sync costs X seconds per token it had not seen, and whose drafting
    costs Y seconds per token (on a fake clock)."""

    name = "catching-up"
    device = "none"
    vocab_size = 64
    model = None
    expected_acceptance = 0.9
    caps = DrafterCaps(runs_on="host", catches_up=True)

    def __init__(self, clock: FakeClock, x: float, y: float):
        self.clock, self.x, self.y = clock, x, y
        self.seen = 0
        self.seq: list[int] = []

    def begin(self, prompt):
        self.seq, self.seen = list(prompt), len(prompt) - 1

    def unseen(self, committed):
        return max(len(committed) - 1 - self.seen, 0)

    def sync(self, committed):
        self.clock.t += self.x * self.unseen(committed)
        self.seq, self.seen = list(committed), len(committed) - 1

    def draft(self, k, sampler):
        self.clock.t += self.y * k
        return Draft([(self.seq[-1] + 1 + j) % self.vocab_size for j in range(k)], None)

    def accept(self, n, token):
        self.sync(self.seq + [token])

    def close(self):
        pass


def test_the_learnt_cost_per_token_is_the_drafting_not_the_catch_up():
    x, y = 0.004, 0.01
    clock = FakeClock()
    src = DrafterSource(CatchingUpDrafter(clock, x, y), None, clock=clock)
    rng = random.Random(0)
    seq = list(range(1, 12))
    src.begin(seq)
    for _ in range(30):
        seq += [rng.randrange(64) for _ in range(rng.randint(1, 40))]  # other sources' rounds
        k = rng.randint(1, 8)
        pending = src.unseen(seq)
        src.draft(seq, k, GREEDY)
        assert src.last_unseen == pending and src.last_s == pytest.approx(x * pending + y * k)
        src.observe()
    # Not (y + x * pending / k), what dividing a call's time by k learnt.
    assert src.cost.per_token == pytest.approx(y, rel=1e-3)
    assert src.cost.catch_up == pytest.approx(x, rel=1e-3)
    assert src.cost_per_token(0.05) == pytest.approx(y, rel=1e-3)


def test_a_round_is_priced_catch_up_plus_k_tokens_and_grows_with_what_is_unseen():
    clock = FakeClock()
    src = DrafterSource(CatchingUpDrafter(clock, 0.0, 0.0), cal.DraftCost(per_token=0.01, catch_up=0.002))
    prompt = [3, 4, 5]
    src.begin(prompt)
    prices = [src.draft_s(prompt + [7] * n, 4, 0.05) for n in range(0, 50, 7)]
    assert prices == pytest.approx([0.002 * n + 4 * 0.01 for n in range(0, 50, 7)])
    assert all(a < b for a, b in zip(prices[:-1], prices[1:], strict=True))
    ks = np.arange(1, 9)
    assert np.allclose(src.draft_s(prompt + [7] * 10, ks, 0.05), 0.02 + 0.01 * ks)

    class NoCatchUp(CatchingUpDrafter):
        caps = DrafterCaps(runs_on="host")  # undeclared: nothing priced apart

    plain = DrafterSource(NoCatchUp(clock, 0.0, 0.0), cal.DraftCost(per_token=0.01, catch_up=0.002))
    plain.begin(prompt)
    assert plain.unseen(prompt + [7] * 30) == 0 and plain.draft_s(prompt + [7] * 30, 4, 0.05) == pytest.approx(0.04)


def _planner(src: DrafterSource) -> AdaptiveDecoder:
    """A decoder as a request starts (no candidates from cheap sources), to ask for its plan."""
    dec = AdaptiveDecoder(make_tiny_model(0), [], Costs([1, 16, 64], [0.05, 0.06, 0.1]), drafter=src,
                          policy=TimedPolicy(clock=FakeClock()))
    dec.acc = AcceptanceStats(dec.priors)
    dec.plain_s, dec.since_draft, dec.probe_wait = 0.05, 0, 10**9
    dec._batch_ctx = None
    dec.policy.begin({})
    return dec


def test_the_planner_drafts_when_little_is_unseen_and_not_after_a_long_silence():
    clock = FakeClock()
    src = DrafterSource(CatchingUpDrafter(clock, 0.0, 0.0), cal.DraftCost(per_token=0.005, catch_up=0.01))
    assert src.clock is not clock  # the decoder hands it its own
    dec = _planner(src)
    assert src.clock is dec.clock
    prompt = [3, 4, 5, 6]
    src.begin(prompt)
    assert dec._timed_plan(prompt + [9]).draft_k > 0  # one token to catch up on: drafting pays
    late = dec._timed_plan(prompt + [9] * 400)  # 4 s of catch-up: a plain step does better
    assert late.kind == "plain" and late.draft_k == 0


def test_unseen_counts_what_a_model_drafter_feeds_next():
    drafter = ModelDrafter(make_tiny_model(5, num_hidden_layers=1))
    rng = random.Random(1)
    seq = [rng.randrange(1, 60) for _ in range(9)]
    drafter.begin(seq)
    assert drafter.unseen(seq) == 0  # the prompt's last token rides with the first draft step
    for _ in range(12):
        k = rng.randint(1, 5)
        if rng.random() < 0.6:  # drafted, then some of it kept
            drafter.sync(seq)
            d = drafter.draft(k, GREEDY)
            seq += d.tokens[:rng.randint(0, k)] + [rng.randrange(1, 60)]
        else:  # rounds of other sources
            seq += [rng.randrange(1, 60) for _ in range(rng.randint(1, 6))]
        n = drafter.unseen(seq)
        assert n == len(seq) - 1 - common_prefix(drafter.fed, seq[:-1])
        drafter.sync(seq)
        drafter._rollback()
        assert len(seq[len(drafter.fed):]) == n + 1  # what draft() feeds: the unseen and the last


def test_a_catch_up_projects_only_the_last_position_and_drafts_the_same():
    """A draft call feeds its catch-up and the last token in one pass; only that pass's last
    position is drafted from, so only it goes through the output projection (and, for a
    reduced-vocabulary drafter, its expansion to the full vocabulary). The drafts and their q
    are those of projecting every position."""
    from edgespec.drafters.distilled import DistilledDrafter
    from edgespec.drafters.vocab_map import VocabMap

    rng = random.Random(3)
    prompt = [rng.randrange(1, 60) for _ in range(7)]
    later = [rng.randrange(1, 60) for _ in range(9)]  # other sources' rounds: 9 unseen
    model = make_tiny_model(6, num_hidden_layers=1)
    vmap = VocabMap(np.array([-1] + list(range(0, 64, 2)), dtype=np.int64), 64)
    small = make_tiny_model(6, num_hidden_layers=1, vocab_size=vmap.size)
    for make in (lambda: ModelDrafter(model), lambda: DistilledDrafter(small, vmap)):
        drafts, widths = [], []
        for last_only_allowed in (True, False):
            d = make()
            real = type(d)._forward

            def forward(x, last_only=False, d=d, real=real, allowed=last_only_allowed, widths=widths):
                widths.append((allowed, x.shape[1], last_only))
                return real(d, x, last_only and allowed)
            d._forward = forward
            d.begin(prompt)
            d.sync(prompt + later)
            out = d.draft(3, GREEDY)
            drafts.append((out.tokens, np.array(out.logprobs)))
        assert drafts[0][0] == drafts[1][0]
        np.testing.assert_array_equal(drafts[0][1], drafts[1][1])
        # the catch-up pass (10 tokens) asked for its last position alone
        assert (True, 10, True) in widths


def test_draft_cost_without_unseen_tokens_learns_per_token_alone():
    d = cal.DraftCost()
    d.observe(4, 0.04)
    d.observe(2, 0.02)
    assert d.per_token == pytest.approx(0.01) and d.catch_up is None
    assert d.catch_up_s(10, 0.05) == pytest.approx(10 * estimate.CATCH_UP_PRIOR * 0.01)  # the prior
    loaded = cal.DraftCost(per_token=0.01, catch_up=0.003)
    loaded.observe(4, 0.04)  # no unseen tokens: the loaded catch-up stands
    assert loaded.catch_up == pytest.approx(0.003) and loaded.per_token == pytest.approx(0.01)


# ---------------------------------------------------------------- persisted
class TinyDrafter(ModelDrafter):
    name = "tiny"


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGESPEC_HOME", str(tmp_path))
    monkeypatch.setenv("EDGESPEC_CALIBRATION", "on")
    return tmp_path


def _engine() -> Engine:
    model = make_tiny_model(0, scale=3.0)
    loaded = LoadedModel(model, make_tiny_tokenizer(model.args.vocab_size), None,
                         {"files": {"model.safetensors": {"size": 1, "sha256": "cd" * 32}}})
    engine = Engine(loaded, history="off")
    engine.drafter = TinyDrafter(make_tiny_model(5, scale=3.0, num_hidden_layers=1))
    return engine


def _write(engine, **entries):
    key = cal.cost_key(engine.loaded)
    path = cal.key_path(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(sealed.seal({"format": cal.FORMAT, "key": key, "verify": {"1": 0.05, "4": 0.07},
                                            "counts": {"1": 3, "4": 1}, **entries})))
    return path


def test_a_file_written_before_the_catch_up_term_loads_without_its_per_token_figures(home):
    engine = _engine()
    dk = cal.drafter_key(engine.drafter)
    path = _write(engine, draft={dk: 0.04})  # an older file: no "catch_up"
    store = cal.cost_store(engine)
    assert store.warm and store.costs.verify(4) == pytest.approx(0.07)  # the curve loads
    d = store.draft(engine.drafter)
    assert d.per_token is None and d.catch_up is None  # held catch-up time: the prior applies
    assert d.value(0.05) == pytest.approx(d.prior * 0.05)
    assert path.exists() and not list(path.parent.glob("*.corrupt*"))  # not damaged: left in place
    d.observe(4, 0.02, unseen=3)
    d.observe(2, 0.03, unseen=10)
    assert store.save()
    data = json.loads(path.read_text())
    assert data["draft"][dk] == pytest.approx(d.per_token) and data["catch_up"][dk] == pytest.approx(d.catch_up)

    again = cal.cost_store(_engine())  # a later process reads both back
    back = again.draft(engine.drafter)
    assert back.per_token == pytest.approx(d.per_token) and back.catch_up == pytest.approx(d.catch_up)


def test_a_damaged_catch_up_entry_is_moved_aside(home):
    engine = _engine()
    dk = cal.drafter_key(engine.drafter)
    path = _write(engine, draft={dk: 0.01}, catch_up={dk: -1.0})
    store = cal.cost_store(engine)
    assert not store.warm and not path.exists() and list(path.parent.glob("*.corrupt*"))


def test_an_unmeasured_catch_up_is_kept_as_null(home):
    engine = _engine()
    dk = cal.drafter_key(engine.drafter)
    _write(engine, draft={dk: 0.01}, catch_up={dk: None})
    d = cal.cost_store(engine).draft(engine.drafter)
    assert d.per_token == pytest.approx(0.01) and d.catch_up is None
