"""The cascade is lossless under sampling: chi-square of 3-token continuations against the exact law.

Tiny verifier over 8 tokens (top-k 3: 27 cells); mid level = its first layer
(self-speculation), tiny level = another random model. The tiny drafts are checked
by the mid level, whose tokens the verifier checks: both rejection steps run. A
cascade whose inner level skips its check (tiny drafts passed up as if the mid
model had drawn them) must fail the same test.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import make_tiny_model
from stats_support import chisq_pvalue, continuation_counts, continuation_law

import edgespec.tree.cascade as cascade_mod
from edgespec.drafters.mlx_drafter import MLXDrafter
from edgespec.drafters.self_spec import SelfSpecDrafter
from edgespec.logits.sampling import SamplingParams
from edgespec.modes.speculative import SpeculativeMode
from edgespec.options import GenerateOptions
from edgespec.tree import CascadeDrafter

PARAMS = dict(temperature=1.0, top_k=3)
PROMPT = [1, 2, 3, 4, 1, 2, 3, 5, 1, 2]
RUNS = 600


def unchecked(draft_tokens, draft_logprobs, target_logprobs, key):
    """Wrong on purpose: the mid level 'accepts' every tiny draft and adds its own argmax."""
    n = len(draft_tokens)
    return n, int(np.argmax(np.array(target_logprobs[n])))


@pytest.mark.parametrize("inner,ok", [(cascade_mod.rejection_sample, True), (unchecked, False)])
def test_cascade_sampling_matches_plain_law(monkeypatch, inner, ok):
    verifier = make_tiny_model(1, scale=1.5, vocab_size=8)
    tiny_model = make_tiny_model(5, scale=1.5, vocab_size=8, num_hidden_layers=1)
    law = continuation_law(verifier, PROMPT, SamplingParams(**PARAMS), 3)
    keys = sorted(law)
    monkeypatch.setattr(cascade_mod, "rejection_sample", inner)
    cascade = CascadeDrafter(SelfSpecDrafter(verifier, [0]), MLXDrafter(tiny_model), inner_k=2, adaptive=False)
    mode = SpeculativeMode(verifier, cascade, GenerateOptions(draft_tokens=3), stats_name="cascade")
    counts, accepted = continuation_counts(mode, PROMPT, PARAMS, keys, RUNS, 3)
    # Both levels were exercised: the verifier accepted drafts, the mid level accepted and rejected tiny ones.
    assert accepted > RUNS // 2
    assert 0 < cascade.inner_accepted < cascade.inner_drafted or not ok
    pv = chisq_pvalue(counts, np.array([law[k] for k in keys]))
    # Seeds are fixed, so the p-values are reproducible.
    assert (pv > 1e-3) if ok else (pv < 1e-3), pv
