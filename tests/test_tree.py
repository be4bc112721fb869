"""Tree speculation and the cascade: greedy equality with plain decoding, structure, options.

Tiny random models only. The verifier is a peaky 4-layer model; the drafter is
its own first three layers (self-speculation), so drafts are often but not
always right and both acceptance and rejection are exercised.
"""

from __future__ import annotations

import itertools

import mlx.core as mx
import numpy as np
import pytest
from conftest import make_tiny_engine, make_tiny_model, random_prompts

from edgespec.drafters.mlx_drafter import MLXDrafter
from edgespec.drafters.self_spec import SelfSpecDrafter
from edgespec.engine import make_options
from edgespec.generate import GenerationStats, PlainMode
from edgespec.kernels import commit_kv, emulate, tree_accept_reference, tree_mask_reference
from edgespec.logits.sampling import Sampler, SamplingParams
from edgespec.modes.speculative import SpeculativeMode
from edgespec.modes.tree import TreeMode, parse_options
from edgespec.options import GenerateOptions
from edgespec.tree import CascadeDrafter, SourceTree, TreeBudget, TreeCosts, TreeDrafter, TreePlan

N_TOKENS = 16


def run(mode, prompt, n, params=None):
    stats = GenerationStats()
    it = mode.steps(prompt, Sampler(params or SamplingParams()), stats)
    out = [t.id for t in itertools.islice(it, n)]
    it.close()
    return out, stats


def prompts(count: int = 20, seed: int = 0) -> list[list[int]]:
    return random_prompts(count, seed, max_len=20)


@pytest.fixture(scope="module")
def verifier():
    return make_tiny_model(0, scale=2.0, num_hidden_layers=4)


@pytest.fixture(scope="module")
def refs(verifier):
    return [run(PlainMode(verifier), p, N_TOKENS)[0] for p in prompts()]


COSTS = TreeCosts([1, 8, 64], [1.0, 1.2, 3.0])  # a fixed cost curve: reproducible dynamic budgets

