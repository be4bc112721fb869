"""The regret guard (edgespec.adaptive.policy.RegretGuard): when the priced choices realise
fewer tokens/s than plain steps measured in the same window (contention the prices did not
see), `auto` returns to plain within a few rounds, probes again with backoff, speculates
again once the slowdown ends, and its output stays plain decoding's. Time is a fake clock
advanced by the model's calls, so nothing here depends on the machine's speed."""

from __future__ import annotations

import pytest
from conftest import make_tiny_model, make_tiny_tokenizer

from edgespec.adaptive.estimate import closed_top
from edgespec.adaptive.policy import RegretGuard, TimedPolicy
from edgespec.engine import Engine
from edgespec.weights.loader import LoadedModel

PROMPT = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7]
SLOW = (60, 220)  # sequence positions past the prompt where wide passes are slow
N = 360


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class ContendedModel:
    """A model whose calls advance a fake clock: 1 unit per pass of any width (an accelerator),
    except that inside `slow` (positions past the prompt) a pass over more than one token
    costs `factor` units: another process took what wide passes need."""

    def __init__(self, model, clock: Clock, slow=(0, 0), factor: float = 8.0):
        self._model, self.clock, self.slow, self.factor = model, clock, slow, factor
        self.start = 0  # the prompt's length, set per request
        self.guard: RegretGuard | None = None
        self.calls: list[tuple[int, int, int]] = []  # (position past the prompt, width, trips so far)

    def __call__(self, inputs, cache, **kw):
        width = inputs.shape[1]
        pos = cache[0].offset - self.start
        slow = width > 1 and self.slow[0] <= pos < self.slow[1] and pos >= 0
        self.clock.t += self.factor if slow else 1.0
        if pos >= 0:
            self.calls.append((pos, width, self.guard.trips if self.guard else 0))
        return self._model(inputs, cache, **kw)

    def __getattr__(self, name):
        return getattr(self._model, name)


class Fooled(TimedPolicy):
    """Prices that contention fooled: a tree round whenever there is anything to verify,
    every candidate node in it. Only the guard stands between this and a slow request."""

    def prefer(self, default, can_tree, can_draft, kmax):
        if can_tree and default.kind == "plain":
            from dataclasses import replace

            return replace(default, kind="tree")
        return default

    def tree(self, nodes, default, cap):
        return default or closed_top(nodes, min(len(nodes), cap - 1))


def _engine(slow, guard: RegretGuard, policy_cls=Fooled):
    clock = Clock()
    inner = make_tiny_model(3, scale=3.0)
    model = ContendedModel(inner, clock, slow)
    model.guard = guard
    eng = Engine(LoadedModel(model, make_tiny_tokenizer(inner.args.vocab_size), None))
    eng.policy = policy_cls(guard=guard, clock=clock)
    return eng, model


def _run(eng, model, mode="adaptive"):
    model.start = len(PROMPT)
    model.calls.clear()
    extra = {"sources": "context"} if mode == "adaptive" else {}
    return eng.generate(PROMPT, max_tokens=N, mode=mode, **extra).tokens


@pytest.fixture(scope="module")
def plain_ref():
    eng, model = _engine((0, 0), RegretGuard())
    return _run(eng, model, "plain")


def _wide(calls, lo, hi):
    return [c for c in calls if lo <= c[0] < hi and c[1] > 1]


def test_guard_returns_to_plain_under_contention_and_comes_back(plain_ref):
    guard = RegretGuard(hold=8, max_hold=64)
    eng, model = _engine(SLOW, guard)
    out = _run(eng, model)
    assert out == plain_ref  # the guard only chooses what to verify
    calls = model.calls
    # Speculating before the slowdown (the fooled prices verify whatever the context offers).
    assert len(_wide(calls, 0, SLOW[0])) >= 5
    # Back to plain within a few wide rounds of the slowdown's start.
    before_trip = [c for c in _wide(calls, *SLOW) if c[2] == 0]
    assert guard.trips >= 1 and len(before_trip) <= 4, (guard.events, before_trip)
    # While slow: mostly plain steps; the probes back off (the holds double).
    slow_calls = [c for c in calls if SLOW[0] <= c[0] < SLOW[1]]
    assert len(_wide(calls, *SLOW)) <= 0.25 * len(slow_calls), guard.events
    # After the slowdown: probed, found paying, speculating again.
    assert guard.releases >= 1
    assert len(_wide(calls, SLOW[1], 10**9)) >= 5, guard.events


