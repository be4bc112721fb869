"""The adaptive decoder behind `auto`: lossless with every source combination, priced choices,
sampling law, and the option schemas checked before a model loads."""

from __future__ import annotations

import itertools
from collections import Counter

import mlx.core as mx
import numpy as np
import pytest
import scipy.stats as sps
from conftest import make_paced_engine, make_tiny_engine, make_tiny_model, paced, random_prompts
from stats_support import adaptive_continuations, continuation_law

import edgespec.adaptive.decoder as dec
from edgespec.adaptive.estimate import AcceptanceStats, Costs, merge_candidates, plan_tree
from edgespec.adaptive.history import HistoryStore
from edgespec.drafters.base import ModelDrafter
from edgespec.engine import make_options
from edgespec.logits.sampling import SamplingParams

SOURCES = ("context", "history", "jacobi", "drafter")
DRAW_TOKENS = dec.draw_tokens  # the real one, for the broken variant to wrap
COMBOS = ["+".join(c) for n in range(1, 5) for c in itertools.combinations(SOURCES, n)]


class TinyDrafter(ModelDrafter):
    name = "tiny"


@pytest.fixture(scope="module")
def engine_and_refs():
    # Paced: a verifier pass costs ~3 ms whatever its width, so copying pays as on an accelerator.
    engine = make_paced_engine(0, 0.003, scale=3.0)
    engine.drafter = TinyDrafter(paced(engine, make_tiny_model(5, scale=3.0, num_hidden_layers=1), 0.0003))
    prompts = random_prompts(20, seed=4)
    refs = [engine.generate(p, max_tokens=24, mode="plain").tokens for p in prompts]
    return engine, prompts, refs


# ---------------------------------------------------------------- lossless, greedy
@pytest.mark.parametrize("sources", COMBOS)
def test_greedy_equals_plain_on_20_prompts_for_every_source_combination(engine_and_refs, sources):
    engine, prompts, refs = engine_and_refs
    engine.history.clear()
    used = Counter()
    for p, ref in zip(prompts, refs, strict=True):
        # Each prompt twice: the second run can draft from the first one's history.
        for _ in range(2):
            r = engine.generate(p, max_tokens=24, mode="adaptive", sources=sources)
            assert r.tokens == ref, (sources, p)
            used.update(r.stats.accepted_by_source)
    # Only the named sources ever contribute, and the copy sources really do.
    assert set(used) <= set(sources.split("+")) | {"window"}, used
    for s in ("context", "history"):
        if s in sources:
            assert used[s] > 0, (s, used)


def test_auto_is_adaptive_and_equals_plain(engine_and_refs):
    engine, prompts, refs = engine_and_refs
    for p, ref in zip(prompts[:5], refs[:5], strict=True):
        r = engine.generate(p, max_tokens=24)
        assert r.stats.mode == "adaptive" and r.tokens == ref


def test_silent_sources_cost_one_plain_pass_per_token():
    """With every source silent, every token is one plain verifier pass and no tree is built."""
    engine = make_tiny_engine(2, scale=3.0)
    engine.history = HistoryStore()  # empty until this generation ends: the only source, and silent
    prompt = list(range(1, 40))
    r = engine.generate(prompt, max_tokens=20, mode="adaptive", sources="history")
    ref = engine.generate(prompt, max_tokens=20, mode="plain")
    assert r.tokens == ref.tokens
    # One pass per token read after the prefill (the EOS that ended it included), no tree.
    assert r.stats.drafted == 0 and r.stats.verifier_passes == len(r.tokens) - 1 + (r.finish_reason == "stop")


# ---------------------------------------------------------------- sampling
@pytest.mark.parametrize("sources", ["context+history+jacobi+drafter", "context"])
def test_seeded_sampling_equals_plain_token_for_token(engine_and_refs, sources):
    """Every token is plain's draw at its position (Gumbel noise keyed by seed and position)."""
    engine, prompts, _ = engine_and_refs
    for i, p in enumerate(prompts[:8]):
        kw = dict(max_tokens=24, temperature=0.9, top_p=0.95, seed=100 + i)
        ref = engine.generate(p, mode="plain", **kw).tokens
        r = engine.generate(p, mode="adaptive", sources=sources, **kw)
        assert r.tokens == ref


