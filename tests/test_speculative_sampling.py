"""Speculative sampling is exact: chi-square of 3-token continuations against enumeration.

Tiny verifier and an unrelated tiny drafter over an 8-token vocabulary; K=2, so
the first round drafts tokens 2-3 of the reply and the test covers acceptance,
residual resampling and the bonus token. The exact distribution of the first
three tokens is enumerated from the verifier (8^3 = 512 cells) under the same
temperature / top-p transform. A deliberately wrong rule (resample from p
instead of the residual) must be rejected by the same test: it can fail.
"""

from __future__ import annotations

import itertools

import mlx.core as mx
import numpy as np
import pytest
from conftest import make_tiny_model
from stats_support import chisq_pvalue

import edgespec.modes.speculative as spec_mod
from edgespec.drafters.mlx_drafter import MLXDrafter
from edgespec.generate import GenerationStats
from edgespec.logits.rejection import rejection_sample
from edgespec.logits.sampling import Sampler, SamplingParams, logprobs_from_logits
from edgespec.modes.speculative import SpeculativeMode
from edgespec.options import GenerateOptions

V = 8
PROMPT = [1, 5, 2]
N = 800


def exact_distribution(model, params) -> np.ndarray:
    """(V, V, V) probabilities of the first three generated tokens."""
    probs = np.zeros((V, V, V))
    base = np.exp(np.array(logprobs_from_logits(model(mx.array([PROMPT]))[0, -1], params)))
    for a in range(V):
        if base[a] == 0:
            continue
        p2 = np.exp(np.array(logprobs_from_logits(model(mx.array([PROMPT + [a]]))[0, -1], params)))
        # All V continuations b in one batch: rows PROMPT + [a, b].
        rows = mx.array([PROMPT + [a, b] for b in range(V)])
        p3 = np.exp(np.array(logprobs_from_logits(model(rows)[:, -1], params)))
        probs[a] = base[a] * p2[:, None] * p3
    return probs.reshape(-1)


def sample_counts(verifier, drafter, params, pipeline=False) -> np.ndarray:
    mode = SpeculativeMode(verifier, drafter, GenerateOptions(draft_tokens=2, mode_options={"pipeline": pipeline}))
    counts = np.zeros(V**3)
    for i in range(N):
        sp = SamplingParams(params.temperature, params.top_k, params.top_p, params.min_p, seed=1000 + i)
        steps = mode.steps(PROMPT, Sampler(sp), GenerationStats())
        a, b, c = (t.id for t in itertools.islice(steps, 3))
        steps.close()
        counts[(a * V + b) * V + c] += 1
    return counts


@pytest.fixture(scope="module")
def pair():
    verifier = make_tiny_model(0, scale=2.0, vocab_size=V, tie_word_embeddings=False)
    drafter = MLXDrafter(make_tiny_model(7, scale=2.0, vocab_size=V, tie_word_embeddings=False))
    return verifier, drafter


def _wrong_rule(draft, q, p, key):
    """Wrong on purpose: at a rejection, resample from p instead of normalize(max(0, p - q))."""
    n, nxt = rejection_sample(draft, q, p, key)
    if n < len(draft):
        u = float(np.array(mx.random.uniform(key=mx.random.split(key)[0])))
        cdf = np.cumsum(np.exp(np.array(p[n], dtype=np.float64)))
        nxt = int(min(np.searchsorted(cdf, u * cdf[-1], side="right"), V - 1))
    return n, nxt


@pytest.mark.parametrize(
    "params,pipeline",
    [
        (SamplingParams(temperature=1.0), False),
        (SamplingParams(temperature=0.7, top_p=0.8), True),
        (SamplingParams(temperature=1.5, top_k=5), False),
    ],
)
def test_speculative_sampling_matches_exact_distribution(pair, params, pipeline):
    verifier, drafter = pair
    pv = chisq_pvalue(sample_counts(verifier, drafter, params, pipeline), exact_distribution(verifier, params))
    assert pv > 1e-3, f"speculative samples differ from the verifier's distribution (p-value {pv:.2g})"


def test_wrong_rule_is_detected(pair, monkeypatch):
    verifier, drafter = pair
    params = SamplingParams(temperature=1.0)
    monkeypatch.setattr(spec_mod, "rejection_sample", _wrong_rule)
    pv = chisq_pvalue(sample_counts(verifier, drafter, params), exact_distribution(verifier, params))
    assert pv < 1e-3, f"the chi-square test did not catch a wrong acceptance rule (p-value {pv:.2g})"