def test_without_the_guard_the_fooled_prices_stay_slow(plain_ref):
    # The same run with a guard that never trips: the wide rounds go on through the slowdown
    # (what the test above shows the guard prevents).
    guard = RegretGuard(margin=0.0)
    eng, model = _engine(SLOW, guard)
    assert _run(eng, model) == plain_ref
    slow_calls = [c for c in model.calls if SLOW[0] <= c[0] < SLOW[1]]
    assert guard.trips == 0
    assert len(_wide(model.calls, *SLOW)) > 0.25 * len(slow_calls)


def test_no_slowdown_no_trip_and_plain_steps_interleaved(plain_ref):
    # The real prices, no contention: the guard never trips, and the planner's plain step is
    # re-measured now and then between rounds (paired samples).
    guard = RegretGuard(refresh=16)
    eng, model = _engine((0, 0), guard, TimedPolicy)
    assert _run(eng, model) == plain_ref
    assert guard.trips == 0, guard.events
    assert guard.round_no > 16 and guard.interleaves >= 1


def test_guard_unit_trip_hold_backoff_release():
    g = RegretGuard(rounds=4, min_rounds=3, hold=2, max_hold=8, refresh=100)
    for _ in range(3):
        g.plain_done(1.0)
    for _ in range(3):
        g.round_done(2, 1.0)  # 2 tokens/s vs 1: pays
    assert not g.want_plain and g.trips == 0
    for _ in range(4):
        g.round_done(1, 4.0)  # 0.25 tokens/s: loses
        if g.want_plain:
            break
    assert g.trips == 1 and g.want_plain and g.hold_left == 2
    g.plain_done(1.0)
    assert g.want_plain
    g.plain_done(1.0)
    assert not g.want_plain  # hold over: probe
    for _ in range(3):
        g.round_done(1, 4.0)
    assert g.trips == 2 and g.hold_left == 4  # backoff doubled
    for _ in range(4):
        g.plain_done(1.0)
    for _ in range(3):
        g.round_done(3, 1.0)
    assert g.releases == 1 and g.hold == 2 and not g.want_plain  # paid again: backoff reset


def test_guard_interleaves_when_no_plain_step_is_paired():
    g = RegretGuard(rounds=4, min_rounds=2, refresh=100)
    g.plain_done(1.0)
    for _ in range(20):
        g.round_done(3, 1.0)  # pays: no need for a fresh plain step until `refresh`
    assert g.interleaves == 0
    for _ in range(4):
        g.round_done(1, 4.0)  # looks worse than the last plain step, but that one is old
        if g.want_plain:
            break
    assert g.interleaves == 1 and g.trips == 0  # measure plain first, then judge
    g.plain_done(1.0)
    g.round_done(1, 4.0)
    assert g.trips == 1


def test_a_size_measured_under_load_is_priced_at_todays_plain_step():
    """Wider passes are measured only when chosen, plain steps all the time: a size timed
    while other processes held the cores is priced by the plain step's time now, so it does
    not stay dear (and unchosen) after the load is gone, nor cheap when load comes."""
    from edgespec.adaptive.estimate import Costs

    c = Costs(sizes=[1, 4, 16], verify_s=[0.01, 0.012, 0.02])
    for _ in range(5):
        c.observe(1, 0.10)  # busy: a plain step takes 0.1 s
    c.observe(4, 0.30)  # a 4-token pass measured then: 3x a plain step
    assert c.verify(4) == pytest.approx(0.30)
    for _ in range(30):
        c.observe(1, 0.05)  # the load is gone: plain steps take 0.05 s
    assert c.verify(1) == pytest.approx(0.05, rel=1e-3)
    assert c.verify(4) == pytest.approx(0.15, rel=1e-2)  # still 3x a plain step, not 0.30
    assert c.verify(8) < c.verify(16) and c.verify(2) < c.verify(4)  # sizes between follow it
    assert c.quiet()[4] == pytest.approx(0.15, rel=0.05)  # and so does what is persisted (at the quiet step)
    for _ in range(30):
        c.observe(1, 0.20)  # heavier load than when it was measured
    assert c.verify(4) == pytest.approx(0.60, rel=1e-2)


def test_guard_judges_time_quickly_and_luck_over_a_window():
    # Rounds that take what they were priced at (1.2 plain steps for 2 expected tokens) but
    # happen to accept little: a few of them are no verdict (the control, judged on what 3
    # rounds committed as before, trips: what kept an idle machine's chat replies plain) ...
    g = RegretGuard(rounds=8, min_rounds=3, refresh=100)
    control = RegretGuard(rounds=3, min_rounds=3, refresh=100)
    for guard in (g, control):
        guard.plain_done(1.0)
        for _ in range(3):
            guard.round_done(1, 1.2, expected=2.0)
    assert g.trips == 0 and not g.want_plain
    assert control.trips == 1
    # ... lucky rounds after them even out the window ...
    for _ in range(4):
        g.round_done(3, 1.2, expected=2.0)
    assert g.trips == 0
    # ... but a full window that commits less than plain would is one (the estimates are
    # wrong for this content): it trips.
    g.plain_done(1.0)  # a paired plain step (the decoder interleaves one when none is recent)
    for _ in range(8):
        g.round_done(1, 1.2, expected=2.0)
        if g.trips:
            break
    assert g.trips == 1 and g.want_plain
    # Contention: the same expected tokens now take 4 plain steps: it trips within
    # min_rounds rounds, whatever they committed.
    h = RegretGuard(rounds=8, min_rounds=3, refresh=100)
    h.plain_done(1.0)
    for _ in range(3):
        h.round_done(3, 4.0, expected=2.0)
    assert h.trips == 1 and h.want_plain


