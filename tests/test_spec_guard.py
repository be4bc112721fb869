"""The batch's measured guard over speculation (edgespec.batch.guard): per batch size,
speculation as the joint choice plans it or plain steps, whichever measured better."""

from __future__ import annotations

import pytest
from conftest import make_tiny_engine

from edgespec.batch.guard import SpecGuard


def _drive(guard, n, rates, steps):
    """Run `steps` steps of batch size n where regime k commits rates[k] tokens a second
    (1 s per step) -> how many steps each regime ran."""
    ran = {"spec": 0, "plain": 0}
    for _ in range(steps):
        k = guard.choose(n)
        ran[k] += 1
        guard.record(n, k, rates[k], 1.0)
    return ran


@pytest.mark.parametrize("winner", ["spec", "plain"])
def test_the_regime_that_measures_better_runs(winner):
    """After measuring both, the better regime runs nearly all steps; the loser is re-measured
    now and then (waits doubling), so it costs only a few percent."""
    g = SpecGuard()
    rates = {"spec": 10.0, "plain": 10.0}
    rates[winner] = 20.0
    ran = _drive(g, 4, rates, 1000)
    loser = "plain" if winner == "spec" else "spec"
    assert g.best(4) == winner
    assert ran[winner] > 950
    assert 2 * g.run_steps <= ran[loser] <= 50  # measured first, then re-probed, rarely
    assert g.rate(4, winner) == pytest.approx(20.0)


def test_the_guard_follows_a_change_of_traffic_and_keeps_batch_sizes_apart():
    g = SpecGuard()
    _drive(g, 4, {"spec": 10.0, "plain": 20.0}, 300)
    _drive(g, 2, {"spec": 30.0, "plain": 20.0}, 300)
    assert (g.best(4), g.best(2)) == ("plain", "spec")
    # speculation starts paying at 4 rows (say, replies that copy their prompt): found again
    ran = _drive(g, 4, {"spec": 40.0, "plain": 20.0}, 700)
    assert g.best(4) == "spec" and ran["spec"] > 350
    assert g.best(2) == "spec"


def test_a_fresh_batch_size_measures_the_joint_choice_first():
    g = SpecGuard(run_steps=3)
    assert [g.choose(3) for _ in range(3)] == ["spec"] * 3
    assert g.best(3) == "spec" and g.rate(3, "spec") is None


def test_a_new_batch_size_starts_from_its_nearest_measured_neighbour():
    """Plain measured better at 4 and 8 rows: a batch of 5 starts with plain steps (rates
    taken over from 4, tokens scaled by 5/4) instead of paying to measure speculation
    first; what it then measures itself decides."""
    g = SpecGuard()
    _drive(g, 4, {"spec": 10.0, "plain": 20.0}, 200)
    _drive(g, 8, {"spec": 10.0, "plain": 30.0}, 200)
    assert g.choose(5) == "plain"
    assert g.rate(5, "plain") == pytest.approx(25.0) and g.rate(5, "spec") == pytest.approx(12.5)
    assert g.summary()[5]["plain_steps"] == 0  # nothing measured at 5 rows yet
    _drive(g, 5, {"spec": 40.0, "plain": 20.0}, 400)  # at 5 rows speculation pays: found out
    assert g.best(5) == "spec" and _drive(g, 5, {"spec": 40.0, "plain": 20.0}, 100)["spec"] >= 90


def test_a_costly_loser_waits_longer():
    """Re-measuring a regime that loses half the rate every 24 steps would cost ~10%: its
    wait grows so that re-measuring costs about `explore` of the steps."""
    costly, mild = SpecGuard(), SpecGuard()
    ran_costly = _drive(costly, 8, {"spec": 10.0, "plain": 20.0}, 2000)["spec"]
    ran_mild = _drive(mild, 8, {"spec": 19.0, "plain": 20.0}, 2000)["spec"]
    assert ran_costly < ran_mild
    assert ran_costly * 0.5 / 2000 < 0.03  # what re-measuring cost, as a share of the rate


def _drive_timed(guard, n, rate, seconds, steps):
    """Like _drive, with regime k's steps taking seconds[k] and committing rate[k] tokens a
    second -> (steps each regime ran, the fraction of tokens lost against the better regime
    alone over the same time)."""
    ran, spent, got = {"spec": 0, "plain": 0}, 0.0, 0.0
    for _ in range(steps):
        k = guard.choose(n)
        ran[k] += 1
        spent += seconds[k]
        got += rate[k] * seconds[k]
        guard.record(n, k, rate[k] * seconds[k], seconds[k])
    return ran, 1.0 - got / (max(rate.values()) * spent)


