"""Lookahead decoding: structure of a step, greedy equality with plain decoding, options."""

from __future__ import annotations

import itertools

import mlx.core as mx
import numpy as np
import pytest
from conftest import make_tiny_engine, make_tiny_model, random_prompts

from edgespec.generate import GenerationStats, PlainMode
from edgespec.kernels import tree_mask
from edgespec.logits.sampling import Sampler, SamplingParams
from edgespec.lookahead import NgramPool, StepController, StepTree
from edgespec.modes.lookahead import LookaheadMode, parse_options


def run(mode, prompt, n, params=None):
    stats = GenerationStats()
    it = mode.steps(prompt, Sampler(params or SamplingParams()), stats)
    out = [t.id for t in itertools.islice(it, n)]
    it.close()
    return out, stats


def prompts(count: int, seed: int = 0) -> list[list[int]]:
    return random_prompts(count, seed, max_len=25)


@pytest.fixture(scope="module")
def peaky():
    return make_tiny_model(0, scale=2.0)


@pytest.fixture(scope="module")
def plain_refs(peaky):
    """Plain greedy continuations (24 tokens) of the 20 test prompts."""
    return [run(PlainMode(peaky), p, 24)[0] for p in prompts(20)]


@pytest.mark.parametrize("W,N,G", [(4, 4, 4), (1, 2, 1), (6, 3, 8), (3, 5, 0), (0, 2, 5)])
def test_greedy_equals_plain_on_20_prompts(peaky, plain_refs, W, N, G):
    passes = 0
    for prompt, ref in zip(prompts(20), plain_refs, strict=False):
        got, stats = run(LookaheadMode(peaky, W, N, G, adaptive=False), prompt, 24)
        assert got == ref, (prompt, W, N, G)
        passes += stats.verifier_passes
    assert passes < 20 * 23 * 0.9  # guesses were accepted: fewer passes than plain's 23 each


def test_greedy_equals_plain_with_adaptive_fallback():
    model = make_tiny_model(3)  # flat distributions: guesses rarely hit, the controller goes lean
    for prompt in prompts(4, seed=3):
        assert (
            run(LookaheadMode(model, adaptive=True), prompt, 30)[0]
            == run(PlainMode(model), prompt, 30)[0]
        )


def test_window_tree_has_the_lookahead_mask():
    """Node (j, i) sees x0, level 0 columns 0..i and levels 1..j of column i, at position p+1+i+j."""
    W, L, p = 3, 3, 5
    tree = StepTree.rooted(7)
    tree.add_path([1, 2])
    tree.add_path([1, 3])  # shares the first node with [1, 2]
    tree.add_window([[10 + 10 * j + i for i in range(W)] for j in range(L)])
    assert tree.tokens[:4] == [7, 1, 2, 3] and tree.parents[:4] == [-1, 0, 1, 1]
    mask, pos = tree_mask(mx.array(tree.parents, dtype=mx.int32), p)
    mask, pos = np.array(mask), np.array(pos)
    assert mask[:, :p].all()
    for j in range(L):
        for i in range(W):
            n = tree.window[j][i]
            seen = (
                {0}
                | {tree.window[0][c] for c in range(i + 1)}
                | {tree.window[r][i] for r in range(1, j + 1)}
            )
            assert set(np.nonzero(mask[n, p:])[0]) == seen
            assert pos[n] == p + 1 + i + j
    with pytest.raises(RuntimeError):
        tree.add_path([5])


def test_a_chain_is_verified_as_a_causal_pass_with_the_tree_paths_logits(peaky):
    """tree_forward sends a chain (each node the previous one's child) through the causal pass
    (no tree mask, no per-node positions) and a tree with a branch through the tree mask; the
    chain's logits equal what the tree mask gives for the same nodes."""
    from edgespec.generate import prefill
    from edgespec.lookahead.verify import tree_forward

    calls = []

    class Spy:
        def __init__(self, model):
            self.model = model

        def __call__(self, inputs, cache, mask=None, positions=None):
            calls.append((mask is None, positions is None))
            return self.model(inputs, cache, mask=mask, positions=positions)

    prompt = prompts(1, seed=4)[0]
    chain = StepTree.rooted(5)
    chain.add_path([9, 2, 11, 3])
    branched = StepTree.rooted(5)
    branched.add_path([9, 2, 11, 3])
    branched.add_path([9, 7])
    assert chain.is_chain() and not branched.is_chain() and StepTree.rooted(5).is_chain()
    out = {}
    for name, tree in (("chain", chain), ("branched", branched)):
        cache = peaky.make_cache()
        prefill(peaky, cache, prompt)
        out[name] = np.array(tree_forward(Spy(peaky), cache, tree))
        assert cache[0].offset == len(prompt) + len(tree)
    assert calls == [(True, True), (False, False)]
    np.testing.assert_allclose(out["chain"], out["branched"][:5], rtol=1e-5, atol=1e-5)
    # the tree mask's way for the chain itself, for comparison: the same logits
    cache = peaky.make_cache()
    prefill(peaky, cache, prompt)
    mask, pos = tree_mask(mx.array(chain.parents, dtype=mx.int32), cache[0].offset)
    masked = np.array(peaky(mx.array([chain.tokens]), cache, mask=mask, positions=pos)[0])
    np.testing.assert_allclose(out["chain"], masked, rtol=1e-5, atol=1e-5)