def greedy_below_root(logits, parents, position, sampler):
    """A plausible bug: the root draws by sampling, but candidates below it are checked greedily."""
    draws, lp = DRAW_TOKENS(logits, parents, position, sampler)
    if lp is None:
        return draws, lp
    greedy = mx.argmax(logits, axis=-1).astype(mx.int32)
    return mx.where(mx.arange(draws.shape[0]) == 0, draws, greedy), lp


def chi2_pvalue(counts: Counter, law: dict) -> float:
    keys = sorted(law)
    obs = np.array([counts.get(k, 0) for k in keys], dtype=np.float64)
    if sum(counts.values()) != obs.sum():
        return 0.0  # a sample outside the law's support
    exp = np.array([law[k] for k in keys])
    return sps.chisquare(obs, exp / exp.sum() * obs.sum()).pvalue


@pytest.mark.parametrize("broken", [False, True])
def test_sampling_follows_the_verifier_law(monkeypatch, broken):
    """Chi-square of 3-token continuations against the exact law enumerated from the model."""
    params = dict(temperature=1.0, top_k=3)
    engine = make_paced_engine(1, 0.002, scale=1.5, vocab_size=8)
    engine.history = None
    prompt = [1, 2, 3] * 4 + [1, 2]
    n = 3  # the first token comes from the prefill, the second from a tree's root: the third is a tree draw
    law = continuation_law(engine.model, prompt, SamplingParams(**params), n)
    if broken:
        monkeypatch.setattr(dec, "draw_tokens", greedy_below_root)
    opts = make_options(mode="adaptive", sources="context+jacobi", window=2, ngram=3, **params)
    runs = 600
    counts, accepted = adaptive_continuations(engine, prompt, opts, params, n, runs)
    assert accepted > runs // 10  # trees were verified, so the scheme was exercised
    p = chi2_pvalue(counts, law)
    # Seeds are fixed, so the p-values are reproducible (measured: 0.65 and 6e-9); the margins are wide.
    assert (p > 1e-3) if not broken else (p < 1e-5), p


# ---------------------------------------------------------------- pricing
def test_plan_follows_the_cost_curve():
    """Cheap wide passes buy deep trees; passes that cost per token buy nothing (a plain step)."""
    chain = merge_candidates([([5, 6, 7, 8, 9, 10], np.cumprod([0.9, 0.9, 0.8, 0.8, 0.7, 0.7]))])
    flat = Costs([1, 64], [1.0, 1.0 + 0.02 * 63])  # accelerator-like: 64 tokens ~ 2.3x one
    kept, rate = plan_tree(chain, flat)
    assert kept == list(range(6)) and rate > 2.0
    linear = Costs([1, 64], [1.0, 64.0])  # reference BLAS: T tokens cost T passes
    kept, rate = plan_tree(chain, linear)
    assert kept == [] and rate == pytest.approx(1.0)
    # Fixed costs (drafting, host work) shift the optimum: an unlikely tail is dropped.
    steep = Costs([1, 2, 4, 8], [1.0, 1.05, 1.6, 3.0])
    kept, _ = plan_tree(chain, steep, fixed_s=0.0)
    assert 1 <= len(kept) < 6 and kept == list(range(len(kept)))


def test_merge_shares_prefixes_and_keeps_siblings_disjoint():
    nodes = merge_candidates([
        ([1, 2, 3], np.array([0.8, 0.6, 0.5])),
        ([1, 2, 4], np.array([0.7, 0.65, 0.1])),
        ([9], np.array([0.6])),
    ])
    assert [n.token for n in nodes] == [1, 2, 3, 4, 9]
    # Token 1: max(0.8, 0.7), scaled with its sibling 9 to a total of 1; token 2: max(0.6, 0.65), capped there.
    assert nodes[0].prob == pytest.approx(0.8 / 1.4) and nodes[4].prob == pytest.approx(0.6 / 1.4)
    assert nodes[1].prob == pytest.approx(0.8 / 1.4)
    root = [n for n in nodes if n.parent < 0]
    assert sum(n.prob for n in root) == pytest.approx(1.0)
    for n in nodes:
        kids = [m for m in nodes if m.parent == nodes.index(n)]
        assert sum(m.prob for m in kids) <= n.prob + 1e-12