CONFIGS = {
    "static 3x2x1x1": dict(shape="static", branching="3x2x1x1"),
    "dynamic budget 6": dict(shape="dynamic", depth=4, width=2, topk=3, budget=6),
    "dynamic auto budget": dict(shape="dynamic", depth=4, width=3, topk=3),
    "multi-source + window": dict(
        shape="dynamic", depth=3, sources="drafter+prompt_lookup+pool", window=2, budget=8
    ),
    "weight-free": dict(sources="prompt_lookup+pool", guesses=3),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_tree_greedy_equals_plain_on_20_prompts(verifier, refs, name):
    o = parse_options(CONFIGS[name])
    o["adaptive"] = False  # always full trees: the test is about the tree, not the fallback
    drafter = SelfSpecDrafter(verifier, [0, 1, 2]) if "drafter" in o["sources"] else None
    mode = TreeMode(verifier, drafter, costs=COSTS, **o)
    passes, by_source, sizes = 0, {}, set()
    for prompt, ref in zip(prompts(), refs, strict=True):
        got, stats = run(mode, prompt, N_TOKENS)
        assert got == ref, (name, prompt)
        passes += stats.verifier_passes
        sizes.add(stats.draft_tokens)
        for k, v in stats.accepted_by_source.items():
            by_source[k] = by_source.get(k, 0) + v
    assert passes < 20 * (N_TOKENS - 1) * 0.8, (
        passes
    )  # drafts were accepted: fewer passes than plain
    # Every token not made by a pass's verifier (bonus/correction) is an accepted candidate.
    assert sum(by_source.values()) >= 20 * (N_TOKENS - 1) - passes
    wanted = (
        {"drafter"}
        if "sources" not in CONFIGS[name]
        else set(parse_options(CONFIGS[name])["sources"])
    )
    assert wanted <= set(by_source), by_source  # each source contributed accepted tokens
    if name == "dynamic auto budget":
        assert len(sizes) > 2, sizes  # the budget changed with the drafter's confidence


def test_accepted_tokens_are_attributed_to_sources(verifier):
    o = parse_options({"sources": "drafter+prompt_lookup", "shape": "static", "branching": "2x1"})
    mode = TreeMode(
        verifier,
        SelfSpecDrafter(verifier, [0, 1, 2]),
        adaptive=False,
        **{k: v for k, v in o.items() if k != "adaptive"},
    )
    prompt = prompts()[0]
    stats = GenerationStats()
    it = mode.steps(prompt, Sampler(SamplingParams()), stats)
    toks = list(itertools.islice(it, 24))
    it.close()
    counted = {}
    for t in toks[1:]:
        if t.source != "verifier":
            counted[t.source] = counted.get(t.source, 0) + 1
    # The last pass may be cut by islice before its tokens are all yielded; stats count whole passes.
    for k, v in counted.items():
        assert stats.accepted_by_source[k] >= v
    assert set(counted) <= {"drafter", "prompt_lookup"} and counted


def test_cascade_greedy_equals_plain_on_20_prompts(verifier, refs):
    mid = SelfSpecDrafter(verifier, [0, 1, 2])
    tiny = SelfSpecDrafter(verifier, [0])
    for adaptive in (False, True):
        cascade = CascadeDrafter(mid, tiny, inner_k=2, adaptive=adaptive, probe_every=4)
        mode = SpeculativeMode(
            verifier, cascade, GenerateOptions(draft_tokens=4), stats_name="cascade"
        )
        passes = 0
        for prompt, ref in zip(prompts(), refs, strict=True):
            got, stats = run(mode, prompt, N_TOKENS)
            assert got == ref, (adaptive, prompt)
            passes += stats.verifier_passes
        assert passes < 20 * (N_TOKENS - 1) * 0.8
        assert cascade.inner_accepted > 0 and cascade.inner_drafted > cascade.inner_accepted
        if adaptive:
            assert cascade.counts["mid"] > 0 and cascade.counts["cascade"] > 0  # both measured


def test_tree_drafter_levels_match_a_causal_chain(verifier):
    """A chain tree drafted level by level gives the drafter's own greedy continuation."""
    d = SelfSpecDrafter(verifier, [0, 1, 2])
    td = TreeDrafter(d)
    prompt = [5, 9, 3, 7]
    td.begin(prompt)
    tree = SourceTree.rooted(prompt[-1])
    td.grow(prompt, tree, TreePlan(shape="static", branching=(1, 1, 1, 1)))
    d.begin(prompt)
    ref = d.draft(4, Sampler(SamplingParams())).tokens
    assert tree.tokens[1:] == ref and tree.parents == [-1, 0, 1, 2, 3]
    # Commit the first two nodes: the drafter cache holds prompt + those two, packed.
    td.commit([1, 2], tree)
    assert td.fed == prompt + ref[:2] and td.cache[0].offset == len(prompt) + 2


def test_budget_follows_the_measured_verify_cost():
    plan = TreePlan(shape="dynamic", depth=3, width=3, topk=3)
    budget = TreeBudget(TreeCosts([1, 64], [1.0, 1.0]))  # free verification: keep all
    assert budget.pick([0.9, 0.5, 0.1]) == 3
    costly = TreeBudget(TreeCosts([1, 2, 64], [1.0, 3.0, 100.0]))
    assert costly.pick([0.9, 0.5, 0.1]) == 0  # one extra token triples the cost: keep none
    assert plan.max_nodes() == 1 + 3 + 2 * 9


def test_budget_calibration_learns_from_acceptance():
    b = TreeBudget(TreeCosts([1, 64], [1.0, 1.0 + 63 * 0.05]))
    scores = [0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2]
    before = b.pick(scores)
    for _ in range(30):
        b.pick(scores)
        b.record(0, 0.0)  # nothing ever accepted: the drafter is overconfident
    assert b.c < 0.2 and b.pick(scores) < before


@pytest.mark.parametrize(
    "bad",
    [
        {"shape": "wide"},
        {"branching": "3x0"},
        {"depth": 0},
        {"sources": "drafter+oracle"},
        {"budget": 1},
        {"colour": 1},
    ],
)
def test_bad_options_are_refused_with_a_message(bad):
    with pytest.raises(ValueError, match="tree option"):
        parse_options(bad)


def test_modes_through_the_engine():
    engine = make_tiny_engine(0, num_hidden_layers=4, scale=2.0)
    ref = engine.generate([3, 4, 5, 3, 4], max_tokens=12, mode="plain").tokens
    with pytest.raises(Exception, match="drafter"):
        engine.generate([3, 4, 5], max_tokens=4, mode="tree")
    assert (
        engine.generate(
            [3, 4, 5, 3, 4], max_tokens=12, mode="tree", sources="prompt_lookup+pool"
        ).tokens
        == ref
    )
    engine.drafter = SelfSpecDrafter(engine.model, [0, 1, 2])
    for opts in ({"shape": "static"}, {"shape": "dynamic", "budget": 5}):
        assert engine.generate([3, 4, 5, 3, 4], max_tokens=12, mode="tree", **opts).tokens == ref
    engine.drafter = MLXDrafter(make_tiny_model(3, num_hidden_layers=1))
    res = engine.generate(
        [3, 4, 5, 3, 4],
        options=make_options(max_tokens=12, mode="cascade", draft_tokens=3, mid_layers="0-2"),
    )
    assert res.tokens == ref and res.stats.mode == "cascade"


# ---------------------------------------------------------------- kernels on the trees built here
@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    if emulate.compiler() is None:
        pytest.skip("no C++ compiler to emulate Metal kernels")
    from edgespec.kernels import KV_GATHER, TREE_ACCEPT, TREE_MASK

    d = tmp_path_factory.mktemp("metal_emu_tree")
    return {
        "mask": emulate.EmulatedKernel(TREE_MASK, [np.int32, np.int32], [np.bool_, np.int32], d),
        "accept": emulate.EmulatedKernel(TREE_ACCEPT, [np.int32] * 4, [np.int32], d),
        "gather": emulate.EmulatedKernel(
            KV_GATHER, [np.float32, np.int32, np.int32], [np.float32], d
        ),
    }


def built_tree(verifier):
    """A multi-source tree as a pass builds it: drafter branches, lookup, pool paths, a window."""
    prompt = [4, 8, 15, 16, 23, 42, 4, 8, 15]
    td = TreeDrafter(SelfSpecDrafter(verifier, [0, 1, 2]))
    td.begin(prompt)
    tree = SourceTree.rooted(prompt[-1])
    td.grow(prompt, tree, TreePlan(shape="dynamic", depth=3, width=2, topk=3))
    tree.add_path([16, 23, 42], "prompt_lookup")
    tree.add_path([16, 9], "pool")
    tree.add_window([[1, 2], [3, 4]])
    return prompt, tree, td


def test_kernels_emulated_on_built_trees(verifier, emu):
    prompt, tree, _ = built_tree(verifier)
    T, P = len(tree), len(prompt) - 1
    parents = np.array(tree.parents, np.int32)
    mask, pos = emu["mask"]([parents, np.array([T, P])], (P + T, T, 1), [(T, P + T), (T,)], init=1)
    ref_mask, ref_pos = tree_mask_reference(mx.array(parents), P)
    np.testing.assert_array_equal(mask, np.array(ref_mask))
    np.testing.assert_array_equal(pos, np.array(ref_pos))
    # Semantics: the lookup path's last node sees exactly the root and its two ancestors.
    last = tree.children[tree.children[tree.children[0][16]][23]][42]
    assert set(np.nonzero(mask[last, P:])[0]) == {0, *tree.path_to(last)}
    rng = np.random.default_rng(0)
    tokens = np.array(tree.tokens, np.int32)
    for _ in range(5):
        pred = tokens[rng.permutation(T)].astype(np.int32)  # predictions that often match some node
        (res,) = emu["accept"]([tokens, parents, pred, np.array([T])], (1, 1, 1), [(3,)], init=-9)
        ref = tree_accept_reference(mx.array(tokens), mx.array(parents), mx.array(pred))
        np.testing.assert_array_equal(res, np.array(ref))


def test_drafter_commit_gathers_like_the_emulated_kernel(verifier, emu):
    prompt, tree, td = built_tree(verifier)
    L, feed_of = td._pass
    deep = max(feed_of, key=lambda n: len(tree.path_to(n)))  # a fed node with fed ancestors
    path = tree.path_to(deep)
    keep = [feed_of[n] - 1 for n in path]
    c = td.cache[0]
    B, Hk, C, D = c.keys.shape
    src = np.array(c.keys, np.float32)
    idx = np.array([L + i for i in keep], np.int32)
    (gathered,) = emu["gather"](
        [src, idx, np.array([C, D, len(idx)])],
        (D, len(idx), B * Hk),
        [(B, Hk, len(idx), D)],
        init=7,
    )
    td.commit(path, tree)
    np.testing.assert_array_equal(np.array(c.keys[..., L : L + len(keep), :]), gathered)
    assert c.offset == L + len(keep) and td.fed == prompt + [tree.tokens[n] for n in path]
    commit_kv([], 0, [])  # no caches: nothing to do, no error
