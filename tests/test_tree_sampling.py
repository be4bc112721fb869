"""Tree sampling is lossless: chi-square of 3-token continuations against the enumerated law.

A tiny verifier over 8 tokens (top-k 3, so 27 cells), its first layer as the
drafter, a static 2x2 tree plus prompt-lookup candidates: the 2nd and 3rd
tokens mostly come from one tree pass, through accepted nodes, rejections and
residual draws. A wrong walk that draws the fallback token from p instead of
the residual (rejected candidates not removed) must fail the same test.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import make_tiny_model
from stats_support import chisq_pvalue, continuation_counts, continuation_law

import edgespec.lookahead.verify as verify_mod  # verify_step walks with its sample_walk
from edgespec.drafters.self_spec import SelfSpecDrafter
from edgespec.logits.sampling import SamplingParams
from edgespec.lookahead import sample_walk
from edgespec.modes.tree import TreeMode
from edgespec.tree import TreePlan

PARAMS = dict(temperature=1.0, top_k=3)
PROMPT = [1, 2, 3, 4, 1, 2, 3, 5, 1, 2]
RUNS = 600


def residual_forgetting_walk(tree, logits, sampler):
    """Wrong on purpose: recursive rejection, but the fallback draw is from p, not the residual."""
    node, path, lps = 0, [], []
    while True:
        lp = np.array(sampler.logprobs(logits[node]), dtype=np.float64)
        p = np.exp(lp)
        r, total = p.copy(), p.sum()
        u = np.array(sampler.uniform((len(tree.children[node]) + 1,)), dtype=np.float64)
        for i, (tok, child) in enumerate(tree.children[node].items()):
            if u[i] * total < r[tok]:
                path.append(child)
                lps.append(float(lp[tok]))
                node = child
                break
            total -= r[tok]
            r[tok] = 0.0
        else:
            tok = int(np.searchsorted(np.cumsum(p), u[-1] * p.sum(), side="right"))
            lps.append(float(lp[tok]))
            return path, tok, lps


@pytest.mark.parametrize("walk,ok", [(sample_walk, True), (residual_forgetting_walk, False)])
def test_tree_sampling_matches_plain_law(monkeypatch, walk, ok):
    model = make_tiny_model(1, scale=1.5, vocab_size=8)
    law = continuation_law(model, PROMPT, SamplingParams(**PARAMS), 3)
    keys = sorted(law)
    monkeypatch.setattr(verify_mod, "sample_walk", walk)
    mode = TreeMode(
        model,
        SelfSpecDrafter(model, [0]),
        plan=TreePlan(shape="static", branching=(2, 2)),
        sources=("drafter", "prompt_lookup"),
        adaptive=False,
    )
    counts, accepted = continuation_counts(mode, PROMPT, PARAMS, keys, RUNS, 3)
    assert accepted > RUNS // 2  # candidates were really accepted: the scheme was exercised
    pv = chisq_pvalue(counts, np.array([law[k] for k in keys]))
    # Seeds are fixed, so the p-values are reproducible; the margins are wide.
    assert (pv > 1e-3) if ok else (pv < 1e-3), pv