def test_pool_ranks_longer_context_matches_first():
    pool = NgramPool(span=2, jacobi_len=2)
    seq = [
        1,
        2,
        9,
        8,
        5,
        2,
        7,
        7,
        3,
        1,
        2,
    ]  # last token 2: earlier 2s at 1 (after 1) and 5 (after 5)
    pool.add_text(seq)
    assert pool.text_candidates(seq, 5) == [[9, 8], [7, 7]]  # context "1 2" matches at position 1
    pool.add_jacobi(2, [4, 4])
    pool.add_jacobi(2, [6, 6])
    assert pool.jacobi_candidates(2, 5) == [[6, 6], [4, 4]]
    assert pool.candidates(seq, 2) == [[9, 8], [6, 6]]


def test_controller_falls_back_and_probes():
    ctl = StepController(probe_every=3, warmup=1)
    assert ctl.choose() == "full"
    ctl.record("full", 1, 1.0)
    assert ctl.choose() == "lean"  # every kind is measured once
    ctl.record("lean", 3, 1.0)
    assert ctl.choose() == "plain"
    ctl.record("plain", 2, 1.0)
    kinds = []
    for _ in range(12):
        k = ctl.choose()
        kinds.append(k)
        ctl.record(k, {"full": 1, "lean": 3, "plain": 2}[k], 1.0)
    assert kinds.count("lean") >= 6 and "full" in kinds and "plain" in kinds and ctl.fell_back
    assert StepController(adaptive=False).choose() == "full"
    # A kind that keeps losing its probes is probed ever more rarely.
    slow = StepController(probe_every=2, warmup=1, probe_max=16)
    full_steps = []
    for step in range(80):
        k = slow.choose()
        if k == "full":
            full_steps.append(step)
        slow.record(k, {"full": 1, "lean": 2, "plain": 3}[k], 1.0)
    gaps = [b - a for a, b in zip(full_steps, full_steps[1:], strict=False)]
    assert gaps[-1] > gaps[0] and max(gaps) <= 16 + 2
    no_window = StepController(kinds=("lean", "plain"))
    assert no_window.choose() == "lean"
    no_window.record("lean", 1, 1.0)
    assert no_window.choose() == "plain"


def test_engine_mode_and_options():
    eng = make_tiny_engine(0)
    prompt = [5, 6, 7, 8] * 4
    ref = eng.generate(prompt, max_tokens=20, mode="plain")
    res = eng.generate(prompt, max_tokens=20, mode="lookahead", window=2, ngram=3, guesses=2)
    assert res.tokens == ref.tokens and res.stats.mode == "lookahead"
    assert res.stats.verifier_passes < ref.stats.verifier_passes
    assert parse_options({"window": "5"})["window"] == 5
    for bad in ({"window": -1}, {"ngram": 1}, {"guesses": -1}, {"span": "x"}, {"window": True}):
        with pytest.raises(ValueError, match="lookahead option"):
            parse_options(bad)


def test_cli_mode_options_reach_the_mode():
    import argparse

    from edgespec.apps.common import add_decoding_arguments, options_from_args

    p = argparse.ArgumentParser()
    add_decoding_arguments(p)
    opts = options_from_args(
        p.parse_args(
            ["--mode", "lookahead", "--mode-option", "window=3", "--mode-option", "adaptive=0"]
        )
    )
    assert parse_options(opts.mode_options) == {**parse_options({}), "window": 3, "adaptive": False}
    for bad in (["--mode-option", "window"], ["--mode-option", "top_k=2"]):
        with pytest.raises(ValueError, match="--mode-option"):
            options_from_args(p.parse_args(bad))