def test_a_request_starts_without_the_last_ones_hold():
    g = RegretGuard(rounds=4, min_rounds=3, hold=4, max_hold=64, refresh=100)
    policy = TimedPolicy(guard=g)
    policy.begin({})
    g.plain_done(1.0)
    for _ in range(9):  # trips, holds, probes, trips again: the hold doubles
        g.round_done(1, 4.0)
        while g.want_plain:
            g.plain_done(1.0)
    assert g.trips >= 2 and g.hold > 4
    for _ in range(3):  # a fresh verdict (the trip cleared the rounds) that loses again
        g.round_done(1, 4.0)
    assert g.want_plain  # held inside this request
    policy.begin({})  # the next request: its own verdicts, the load's plain steps kept
    assert not g.want_plain and g.hold == 4 and g.hold_left == 0 and not g.spec
    assert g.plain_s() == 1.0


def test_rounds_timed_while_the_cores_are_busy_teach_the_load_not_the_curve():
    """A wider pass slows down more than the plain step under contention: a size timed then,
    scaled by the plain step, stays dear after the load leaves, and the planner does not choose
    (so does not re-measure) a dear size. While plain steps run BUSY times over their quiet
    value, a round teaches `load` only; a size with nothing quiet known takes the busy samples
    until a quiet one replaces them, and only quiet values are persisted (`quiet`)."""
    from edgespec.adaptive.estimate import BUSY, Costs

    c = Costs(sizes=[1, 4, 16], verify_s=[0.01, 0.012, 0.02])
    for _ in range(20):
        c.observe(1, 0.01)
    c.observe(4, 0.013)
    assert not c.busy() and c.verify(4) == pytest.approx(0.013)
    for _ in range(20):
        c.observe(1, 0.025)  # other processes take the cores: plain steps 2.5x
    assert c.busy() and c.plain_floor < 0.01 * BUSY
    for _ in range(5):
        c.observe(4, 0.10)  # and a 4-token pass ~8x its quiet time
    assert c.verify(4) == pytest.approx(0.013 * 2.5, rel=0.01)  # the quiet ratio, at today's plain step
    assert c.under_load().verify(4) > 2 * c.verify(4)  # what this moment costs: the load's part
    c.observe(8, 0.09)  # never timed on quiet cores: the busy sample stands for it ...
    assert c.verify(8) == pytest.approx(0.09)
    q = c.quiet()  # ... but is not persisted; the rest is, at the quiet plain step
    assert 8 not in q and q[1] == pytest.approx(0.01, rel=0.1)  # it drifts up slowly
    assert q[4] == pytest.approx(0.013, rel=0.1)
    for _ in range(30):
        c.observe(1, 0.01)  # the load is gone
    assert not c.busy()
    assert c.verify(4) == pytest.approx(0.013, rel=0.01)  # still cheap, so chosen again
    c.observe(8, 0.015)  # the first quiet sample replaces the busy ones
    assert c.verify(8) == pytest.approx(0.015) and c.quiet()[8] == pytest.approx(0.015, rel=0.02)
    # A machine that got slower for good (not another process) is taken for quiet in time.
    for _ in range(1500):
        c.observe(1, 0.02)
    assert not c.busy()
    before = c.verify(4)
    assert before == pytest.approx(0.026, rel=0.01)
    c.observe(4, 0.03)
    assert c.verify(4) > before * 1.05  # learnt again


def test_a_busy_spell_does_not_outlive_the_process_in_the_calibration_file(tmp_path):
    """The persisted curve is quiet prices: the next process prices a size by its quiet
    ratio to the plain step, whatever the load when the file was written."""
    from edgespec.calibration import CostStore

    key, path = {"model": {"name": "m"}, "machine": "here"}, tmp_path / "cal.json"
    a = CostStore(key, path, kind="cpu")
    for _ in range(20):
        a.costs.observe(1, 0.01)
    a.costs.observe(6, 0.015)
    for _ in range(20):
        a.costs.observe(1, 0.02)
    for _ in range(4):
        a.costs.observe(6, 0.08)  # rounds while busy
    a.costs.observe(12, 0.1)  # a size timed only while busy
    assert a.save()
    b = CostStore(key, path, kind="cpu")
    assert b.loaded_verify[1] == pytest.approx(0.01, rel=0.1)
    assert b.loaded_verify[6] == pytest.approx(0.015, rel=0.1)
    assert 12 not in b.loaded_verify
    assert b.costs.verify(6) / b.costs.verify(1) == pytest.approx(1.5, rel=0.03)


