"""EAGLE-2 dynamic draft trees from an EAGLE-3 head (Eagle3Drafter.draft_tree, DrafterCaps.trees).

A random head on a tiny random Llama verifier (written as tests/test_eagle3.py does): the tree's
shape rules (parents first, scores the products of the head's probabilities and falling along
paths, the best nodes kept), its head calls under the tree mask agreeing with a chain drafted
along the same path, the drafter's state after a tree the same as a fresh one's; mode `tree` and
`auto` with the head equal to plain decoding (greedy, several prompts, seeded policies; seeded
sampling), and the trees offered to `auto` as candidates priced by the head's confidence.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import write_tiny_hf_folder
from test_eagle3 import PROMPT, VERIFIER, load, recorded_states, two_way_head, write_random

from edgespec.adaptive.policy import SeededPolicy
from edgespec.adaptive.sources import DrafterSource, tree_candidates
from edgespec.logits.sampling import Sampler, SamplingParams

TARGETS = (5, 9, 1, 2, 17, 30)
GREEDY = Sampler(SamplingParams(temperature=0.0))


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("eagle3_trees")
    verifier = two_way_head(write_tiny_hf_folder(tmp / "v", seed=3, **VERIFIER))
    return load(verifier, drafter=write_random(tmp / "head", targets=TARGETS))


def drafter_on(engine, prompt):
    d, _ = recorded_states(engine, prompt)
    d.begin(prompt)
    return d


def depths(parents):
    out = []
    for p in parents:
        out.append(1 if p < 0 else out[p] + 1)
    return out


def test_the_tree_keeps_the_best_nodes_parents_first_scores_falling(engine):
    assert engine.drafter.caps.trees and "tree" in engine.drafter.caps.modes
    d = drafter_on(engine, PROMPT[:10])
    full = d.draft_tree(4, 3, 3)
    d.sync(PROMPT[:10])
    kept = d.draft_tree(4, 3, 3, keep=10)
    # level 1: 3 children of the root; then 3 expanded nodes x 3 children a level
    assert len(full) == 3 + 3 * 9 and full.levels == 4
    assert max(depths(full.parents)) == 4
    for t in (full, kept):
        assert set(t.tokens) <= set(TARGETS)
        for i, p in enumerate(t.parents):
            assert p < i  # parents before children
            want = t.probs[i] * (1.0 if p < 0 else t.scores[p])
            assert t.scores[i] == pytest.approx(want, rel=1e-12)
            assert 0.0 < t.probs[i] <= 1.0 and (p < 0 or t.scores[i] <= t.scores[p])
        for p in set(t.parents):  # siblings distinct, likeliest first
            kids = [i for i, q in enumerate(t.parents) if q == p]
            assert len({t.tokens[i] for i in kids}) == len(kids)
            assert all(t.probs[a] >= t.probs[b] for a, b in zip(kids, kids[1:], strict=False))
    # the kept ten are the full tree's ten best (ties aside), closed under ancestors
    assert len(kept) == 10
    assert sorted(kept.scores, reverse=True) == pytest.approx(sorted(full.scores, reverse=True)[:10])
    # a level expands the best new nodes: every fed node's children are there, the others have none
    d.sync(PROMPT[:10])
    keep_fn = []
    d.draft_tree(3, 2, 2, keep=lambda scores: keep_fn.append(list(scores)) or 4)
    assert keep_fn and keep_fn[0] == sorted(keep_fn[0], reverse=True)


def test_the_tree_mask_computes_what_a_chain_does_and_the_state_after_is_a_fresh_drafters(engine):
    """Along the head's greedy path the tree's nodes (fed beside their siblings under the tree
    mask) get the probabilities a chain drafted alone gets; after a tree, the drafter drafts what
    a fresh drafter on the same committed tokens drafts."""
    prompt = PROMPT[:12]
    fresh = drafter_on(engine, prompt)
    chain = fresh.draft(4, GREEDY, ranks=3)
    d = drafter_on(engine, prompt)
    t = d.draft_tree(4, 3, 3)
    node, path = -1, []
    for _ in range(4):
        node = next(i for i, p in enumerate(t.parents) if p == node)  # the likeliest child
        path.append(node)
    assert [t.tokens[i] for i in path] == chain.tokens
    np.testing.assert_allclose([t.probs[i] for i in path], chain.ranked[1][:, 0], rtol=1e-4, atol=1e-6)
    # runner-ups at each depth of the path: the chain's ranked next guesses
    for j, n in enumerate(path):
        sibs = [i for i, p in enumerate(t.parents) if p == t.parents[n]]
        assert [t.tokens[i] for i in sibs] == list(chain.ranked[0][j, : len(sibs)])
    # the state after a tree (and after a tree then a shorter committed sequence)
    d.sync(prompt)
    again = d.draft(4, GREEDY, ranks=3)
    assert again.tokens == chain.tokens
    np.testing.assert_allclose(np.array(again.logprobs), np.array(chain.logprobs), atol=1e-5)
    d.draft_tree(3, 2, 3)
    d.sync(prompt[:8])
    ref = drafter_on(engine, prompt[:8])
    a, b = d.draft(3, GREEDY), ref.draft(3, GREEDY)
    assert a.tokens == b.tokens
    np.testing.assert_allclose(np.array(a.logprobs), np.array(b.logprobs), atol=1e-5)


def test_auto_gets_the_tree_as_candidates_priced_by_the_heads_confidence(engine):
    d = drafter_on(engine, PROMPT[:10])
    t = d.draft_tree(3, 2, 2)
    cands = tree_candidates(t, "drafter")
    # one candidate per leaf, the chain of first children first; every node in some candidate once as own
    leaves = [i for i in range(len(t)) if i not in t.parents]
    assert len(cands) == len(leaves)
    chain, node = [], -1
    while node in t.parents:
        node = t.parents.index(node)
        chain.append(t.tokens[node])
    assert cands[0].tokens == chain and cands[0].own == 0
    assert sum(len(c.tokens) - c.own for c in cands) == len(t)
    assert all(c.token_buckets[0].startswith("q") for c in cands[:1])
    assert any(b.startswith("r") for c in cands[1:] for b in c.token_buckets[c.own:])
    src = DrafterSource(engine.drafter.fork())
    assert src.trees and "drafter:q7" in src.priors
    assert not DrafterSource(engine.drafter.fork(), trees=False).trees


def plain_refs(engine, prompts, n):
    return [engine.generate(p, max_tokens=n, mode="plain").tokens for p in prompts]


def count_trees(engine, monkeypatch) -> list[int]:
    """The depth of every draft_tree call from now on (on the class: requests draft with forks)."""
    calls, grow = [], type(engine.drafter).draft_tree
    monkeypatch.setattr(type(engine.drafter), "draft_tree",
                        lambda self, depth, *a, **kw: calls.append(depth) or grow(self, depth, *a, **kw))
    return calls


def test_tree_and_auto_with_the_head_equal_plain(engine, monkeypatch):
    prompts = [PROMPT[:9], PROMPT[3:20], PROMPT[:2]]
    refs = plain_refs(engine, prompts, 24)
    trees = count_trees(engine, monkeypatch)
    for opts in (dict(adaptive=0), dict(adaptive=0, budget=6, depth=3, width=2, topk=2),
                 dict(adaptive=0, shape="static", branching="2x2x1"),
                 dict(sources="drafter+prompt_lookup+pool", window=2)):
        for p, ref in zip(prompts, refs, strict=True):
            out = engine.generate(p, max_tokens=24, mode="tree", **opts)
            assert out.tokens == ref, opts
    assert trees
    accepted, in_auto = 0, 0
    try:
        for seed in (0, 1, 2):
            engine.policy = SeededPolicy(seed)
            for p, ref in zip(prompts[:2], refs, strict=False):
                out = engine.generate(p, max_tokens=24, mode="tree")
                assert out.tokens == ref, engine.policy.describe()
                accepted += out.stats.accepted_by_source.get("drafter", 0)
                trees.clear()
                assert engine.generate(p, max_tokens=24, mode="auto").tokens == ref, engine.policy.describe()
                in_auto += len(trees)
    finally:
        engine.policy = None
    assert accepted > 0  # the head's trees were verified and partly kept
    assert in_auto > 0  # auto drafted trees with it


def test_in_metals_numerics_the_heads_trees_stay_exact(tmp_path):
    """numerics="metal": the head in float16 with Metal's products grows its trees (per-node RoPE
    positions through the half-precision path); tree and auto still equal plain."""
    engine = load(two_way_head(write_tiny_hf_folder(tmp_path / "v", seed=3, **VERIFIER)),
                  drafter=write_random(tmp_path / "head"), numerics="metal")
    p = PROMPT[:9]
    ref = engine.generate(p, max_tokens=20, mode="plain").tokens
    out = engine.generate(p, max_tokens=20, mode="tree", adaptive=0)
    assert out.tokens == ref and out.stats.accepted_by_source.get("drafter", 0) > 0
    assert engine.generate(p, max_tokens=20, mode="auto").tokens == ref


def test_four_requests_at_once_grow_trees_of_their_own(engine):
    from conftest import run_at_once

    prompts = [PROMPT[i : i + 8] for i in range(4)]
    refs = plain_refs(engine, prompts, 20)
    got = run_at_once(lambda i: engine.generate(prompts[i], max_tokens=20, mode="tree", adaptive=0))
    assert [g.tokens for g in got] == refs
    assert sum(g.stats.accepted_by_source.get("drafter", 0) for g in got) > 0


def test_seeded_sampling_with_head_trees_equals_plain_in_auto(engine):
    prompt = PROMPT[:6]
    for seed in (1, 2):
        kw = dict(max_tokens=16, temperature=0.8, seed=seed)
        assert engine.generate(prompt, mode="auto", **kw).tokens == engine.generate(prompt, mode="plain", **kw).tokens


def test_the_cascade_still_refuses_the_head_by_name(engine):
    from edgespec.errors import DrafterRequiredError

    with pytest.raises(DrafterRequiredError, match="eagle3"):
        engine.generate(PROMPT[:6], max_tokens=4, mode="cascade")


def test_sampled_tree_output_follows_the_verifiers_law(tmp_path):
    """Chi-square of 3-token continuations of mode `tree` sampling with the head's static 2x2 trees
    (its draft vocabulary 5 of the verifier's 8 tokens) against the law enumerated from plain
    decoding; the same test rejects a wrong law."""
    from stats_support import chisq_pvalue, continuation_counts, continuation_law

    from edgespec.modes.tree import TreeMode
    from edgespec.tree import TreePlan

    verifier = write_tiny_hf_folder(tmp_path / "v", seed=4, vocab_size=8, num_hidden_layers=3)
    engine = load(verifier, drafter=write_random(tmp_path / "d", targets=(0, 2, 3, 5, 6), vocab=8,
                                                 layer_ids=(1, 2, 3)))
    prompt, params = [1, 5, 2, 7], dict(temperature=1.0, top_k=3)
    law = continuation_law(engine.model, prompt, SamplingParams(**params), 3)
    keys = list(law)
    mode = TreeMode(engine.model, engine.drafter, plan=TreePlan(shape="static", branching=(2, 2)), adaptive=False)
    counts, accepted = continuation_counts(mode, prompt, params, keys, 300, 3)
    assert accepted > 0
    want = np.array([law[k] for k in keys])
    pv = chisq_pvalue(counts, want)
    assert pv > 1e-3, f"tree samples with an EAGLE-3 head's trees differ from plain's law (p-value {pv:.2g})"
    wrong = want**0.5
    assert chisq_pvalue(counts, wrong / wrong.sum()) < 1e-3


def test_on_metal_a_kept_branch_packs_the_recorded_states_with_the_keys(monkeypatch):
    """commit_kv's kernel path (Metal) packs a HiddenKVCache's recorded rows with its keys, so
    after a tree pass keeps a branch other than the first the head reads the kept path's states."""
    import mlx.core as mx

    import edgespec.kernels.kv as kv
    from edgespec.caches.kv import HiddenKVCache

    c = HiddenKVCache()
    k = mx.arange(6 * 4, dtype=mx.float32).reshape(1, 1, 6, 4)
    c.update_and_fetch(k, k + 100)
    c.put_hidden(mx.arange(6, dtype=mx.float32).reshape(1, 6, 1))
    monkeypatch.setattr(kv, "on_metal", lambda: True)
    kv.commit_kv([c], 2, [1, 3])  # positions 3 and 5 kept at 2 and 3
    assert c.offset == 4
    assert np.array(c.hidden[0, :4, 0]).tolist() == [0, 1, 3, 5]
    assert np.array(c.keys[0, 0, :4, 0]).tolist() == [0, 4, 12, 20]
