"""Bitwise verification (edgespec/kernels/exact.py, docs/bitwise.md): with the mode on, every
row of a verifier pass over T positions (a chain, a tree under its mask, a prompt chunk) is
bitwise the row a one-token pass over the same prefix gives; the kernels' Metal sources,
emulated, keep rows independent of the width too; and greedy `auto` equals `plain` on the
real model."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from conftest import make_tiny_model

from edgespec.benchmark.width_check import chain_rows, prefill_rows, random_tree, tree_rows
from edgespec.kernels import emulate, exact


@pytest.fixture
def bitwise():
    before = exact.enabled()
    exact.set_enabled(True)
    yield
    exact.set_enabled(before)


@pytest.fixture(scope="module")
def tiny():
    return make_tiny_model(3)


# ---------------------------------------------------------------- kernels


@pytest.mark.parametrize("k,n", [(64, 128), (576, 192), (1536, 576)])
def test_linear_rows_do_not_depend_on_width(k, n):
    rng = np.random.default_rng(k)
    w = mx.array(rng.standard_normal((n, k)).astype(np.float32))
    b = mx.array(rng.standard_normal(n).astype(np.float32))
    for T in (2, 7, 8, 9, 33):
        x = mx.array(rng.standard_normal((1, T, k)).astype(np.float32))
        wide = np.array(exact.exact_linear(x, w, b))
        for t in range(T):
            assert np.array_equal(np.array(exact.exact_linear(x[:, t:t + 1], w, b))[0, 0], wide[0, t]), (T, t)
        want = np.array(x[0]).astype(np.float64) @ np.array(w).T.astype(np.float64) + np.array(b)
        assert np.abs(wide[0] - want).max() < 1e-3


def test_quantized_rows_do_not_depend_on_width_on_cpu():
    # MLX's CPU quantized product is row by row already: bitwise mode relies on it
    mx.random.seed(0)
    lin = nn.QuantizedLinear(256, 96, bias=True, group_size=64, bits=4)
    rng = np.random.default_rng(0)
    for T in (3, 17, 70):
        x = mx.array(rng.standard_normal((1, T, 256)).astype(np.float32))
        wide = np.array(lin(x))
        assert all(np.array_equal(np.array(lin(x[:, t:t + 1]))[0, 0], wide[0, t]) for t in range(T))


def _one_query(q, k, v, scale, see, softcap, row):
    """Attention of query `row` over only the keys it sees, compacted (a one-token pass)."""
    keys = mx.array(np.flatnonzero(see[row]))
    return np.array(exact.exact_attention(q[:, :, row:row + 1], k[:, :, keys], v[:, :, keys], scale, None,
                                          softcap))[:, :, 0]


@pytest.mark.parametrize("softcap", [None, 30.0])
def test_attention_rows_see_only_their_keys(softcap):
    rng = np.random.default_rng(1)
    B, H, Hk, T, P, D = 1, 6, 2, 12, 37, 32
    q = mx.array(rng.standard_normal((B, H, T, D)).astype(np.float32))
    k = mx.array(rng.standard_normal((B, Hk, P + T, D)).astype(np.float32))
    v = mx.array(rng.standard_normal((B, Hk, P + T, D)).astype(np.float32))
    parents = random_tree(rng, T)
    tree = np.zeros((T, P + T), bool)
    tree[:, :P] = True
    for t in range(T):
        node = t
        while node >= 0:
            tree[t, P + node] = True
            node = parents[node]
    causal = np.arange(P + T)[None] <= (P + np.arange(T))[:, None]
    for mask, see in ((None, causal), ("causal", causal), (mx.array(tree), tree)):
        wide = np.array(exact.exact_attention(q, k, v, 0.2, mask, softcap))
        ref = exact.reference_attention(np.array(q), np.array(k), np.array(v), 0.2, see[None, None], softcap)
        assert np.abs(wide - ref).max() < 1e-5
        for t in range(T):
            assert np.array_equal(_one_query(q, k, v, 0.2, see, softcap, t), wide[:, :, t]), t


# ---------------------------------------------------------------- Metal sources (emulated)


@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    if emulate.compiler() is None:
        pytest.skip("no C++ compiler to emulate the Metal kernels")
    d = tmp_path_factory.mktemp("emu_bitwise")
    return {
        "linear": emulate.EmulatedKernel(exact.EXACT_LINEAR, [np.float32, np.float32, np.int32], [np.float32], d),
        "attention": emulate.EmulatedKernel(
            exact.EXACT_ATTENTION, [np.float32] * 3 + [np.uint8, np.int32, np.float32], [np.float32], d),
    }


def test_metal_linear_rows_do_not_depend_on_width(emu):
    rng = np.random.default_rng(2)
    N, K = 24, 40
    w = rng.standard_normal((N, K)).astype(np.float32)
    x = rng.standard_normal((9, K)).astype(np.float32)

    def run(rows):
        M = len(rows)
        return emu["linear"]([rows, w, np.array([M, N, K], np.int32)], (N, M, 1), [(M, N)])[0]

    wide = run(x)
    assert np.abs(wide - x.astype(np.float64) @ w.T.astype(np.float64)).max() < 1e-4
    assert all(np.array_equal(run(x[t:t + 1])[0], wide[t]) for t in range(9))


@pytest.mark.parametrize("softcap", [0.0, 25.0])
def test_metal_attention_rows_see_only_their_keys(emu, softcap):
    rng = np.random.default_rng(3)
    B, H, Hk, T, P, D = 2, 4, 2, 6, 11, 8
    q = rng.standard_normal((B, H, T, D)).astype(np.float32)
    k, v = (rng.standard_normal((B, Hk, P + T, D)).astype(np.float32) for _ in range(2))
    parents = random_tree(rng, T)
    see = np.zeros((T, P + T), bool)
    see[:, :P] = True
    for t in range(T):
        node = t
        while node >= 0:
            see[t, P + node] = True
            node = parents[node]

    def run(qq, kk, vv, mask):
        Tq, S = qq.shape[2], kk.shape[2]
        m, dims, (rows, bh) = exact.attention_inputs(mx.array(qq), mx.array(kk), None if mask is None else mx.array(mask))
        qg = np.array(exact._group_queries(mx.array(qq), Hk))
        out = emu["attention"]([qg, kk.reshape(bh, S, D), vv.reshape(bh, S, D), np.array(m), np.array(dims, np.int32),
                                np.array([0.3, softcap], np.float32)], (D, rows, bh), [(bh, rows, D)])[0]
        return np.array(exact._ungroup(mx.array(out), B, H, Tq, D, Hk))

    for mask, vis in ((None, np.arange(P + T)[None] <= (P + np.arange(T))[:, None]), (see[None, None], see)):
        wide = run(q, k, v, mask)
        ref = exact.reference_attention(q, k, v, 0.3, vis[None, None], softcap or None)
        assert np.abs(wide - ref).max() < 1e-5
        for t in range(T):
            keys = np.flatnonzero(vis[t])
            one = run(q[:, :, t:t + 1], k[:, :, keys], v[:, :, keys], None)
            assert np.array_equal(one[:, :, 0], wide[:, :, t]), t


# ---------------------------------------------------------------- whole passes, tiny model


def test_chains_trees_and_prefill_match_one_token_passes(tiny, bitwise):
    rng = np.random.default_rng(4)
    prompt = [int(x) for x in rng.integers(1, 64, 19)]
    for T in (2, 5, 9, 17, 32):
        tokens = [int(x) for x in rng.integers(1, 64, T)]
        assert chain_rows(tiny, prompt, tokens) == [], T
        assert tree_rows(tiny, prompt, tokens, random_tree(rng, T)) == [], T
    assert tree_rows(tiny, prompt, [5] * 8, [-1] + [0] * 7) == []  # a flat tree: 7 siblings
    assert prefill_rows(tiny, [int(x) for x in rng.integers(1, 64, 90)]) == []


def test_sliding_window_model(bitwise):
    # a window narrower than the tree and the prompt: explicit masks on every pass
    model = make_tiny_model(5, sliding_window=6)
    rng = np.random.default_rng(5)
    prompt = [int(x) for x in rng.integers(1, 64, 12)]
    tokens = [int(x) for x in rng.integers(1, 64, 10)]
    assert chain_rows(model, prompt, tokens) == []
    assert tree_rows(model, prompt, tokens, random_tree(rng, 10)) == []


def test_quantized_model(bitwise):
    # 4-bit weights (as a GGUF or MLX-quantized bundle loads): the edgespec Linear quantizes
    # into its own QuantizedLinear, which bitwise mode reaches
    from edgespec.kernels.linear import QuantizedLinear

    model = make_tiny_model(6)
    nn.quantize(model, group_size=32, bits=4)
    assert isinstance(model.layers[0].mlp.down_proj, QuantizedLinear)
    rng = np.random.default_rng(6)
    prompt = [int(x) for x in rng.integers(1, 64, 10)]
    tokens = [int(x) for x in rng.integers(1, 64, 12)]
    assert chain_rows(model, prompt, tokens) == []
    assert tree_rows(model, prompt, tokens, random_tree(rng, 12)) == []


# ---------------------------------------------------------------- the default model

PROMPTS = ["Help me write a short, polite email asking my landlord to fix a leaking kitchen tap.",
           "List three prime numbers and explain why each is prime."]


@pytest.mark.real_model
def test_real_model_rows_and_auto_equals_plain(real_engine, bitwise):
    from edgespec.engine import make_options

    model = real_engine.loaded.model
    rng = np.random.default_rng(6)
    prompt = real_engine.encode_prompt(messages=[{"role": "user", "content": PROMPTS[0]}])
    tokens = [int(x) for x in rng.integers(1, 40000, 6)]
    assert chain_rows(model, prompt, tokens) == []
    assert tree_rows(model, prompt, tokens, [-1, 0, 1, 0, 3, 1]) == []
    assert prefill_rows(model, prompt[:16]) == []
    for text in PROMPTS:
        ids = real_engine.encode_prompt(messages=[{"role": "user", "content": text}])
        plain = real_engine.generate(ids, options=make_options(mode="plain", max_tokens=24)).tokens
        auto = real_engine.generate(ids, options=make_options(mode="auto", max_tokens=24)).tokens
        assert list(auto) == list(plain), text


# ---------------------------------------------------------------- bench: near-ties apart from bugs


def _bench_run():
    from edgespec.benchmark.prompts import BenchPrompt
    from edgespec.benchmark.runner import BenchRun, RunRecord
    from edgespec.benchmark.specs import ModeSpec

    prompts = [BenchPrompt("a", None, "chat", id="p0"), BenchPrompt("b", None, "chat", id="p1")]
    run = BenchRun([ModeSpec("plain", "plain"), ModeSpec("auto", "auto")], prompts, {})
    run.prompt_ids = [[7, 8], [9]]
    stats = dict(generated_tokens=3, decode_s=1.0, verifier_passes=3, peak_memory_bytes=0)
    for i, got in ((0, [1, 5, 3]), (1, [4, 4, 6])):  # prompt 0 flips token 1 (2 -> 5), prompt 1 token 2 (4 -> 6)
        run.records.append(RunRecord("plain", i, "chat", 0, [1, 2, 3] if i == 0 else [4, 4, 4], "length", 1.0, stats))
        run.records.append(RunRecord("auto", i, "chat", 0, got, "length", 1.0, stats))
    return run


def _logprobs(ids):
    lp = np.full(10, -5.0)
    if ids == [7, 8, 1]:  # prompt 0 after plain's first token: 2 and 5 nearly tied
        lp[2], lp[5] = -0.9384, -0.93845
    else:
        lp[4], lp[6] = -0.2, -3.0
    return lp


def test_bench_classifies_near_ties_apart_from_bugs():
    from edgespec.benchmark.format import bugs, problems, summary_lines
    from edgespec.benchmark.report import build_report
    from edgespec.benchmark.runner import check_equality

    before = exact.enabled()
    try:
        exact.set_enabled(False)
        run = _bench_run()
        check_equality(run, True, _logprobs)
        kinds = {m.prompt_index: (m.near_tie, round(m.gap, 5)) for m in run.mismatches}
        assert kinds == {0: (True, 5e-05), 1: (False, 2.8)}
        report = build_report(run)
        assert [m["prompt_index"] for m in bugs(report)] == [1]
        lines = problems(report)
        assert any(line.startswith("near-tie: auto differs from plain on prompt p0") for line in lines)
        assert any(line.startswith("BUG: auto differs from plain on prompt p1") for line in lines)
        assert "1 near-tie(s)" in summary_lines(report)[0]
        exact.set_enabled(True)  # with bitwise verification a near-tie flip is a bug too
        run = _bench_run()
        check_equality(run, True, _logprobs)
        assert all(not m.near_tie for m in run.mismatches) and run.status("auto") == "mismatch"
    finally:
        exact.set_enabled(before)
