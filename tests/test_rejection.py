"""The accept/resample rule: greedy limit, point-mass drafts, and exactness by a chi-square test."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from stats_support import chisq_pvalue

from edgespec.logits.rejection import rejection_sample, residual_logprobs

V = 10


def onehot(ids):
    return mx.where(mx.arange(V)[None, :] == mx.array(ids)[:, None], 0.0, float("-inf"))


@pytest.mark.parametrize("seed", range(5))
def test_greedy_is_argmax_matching(seed):
    rng = np.random.default_rng(seed)
    k = 6
    p_top = rng.integers(0, V, k + 1)
    drafts = p_top[:k].copy()
    cut = int(rng.integers(0, k + 1))  # first position where the draft disagrees
    if cut < k:
        drafts[cut] = (p_top[cut] + 1) % V
    n, nxt = rejection_sample(drafts.tolist(), onehot(drafts.tolist()), onehot(p_top.tolist()), mx.random.key(seed))
    assert n == cut
    assert nxt == int(p_top[cut])  # correction = verifier argmax; bonus when all matched


def test_point_mass_drafts_need_no_q():
    p = onehot([3, 4, 5])
    assert rejection_sample([3, 4], None, p, mx.random.key(0)) == (2, 5)
    assert rejection_sample([3, 9], None, p, mx.random.key(0)) == (1, 4)


def test_shape_errors_are_clear():
    with pytest.raises(ValueError, match="k\\+1"):
        rejection_sample([1, 2], None, onehot([1, 2]), mx.random.key(0))


def test_residual_is_normalised_positive_part():
    p = mx.log(mx.array([[0.5, 0.3, 0.2]]))
    q = mx.log(mx.array([[0.2, 0.5, 0.3]]))
    r = np.exp(np.array(residual_logprobs(p, q)))[0]
    np.testing.assert_allclose(r, [1.0, 0.0, 0.0], atol=1e-6)


def _wrong_rule(draft, q, p, key):
    """Deliberately wrong: on rejection resample from p instead of the residual max(0, p - q)."""
    x = int(draft[0])
    k_u, k_s = mx.random.split(key)
    u = float(mx.random.uniform(key=k_u).item())
    if np.log(u) < float(p[0, x].item()) - float(q[0, x].item()):
        return 1, None
    return 0, int(mx.random.categorical(p[0], key=k_s).item())


@pytest.mark.parametrize("rule,should_pass", [(rejection_sample, True), (_wrong_rule, False)])
def test_first_token_follows_p_exactly(rule, should_pass):
    """Draft x ~ q, accept w.p. min(1, p(x)/q(x)), else resample from norm(max(0, p-q)):
    P(emit y) = q(y) min(1, p(y)/q(y)) + (1 - sum min(p, q)) * max(0, p(y)-q(y)) / (1 - sum min(p, q)) = p(y).
    """
    rng = np.random.default_rng(1)
    p = rng.dirichlet(np.ones(V) * 0.7, size=2)  # rows: position 0, bonus
    q = rng.dirichlet(np.ones(V) * 0.7, size=1)
    lp, lq = mx.log(mx.array(p, dtype=mx.float32)), mx.log(mx.array(q, dtype=mx.float32))
    counts = np.zeros(V)
    N = 2000
    keys = mx.random.split(mx.random.key(7), 2 * N)
    for i in range(N):
        x = int(mx.random.categorical(lq[0], key=keys[2 * i]).item())
        n, nxt = rule([x], lq, lp, keys[2 * i + 1])
        counts[x if n == 1 else nxt] += 1
    pv = chisq_pvalue(counts, p[0])
    if should_pass:
        assert pv > 1e-3, f"correct rule rejected (p-value {pv:.2g})"
    else:
        assert pv < 1e-3, f"wrong rule not detected (p-value {pv:.2g})"
