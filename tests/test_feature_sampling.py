"""Speculative sampling with a feature drafter is exact: chi-square of 3-token continuations.

Same set-up as test_speculative_sampling (8-token vocabulary, K=2, 512 enumerated
cells) with an untrained feature drafter whose q covers only ids 0..5: ids 6 and 7
reach the output only through the residual. A wrong acceptance rule must fail it.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from conftest import make_tiny_model
from edgespec.converters.distill.feature_pipeline import feature_config
from edgespec.models.feature_drafter import FeatureDraftModel
from edgespec.models.llama import ModelArgs
from stats_support import chisq_pvalue
from test_speculative_sampling import V, _wrong_rule, exact_distribution, sample_counts

import edgespec.modes.speculative as spec_mod
from edgespec.drafters.distilled import VocabMap
from edgespec.drafters.feature import FeatureDrafter
from edgespec.logits.sampling import SamplingParams


@pytest.fixture(scope="module")
def pair():
    verifier = make_tiny_model(0, scale=2.0, vocab_size=V, tie_word_embeddings=False)
    mx.random.seed(3)
    model = FeatureDraftModel(ModelArgs.from_dict(feature_config(verifier.args, 1)))
    mx.eval(model.parameters())
    return verifier, FeatureDrafter(model, verifier, VocabMap(np.array([-1, 0, 1, 2, 3, 4, 5]), V))


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_p=0.8)])
def test_feature_drafter_sampling_matches_exact_distribution(pair, params):
    verifier, drafter = pair
    counts = sample_counts(verifier, drafter, params)
    pv = chisq_pvalue(counts, exact_distribution(verifier, params))
    assert pv > 1e-3, f"samples differ from the verifier's distribution (p-value {pv:.2g})"


def test_wrong_rule_is_detected_with_a_feature_drafter(pair, monkeypatch):
    verifier, drafter = pair
    params = SamplingParams(temperature=1.0)
    monkeypatch.setattr(spec_mod, "rejection_sample", _wrong_rule)
    pv = chisq_pvalue(sample_counts(verifier, drafter, params), exact_distribution(verifier, params))
    assert pv < 1e-3, f"the chi-square test did not catch a wrong acceptance rule (p-value {pv:.2g})"