def test_a_drafter_timed_while_busy_is_priced_so_now_and_persisted_at_its_quiet_cost(tmp_path):
    from edgespec.calibration import CostStore

    class Drafter:  # what the store keys a drafter by
        name, model = "d", None

    key, path = {"model": {"name": "m"}, "machine": "here"}, tmp_path / "cal.json"
    a = CostStore(key, path, kind="cpu")
    d = a.draft(Drafter())
    for _ in range(20):
        a.costs.observe(1, 0.01)
    for k in (2, 4, 3, 4):
        d.observe(k, 0.001 * k, unseen=0)
    assert d.per_token == pytest.approx(0.001)
    for _ in range(20):
        a.costs.observe(1, 0.025)
    assert a.costs.busy()
    for k in (2, 4, 3, 4, 4, 2):
        d.observe(k, 0.004 * k, unseen=0)  # drafting 4x slower while the cores are shared
    assert d.per_token > 0.003  # what it costs now
    assert d.quiet()[1] == pytest.approx(0.001)  # what it costs on quiet cores
    assert a.save()
    b = CostStore(key, path, kind="cpu")
    assert b.draft(Drafter()).per_token == pytest.approx(0.001)


def test_rounds_dearer_than_priced_raise_every_wider_size_until_plain_steps_ease_it():
    """Costs.load: under contention a wide pass slows down more than the plain step it is
    scaled by; the measured/priced ratio of the rounds prices every size > 1, measured or
    not, and timed plain steps ease it back towards the curve."""
    from edgespec.adaptive.estimate import LOAD_EASE, Costs

    c = Costs(sizes=[1, 4, 16], verify_s=[0.01, 0.012, 0.02])
    for _ in range(5):
        c.observe(1, 0.02)  # a busy machine: plain steps take 2x
    priced4, priced12 = c.verify(4), c.verify(12)
    assert c.load == 1.0 and c.under_load().verify(4) == pytest.approx(priced4)
    for _ in range(4):
        c.observe(4, 3 * c.verify(4))  # 4-token rounds run 3x what the curve says, each time
    assert c.load > 1.5
    loaded = c.under_load()
    assert loaded.verify(1) == c.verify(1)  # the plain step is measured all the time: as is
    assert loaded.verify(12) == pytest.approx(c.verify(12) * c.load)  # a size never measured too
    assert loaded.verify(12) > 1.5 * priced12
    before = c.load
    c.observe(1, 0.02)
    assert c.load == pytest.approx(before ** LOAD_EASE)
    for _ in range(200):  # plain steps only: the curve's own prices return
        c.observe(1, 0.02)
    assert c.load == pytest.approx(1.0, abs=0.03)
    for _ in range(10):  # rounds cheaper than priced lower it, within the bound
        c.observe(4, 0.0001)
    assert 0.2 < c.load < 0.5


def test_the_planner_prices_the_load_its_rounds_measured(plain_ref):
    """With the real prices and a guard that never trips, the request takes less (fake) time
    when the rounds' measured load prices every size (Costs.load) than when it is held at 1
    (the per-size curve alone): fewer wide rounds while wide passes are slow, and speculation
    again soon after (plain steps ease the load back; the per-size curve alone stays dear, as
    the plain step it scales by never slowed). The output is plain's either way."""
    import edgespec.adaptive.estimate as estimate

    def run(weight):
        old = estimate.LOAD_WEIGHT
        estimate.LOAD_WEIGHT = weight
        try:
            eng, model = _engine(SLOW, RegretGuard(margin=0.0), TimedPolicy)
            assert _run(eng, model) == plain_ref
            c = model.calls
            return model.clock.t, len(_wide(c, 0, SLOW[0])), len(_wide(c, *SLOW)), len(_wide(c, SLOW[1], 10**9))
        finally:
            estimate.LOAD_WEIGHT = old

    t, before, slow, after = run(estimate.LOAD_WEIGHT)
    t_held, before_held, slow_held, after_held = run(0.0)
    print("fake seconds", t, "held", t_held, "; wide rounds before/slow/after", (before, slow, after), "held",
          (before_held, slow_held, after_held))
    assert before >= 5 and before_held >= 5  # both speculate before the slowdown
    assert slow < slow_held and after >= 5
    assert t < t_held
