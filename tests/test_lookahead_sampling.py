"""Lookahead sampling is lossless: its output law equals plain sampling's, checked by chi-square.

The exact law of a short continuation is enumerated from the model; a deliberately
wrong multi-candidate scheme (accept each candidate with p(x), no residual) must fail
the same check, so the test has teeth.
"""

from __future__ import annotations

import itertools
from collections import Counter

import mlx.core as mx
import numpy as np
import pytest
import scipy.stats as sps
from conftest import make_tiny_model
from stats_support import continuation_law

import edgespec.lookahead.verify as verify_mod  # verify_step walks with its sample_walk
from edgespec.generate import GenerationStats
from edgespec.logits.sampling import Sampler, SamplingParams, logprobs_from_logits
from edgespec.lookahead import StepTree, sample_walk
from edgespec.modes.lookahead import LookaheadMode

PARAMS = dict(temperature=1.0, top_k=3)


def wrong_walk(tree, logits, sampler):
    """A plausible but biased scheme: accept child x with p(x) each time, else draw from p again."""
    node, path, lps = 0, [], []
    while True:
        lp = np.array(sampler.logprobs(logits[node]), dtype=np.float64)
        p = np.exp(lp)
        for tok, child in tree.children[node].items():
            if float(sampler.uniform().item()) < p[tok]:
                path.append(child)
                lps.append(float(lp[tok]))
                node = child
                break
        else:
            tok = int(
                np.searchsorted(
                    np.cumsum(p), float(sampler.uniform().item()) * p.sum(), side="right"
                )
            )
            lps.append(float(lp[tok]))
            return path, tok, lps


def chi2_pvalue(counts: Counter, law: dict) -> float:
    keys = sorted(law)
    obs = np.array([counts.get(k, 0) for k in keys], dtype=np.float64)
    if sum(counts.values()) != obs.sum():
        return 0.0  # a sample outside the law's support: certainly not this law
    exp = np.array([law[k] for k in keys])
    exp = exp / exp.sum() * obs.sum()
    return sps.chisquare(obs, exp).pvalue


# ---------------------------------------------------------------- the walk itself
def synthetic_case():
    """A tree with duplicate and impossible children, and fixed logits per node (V = 5)."""
    tree = StepTree.rooted(0)
    tree.add_path([1, 2])
    tree.add_path([3, 1])
    tree.add_path([4])  # token 4 is outside top_k=3 at the root: never accepted
    tree.add_node(1, 0)  # a duplicate child token (window-style): adds nothing
    rng = np.random.default_rng(0)
    logits = mx.array(rng.normal(size=(len(tree), 5)).astype(np.float32) * 1.5)
    logits[0, 4] = -5.0
    return tree, logits


def walk_law(tree, logits, params):
    """Exact law of (first token, second token or None if the walk stopped)."""
    lp = [
        np.exp(np.array(logprobs_from_logits(logits[n], params), dtype=np.float64))
        for n in range(len(tree))
    ]
    law = {}
    for x, px in enumerate(lp[0]):
        if px == 0:
            continue
        child = tree.children[0].get(x)
        if child is None:
            law[(x, None)] = px
        else:
            for y, py in enumerate(lp[child]):
                if py > 0:
                    law[(x, y)] = px * py
    return law


@pytest.mark.parametrize("walk,ok", [(sample_walk, True), (wrong_walk, False)])
def test_recursive_rejection_walk_has_the_target_law(walk, ok):
    tree, logits = synthetic_case()
    params = SamplingParams(**PARAMS, seed=1)
    sampler = Sampler(params)
    law = walk_law(tree, logits, params)
    counts = Counter()
    for _ in range(3000):
        path, nxt, _ = walk(tree, logits, sampler)
        toks = [tree.tokens[n] for n in path] + [nxt]
        counts[(toks[0], toks[1] if len(path) >= 1 else None)] += 1
    p = chi2_pvalue(counts, law)
    assert (p > 1e-3) if ok else (p < 1e-6), p


# ---------------------------------------------------------------- end to end, tiny model
@pytest.mark.parametrize("wrong", [False, True])
def test_lookahead_sampling_matches_plain_law(monkeypatch, wrong):
    model = make_tiny_model(1, scale=1.5, vocab_size=8)
    prompt = [1, 2, 3, 4, 1, 2, 3, 5, 1, 2]
    n = 2
    law = continuation_law(model, prompt, SamplingParams(**PARAMS), n)
    if wrong:
        monkeypatch.setattr(verify_mod, "sample_walk", wrong_walk)
    counts, accepted = Counter(), 0
    runs = 600
    for seed in range(runs):
        mode = LookaheadMode(model, window=3, ngram=3, guesses=4, adaptive=False)
        stats = GenerationStats()
        it = mode.steps(prompt, Sampler(SamplingParams(**PARAMS, seed=seed)), stats)
        counts[tuple(t.id for t in itertools.islice(it, n))] += 1
        it.close()
        accepted += stats.accepted
    assert accepted > runs // 5  # candidates were really accepted, so the scheme was exercised
    p = chi2_pvalue(counts, law)
    # Seeds are fixed, so these p-values are reproducible; the margins are wide.
    assert (p > 1e-3) if not wrong else (p < 1e-2), p