def test_running_acceptance_steers_the_choice_between_sources():
    """A source that keeps being right wins the tree; one that keeps failing is priced out."""
    acc = AcceptanceStats({"good": 0.3, "bad": 0.3})
    costs = Costs([1, 2, 4, 8, 16], [1.0, 1.1, 1.2, 1.4, 1.8])
    for _ in range(40):
        acc.record("good", 0, 6, 6)
        acc.record("bad", 0, 0, 6)
    good = ([1, 2, 3, 4, 5, 6], acc.path_probs("good", 0, 6))
    bad = ([7, 8, 9, 10, 11, 12], acc.path_probs("bad", 0, 6))
    nodes = merge_candidates([good, bad])
    kept, rate = plan_tree(nodes, costs)
    assert [nodes[i].token for i in kept] == [1, 2, 3, 4, 5, 6] and rate > 2.5
    assert acc.rates("bad", 0, 1)[0] < 0.05 < 0.95 < acc.rates("good", 0, 1)[0]
    # Unknown depths (a candidate matched all that was committed) are not counted as failures.
    acc.record("fresh", 0, 3, 3)
    assert acc.rates("fresh", 0, 4)[3] == pytest.approx(acc.prior("fresh", 0))


# ---------------------------------------------------------------- options
def test_options_are_typed_and_checked_before_any_model():
    o = make_options(mode="lookahead", adaptive="0", window="3")
    assert o.mode_options == {"adaptive": False, "window": 3}  # "0" is False, not bool("0")
    for kw, msg in [
        (dict(mode="lookahead", sources="x"), "unknown option.*'sources'.*lookahead"),
        (dict(mode="adaptive", window=99), "adaptive option 'window' must be an integer in 1..16"),
        (dict(mode="adaptive", sources="context+nope"), "adaptive option 'sources'"),
        (dict(mode="tree", budget=1), "tree option 'budget'"),
        (dict(mode="nosuch"), "unknown decoding mode 'nosuch'"),
        (dict(mode="cascade", adaptive="maybe"), "cascade option 'adaptive' must be 0/1"),
    ]:
        with pytest.raises(ValueError, match=msg):
            make_options(**kw)


def test_cli_rejects_a_bad_mode_before_loading_the_model(tmp_path, capsys):
    from edgespec.cli import main

    missing = str(tmp_path / "no-such-model")
    for argv, msg in [
        (["generate", "--model", missing, "--prompt", "hi", "--mode", "typo"], "unknown decoding mode 'typo'"),
        (["generate", "--model", missing, "--prompt", "hi", "--mode", "lookahead", "--mode-option", "windw=3"],
         "unknown option(s) 'windw' for mode 'lookahead'"),
        (["bench", "--model", missing, "--modes", "plain,adaptive:span=99"], "adaptive option 'span'"),
    ]:
        assert main(argv) == 1
        err = capsys.readouterr().err
        assert msg in err and "no-such-model" not in err, err


# ---------------------------------------------------------------- history through the engine
def test_history_makes_repeated_traffic_cheaper_and_never_changes_output():
    engine = make_paced_engine(3, 0.005, scale=3.0)
    assert isinstance(engine.history, HistoryStore)  # on by default, in memory
    prompt = [5, 9, 14, 2, 33, 7, 21]
    first = engine.generate(prompt, max_tokens=30, mode="adaptive", sources="history")
    second = engine.generate(prompt, max_tokens=30, mode="adaptive", sources="history")
    assert first.tokens == second.tokens == engine.generate(prompt, max_tokens=30, mode="plain").tokens
    assert second.stats.accepted_by_source.get("history", 0) > 20
    assert second.stats.verifier_passes < first.stats.verifier_passes


def test_history_setting_off_keeps_nothing(monkeypatch):
    from edgespec.engine import Engine

    engine = make_tiny_engine(3, scale=3.0)
    assert Engine(engine.loaded, history="off").history is None
    monkeypatch.setenv("EDGESPEC_HISTORY", "off")
    assert Engine(engine.loaded).history is None
    monkeypatch.setenv("EDGESPEC_HISTORY", "everywhere")
    with pytest.raises(ValueError, match="history must be one of memory, disk, off"):
        Engine(engine.loaded)