def test_a_loser_with_long_steps_waits_in_proportion_to_their_time():
    """Speculation in a batch of 8 at a third of plain's rate (as at 8 rows in
    benchmarks/results/batching.md's run at 2d619d7), each step taken as three times as long: with waits counted in steps
    (the guard of 2d619d7) re-measuring it cost 7.4% of the tokens over 300 steps; counted in
    time, 3.9%: measuring it once."""
    g = SpecGuard()
    ran, lost = _drive_timed(g, 8, {"spec": 12.5, "plain": 37.6}, {"spec": 0.6, "plain": 0.2}, 300)
    assert g.best(8) == "plain"
    assert ran["spec"] == g.run_steps  # measured once, not again within 300 steps
    assert lost < 0.05


def test_a_lucky_win_is_checked_by_one_more_run_and_undone():
    """One run of speculation that happens to accept much wins its probe: it runs once more
    (at its usual rate), plain is measured again right after instead of after a wait, wins
    back, and speculation returns to a wait longer than before its lucky run."""
    g = SpecGuard()
    _drive(g, 4, {"spec": 10.0, "plain": 20.0}, 200)
    level = g._sizes[4].level["spec"]
    lucky = g.run_steps  # the next run of speculation commits 4x its usual rate
    after: list[str] = []  # the regimes after the lucky run
    for _ in range(400):
        k = g.choose(4)
        if lucky == 0:
            after.append(k)
        r = 20.0 if k == "plain" else 10.0
        if k == "spec" and lucky > 0:
            lucky, r = lucky - 1, 40.0
        g.record(4, k, r, 1.0)
    assert lucky == 0 and g.best(4) == "plain"
    assert after[: 3 * g.run_steps] == ["spec"] * g.run_steps + ["plain"] * (2 * g.run_steps)
    assert g._sizes[4].level["spec"] > level
    # the run in place and probes at its usual wait (100 steps here: 6 x 0.5 / 0.03), not a
    # run of speculation for as long as plain's wait as a fresh loser (66 steps)
    assert after.count("spec") <= 4 * g.run_steps


@pytest.mark.parametrize("kw", [dict(run_steps=0), dict(wait=0), dict(wait=8, wait_max=4), dict(decay=0.0),
                                dict(explore=0.0)])
def test_guard_settings_are_checked(kw):
    with pytest.raises(ValueError):
        SpecGuard(**kw)


def test_the_batcher_credits_steps_and_the_guard_steers_auto_rows():
    """Auto requests decoded together: the worker credits committed tokens to the regime that
    planned them (nothing is credited for plain-mode rows, which never ask), a plain regime
    makes every adaptive row's call one token, and the replies stay each request's own."""
    engine = make_tiny_engine(3, scale=1.3)
    prompts = [[5, 6, 7, 8] * 6, [9, 10, 11] * 8, [12, 13] * 10]  # repetitive: prompt lookup proposes
    ref = [engine.generate(p, max_tokens=30, mode="plain").tokens for p in prompts]

    sizes: list[int] = []
    real = engine.batcher.__class__._run_pass

    def spy(self, seqs):
        sizes.extend(s.row.T for s in seqs if s.emitted)
        return real(self, seqs)

    engine.batcher.__class__._run_pass = spy
    try:
        assert [r.tokens for r in engine.generate_many(prompts, max_tokens=30, mode="plain")] == ref
        # plain rows never ask: the guard is not consulted (its schedule does not run on steps
        # nobody asks about) and nothing is credited
        assert engine.batcher.guard.summary() == {}
        for forced in ("plain", "spec"):
            engine.batcher.guard.choose = lambda n, k=forced: k
            sizes.clear()
            assert [r.tokens for r in engine.generate_many(prompts, max_tokens=30, mode="auto")] == ref
            if forced == "plain":
                assert sizes and set(sizes) == {1}
            else:
                assert max(sizes) > 1  # the joint choice speculates on these prompts
    finally:
        engine.batcher.__class__._run_pass = real
    summ = engine.batcher.guard.summary()
    assert summ[3]["plain_steps"] > 0 and summ[3]["spec_steps"] > 0
    assert summ[3]["plain_tps"] > 0 and summ[3]["spec_tps"] > 0
