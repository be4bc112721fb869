"""Samplers on a toy vocabulary: exact filtered probabilities, and draws that follow them."""

import math

import mlx.core as mx
import numpy as np
import pytest
from scipy import stats as sps

from edgespec.logits.sampling import Sampler, SamplingParams, logprobs_from_logits

LOGITS = np.array([2.0, 1.0, 0.5, 0.0, -1.0, -3.0], dtype=np.float32)


def softmax(x):
    e = np.exp(x.astype(np.float64) - x.max())
    return e / e.sum()


def expected(params: SamplingParams) -> np.ndarray:
    """Hand-computed reference of temperature, then top-k, top-p, min-p."""
    p = softmax(LOGITS / params.temperature)
    keep = np.ones_like(p, dtype=bool)
    if params.top_k:
        keep &= p >= np.sort(p)[-params.top_k]
    p = np.where(keep, p, 0)
    p = p / p.sum()
    if params.top_p < 1:
        order = np.argsort(-p)
        before = np.cumsum(p[order]) - p[order]
        k = np.zeros_like(keep)
        k[order] = before < params.top_p
        p = np.where(k, p, 0)
        p = p / p.sum()
    if params.min_p:
        p = np.where(p >= params.min_p * p.max(), p, 0)
        p = p / p.sum()
    return p.astype(np.float64)


CASES = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.5),
    SamplingParams(temperature=2.0),
    SamplingParams(temperature=1.0, top_k=3),
    SamplingParams(temperature=1.0, top_p=0.8),
    SamplingParams(temperature=0.7, top_p=0.5),
    SamplingParams(temperature=1.0, min_p=0.2),
    SamplingParams(temperature=1.3, top_k=4, top_p=0.9, min_p=0.05),
]


@pytest.mark.parametrize("params", CASES, ids=str)
def test_filtered_probabilities_are_exact(params):
    got = np.exp(np.array(logprobs_from_logits(mx.array(LOGITS), params)))
    np.testing.assert_allclose(got, expected(params), atol=1e-6)


def test_top_p_keeps_smallest_set_reaching_mass():
    p = softmax(LOGITS)
    params = SamplingParams(temperature=1.0, top_p=float(p[0] + 1e-3))
    got = np.exp(np.array(logprobs_from_logits(mx.array(LOGITS), params)))
    assert np.count_nonzero(got) == 2  # top-1 alone is just short of the mass


def test_greedy_is_one_hot_at_argmax():
    lp = np.array(logprobs_from_logits(mx.array(LOGITS[::-1].copy()), SamplingParams()))
    assert lp[len(LOGITS) - 1] == 0.0
    assert np.isneginf(np.delete(lp, len(LOGITS) - 1)).all()


@pytest.mark.parametrize("params", [CASES[0], CASES[4], CASES[7]], ids=str)
def test_draws_follow_the_distribution(params):
    n = 20000
    sampler = Sampler(SamplingParams(**{**params.__dict__, "seed": 7}))
    lp = sampler.logprobs(mx.broadcast_to(mx.array(LOGITS), (n, len(LOGITS))))
    draws = np.array(sampler.sample(lp))
    p = expected(params)
    counts = np.bincount(draws, minlength=len(p))
    assert counts[p == 0].sum() == 0  # filtered tokens never drawn
    nz = p > 0
    _, pval = sps.chisquare(counts[nz], p[nz] / p[nz].sum() * counts.sum())
    assert pval > 1e-3, (counts, p * n)


def test_wrong_distribution_is_detected_by_the_same_check():
    """The chi-square check above can fail: draws at temperature 1 against temperature-0.5 odds."""
    n = 20000
    sampler = Sampler(SamplingParams(temperature=1.0, seed=3))
    draws = np.array(sampler.sample(sampler.logprobs(mx.broadcast_to(mx.array(LOGITS), (n, 6)))))
    p = expected(SamplingParams(temperature=0.5))
    _, pval = sps.chisquare(np.bincount(draws, minlength=6), p * n)
    assert pval < 1e-6


def test_seed_makes_sampling_reproducible():
    a = Sampler(SamplingParams(temperature=1.0, seed=11))
    b = Sampler(SamplingParams(temperature=1.0, seed=11))
    lp = a.logprobs(mx.array(LOGITS))
    assert [int(a.sample(lp)) for _ in range(20)] == [int(b.sample(lp)) for _ in range(20)]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"temperature": -1}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 1.5}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"min_p": 1.0}, "min_p"),
        ({"seed": "x"}, "seed"),
        ({"seed": -1}, "seed"),
    ],
)
def test_nonsense_settings_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_vanishing_temperature_is_greedy():
    lp = np.array(logprobs_from_logits(mx.array(LOGITS), SamplingParams(temperature=1e-300)))
    assert lp[0] == 0.0 and np.isneginf(lp[1:]).all()
