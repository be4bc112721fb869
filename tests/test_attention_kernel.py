"""The CPU long-prompt attention path (edgespec.kernels.attention) against the fused kernel."""

import mlx.core as mx
import numpy as np
import pytest

import edgespec.kernels.attention as kernel
from edgespec.kernels.attention import (
    BLOCK_ROWS,
    CPU_NUMPY_MIN_QUERIES,
    CPU_NUMPY_MIN_SCORES,
    attention,
    grouped_attention,
    numpy_attention,
    use_numpy_attention,
)

ON_CPU = mx.default_device() == mx.cpu


def _qkv(H, Hk, T, S, D=16, seed=0, dtype=mx.float32):
    mx.random.seed(seed)
    q = mx.random.normal((2, H, T, D)).astype(dtype)
    k = mx.random.normal((2, Hk, S, D)).astype(dtype)
    v = mx.random.normal((2, Hk, S, D)).astype(dtype)
    return q, k, v


@pytest.mark.parametrize("H,Hk,T,S", [(4, 2, 37, 100), (6, 3, BLOCK_ROWS + 45, 700), (4, 4, 300, 300)])
def test_causal_with_a_cache_matches_the_fused_kernel(H, Hk, T, S):
    """New tokens are the last T of S slots (a prompt chunk after earlier chunks), grouped heads,
    more than one query block."""
    q, k, v = _qkv(H, Hk, T, S)
    ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask="causal")
    for mask in (None, "causal"):
        out = numpy_attention(q, k, v, 0.25, mask)
        assert out.shape == ref.shape and out.dtype == mx.float32
        np.testing.assert_allclose(np.array(out), np.array(ref), rtol=1e-5, atol=1e-5)


def test_boolean_masks_per_row_match_the_fused_kernel():
    H, Hk, T, S = 4, 2, 80, 200
    q, k, v = _qkv(H, Hk, T, S, seed=1)
    causal = mx.arange(S)[None] <= (S - T + mx.arange(T))[:, None]  # every row sees itself
    mask = causal & (mx.random.uniform(shape=(2, 1, T, S)) > 0.4) | mx.eye(T, S, k=S - T, dtype=mx.bool_)
    ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=mask)
    np.testing.assert_allclose(np.array(numpy_attention(q, k, v, 0.25, mask)), np.array(ref), rtol=1e-5, atol=1e-5)


def test_softcap_matches_the_definition():
    H, Hk, T, S = 4, 2, 20, 50
    q, k, v = _qkv(H, Hk, T, S, seed=2)
    cap = 3.0
    kk = mx.repeat(k, H // Hk, axis=1)
    vv = mx.repeat(v, H // Hk, axis=1)
    scores = (q * 0.5) @ kk.swapaxes(-1, -2)
    scores = cap * mx.tanh(scores / cap)
    allowed = mx.arange(S)[None] <= (S - T + mx.arange(T))[:, None]
    ref = mx.softmax(mx.where(allowed, scores, -mx.inf), axis=-1) @ vv
    out = numpy_attention(q, k, v, 0.5, "causal", softcap=cap)
    np.testing.assert_allclose(np.array(out), np.array(ref), rtol=1e-5, atol=1e-5)


def test_half_precision_inputs_come_back_in_their_dtype():
    q, k, v = _qkv(4, 2, 70, 90, dtype=mx.float16)
    out = numpy_attention(q, k, v, 0.25, "causal")
    assert out.dtype == mx.float16
    ref = mx.fast.scaled_dot_product_attention(q.astype(mx.float32), k.astype(mx.float32),
                                               v.astype(mx.float32), scale=0.25, mask="causal")
    np.testing.assert_allclose(np.array(out.astype(mx.float32)), np.array(ref), rtol=2e-2, atol=2e-2)


def test_the_dispatcher_takes_numpy_only_for_long_chunks_on_the_cpu():
    big_T = CPU_NUMPY_MIN_QUERIES
    S = CPU_NUMPY_MIN_SCORES // (2 * 4 * big_T) + 1
    q, k, v = _qkv(4, 2, big_T, S)
    assert use_numpy_attention(q, k) == (mx.default_device() == mx.cpu)
    small_q = q[:, :, : CPU_NUMPY_MIN_QUERIES - 1]  # a verification round: the fused kernel
    assert not use_numpy_attention(small_q, k)
    assert not use_numpy_attention(q, k[:, :, :64])  # few scores: the fused kernel
    ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask="causal")
    np.testing.assert_allclose(np.array(attention(q, k, v, 0.25, "causal")), np.array(ref), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="unknown attention mask"):
        numpy_attention(q, k, v, 0.25, "sideways")


def test_a_model_prefill_through_the_numpy_path_matches_the_fused_kernel(monkeypatch):
    """Chunked prefill of a tiny model: logits and cache through the numpy path (threshold
    lowered so tiny shapes take it) equal those through MLX's graph (grouped or fused)."""
    from conftest import make_tiny_model

    import edgespec.kernels.attention as kernel
    from edgespec.generate import prefill

    model = make_tiny_model(4)
    toks = np.random.default_rng(2).integers(0, 64, 700).tolist()
    taken = []
    real = kernel.numpy_attention

    def spy(*a, **kw):
        taken.append(a[0].shape)
        return real(*a, **kw)

    runs = {}
    for name, threshold in (("numpy", 1), ("mlx", 1 << 62)):
        monkeypatch.setattr(kernel, "CPU_NUMPY_MIN_SCORES", threshold)
        monkeypatch.setattr(kernel, "numpy_attention", spy)
        cache = model.make_cache()
        runs[name] = (prefill(model, cache, toks, chunk=256), cache[-1].state[0])  # last layer: after attention
    assert taken and all(s[2] >= kernel.CPU_NUMPY_MIN_QUERIES for s in taken)  # numpy run only
    np.testing.assert_allclose(np.array(runs["numpy"][0]), np.array(runs["mlx"][0]), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.array(runs["numpy"][1]), np.array(runs["mlx"][1]), rtol=1e-5, atol=1e-5)


def test_calls_without_a_cache_stay_differentiable(monkeypatch):
    """Training and calibration call the model on whole sequences without a cache: they must
    keep the differentiable kernel (numpy has no gradients), however long the sequence."""
    import mlx.nn as nn
    from conftest import make_tiny_model

    import edgespec.kernels.attention as kernel

    monkeypatch.setattr(kernel, "CPU_NUMPY_MIN_SCORES", 1)  # every long chunk would go to numpy
    model = make_tiny_model(0)
    x = mx.array([[(7 * i) % 60 + 1 for i in range(kernel.CPU_NUMPY_MIN_QUERIES + 15)]])
    _, grads = nn.value_and_grad(model, lambda: model(x)[0, -1].sum())()
    g = grads["model"]["layers"][0]["self_attn"]["q_proj"]["weight"]
    assert float(mx.abs(g).max()) > 0  # zero if attention had been a constant


def _reference(q, k, v, scale, allowed):
    """Float64 attention; `allowed` broadcastable to (B, 1, T, S) (True = attend); a row that
    sees no key gives zeros."""
    q, k, v = (np.array(a).astype(np.float64) for a in (q, k, v))
    G = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, G, axis=1), np.repeat(v, G, axis=1)
    s = np.where(allowed, q @ k.swapaxes(-1, -2) * scale, -np.inf)
    top = s.max(-1, keepdims=True)
    top[~np.isfinite(top)] = 0
    e = np.exp(s - top)
    total = e.sum(-1, keepdims=True)
    total[total == 0] = 1
    return (e @ v) / total


CPU_ONLY = pytest.mark.skipif(not ON_CPU, reason="the grouped base-2 path is the CPU device's (Metal: the fused kernel)")


@CPU_ONLY
@pytest.mark.parametrize("H,Hk,T,S", [(9, 3, 1, 150), (9, 3, 8, 150), (4, 2, 5, 40), (4, 4, 16, 16), (6, 1, 3, 600)])
def test_the_grouped_base2_path_matches_float64_for_every_mask_kind(H, Hk, T, S):
    """A verification round's shapes (grouped heads, a few queries against a cache): no mask
    (every key visible, as the fused kernel reads None), "causal", a (T, S) and a (B, 1, T, S)
    bool mask, and a row that sees nothing (zeros, not nan)."""
    q, k, v = _qkv(H, Hk, T, S, seed=T + S)
    causal = np.arange(S)[None] <= (S - T + np.arange(T))[:, None]
    ragged = np.random.default_rng(S).random((2, 1, T, S)) > 0.5
    ragged[1, 0, 0] = False  # batch row 1's first query sees nothing
    cases = [(None, np.ones((T, S), bool)), ("causal", causal), (mx.array(causal), causal),
             (mx.array(ragged), ragged)]
    for mask, allowed in cases:
        out = grouped_attention(q, k, v, 0.3, mask)
        assert out.shape == q.shape and out.dtype == mx.float32
        np.testing.assert_allclose(np.array(out), _reference(q, k, v, 0.3, allowed), rtol=2e-5, atol=2e-6)
    assert not np.array(grouped_attention(q, k, v, 0.3, mx.array(ragged)))[1, :, 0].any()


def test_the_grouped_path_declines_what_it_does_not_take_and_the_dispatcher_falls_back():
    q, k, v = _qkv(4, 2, 3, 20)
    per_head = mx.random.uniform(shape=(2, 4, 3, 20)) > 0.3
    additive = mx.zeros((3, 20))
    half = tuple(a.astype(mx.float16) for a in (q, k, v))
    assert grouped_attention(q, k, v, 0.25, per_head) is None
    assert grouped_attention(q, k, v, 0.25, additive) is None
    assert grouped_attention(*half, 0.25, "causal") is None
    for args, mask in (((q, k, v), per_head), ((q, k, v), additive), (half, "causal")):
        ref = mx.fast.scaled_dot_product_attention(*args, scale=0.25, mask=mask)
        np.testing.assert_array_equal(np.array(attention(*args, 0.25, mask)), np.array(ref))
    with pytest.raises(ValueError, match="unknown attention mask"):
        grouped_attention(q, k, v, 0.25, "sideways")


@CPU_ONLY
def test_the_dispatcher_takes_the_grouped_path_on_the_cpu_and_it_has_gradients(monkeypatch):
    q, k, v = _qkv(4, 2, 6, 30)
    taken = []
    real = kernel.grouped_attention
    monkeypatch.setattr(kernel, "grouped_attention", lambda *a: taken.append(1) or real(*a))
    attention(q, k, v, 0.25, "causal")
    assert taken

    def loss(fn):
        return lambda q_: (fn(q_) * v[:, :1, :6]).sum()

    fused = mx.grad(loss(lambda q_: mx.fast.scaled_dot_product_attention(q_, k, v, scale=0.25, mask="causal")))(q)
    grouped = mx.grad(loss(lambda q_: real(q_, k, v, 0.25, "causal")))(q)
    assert float(mx.abs(fused).max()) > 0
    np.testing.assert_allclose(np.array(grouped), np.array(fused), rtol=1e-4, atol=1e-5)


def test_a_pass_builds_its_mask_bias_once_for_all_its_layers():
    causal = kernel._mask_bias("causal", 3, 10)
    assert kernel._mask_bias("causal", 3, 10) is causal  # the next layer of the pass
    wider = kernel._mask_bias("causal", 3, 11)  # the next pass: one more key
    assert wider is not causal and wider.shape[-1] == 11
    allowed = np.arange(11)[None] <= (8 + np.arange(3))[:, None]
    np.testing.assert_array_equal(np.array(wider).reshape(3, 11), np.where(allowed, 0.0, -np.inf))
    tree = mx.array(np.tril(np.ones((3, 11), bool), k=8))
    first = kernel._mask_bias(tree, 3, 11)
    assert kernel._mask_bias(tree, 3, 11) is first
    again = kernel._mask_bias(mx.array(np.array(tree)), 3, 11)  # an equal mask, another array
    assert again is not first
    np.testing.assert_array_equal(np.array(again), np.array(first))


def test_the_mask_bias_is_not_shared_between_threads():
    """An array belongs to the stream of the thread that built it: another thread (a batcher
    worker restarted after a crash) gets its own bias, and evaluates it."""
    import threading

    mine = kernel._mask_bias("causal", 2, 9)
    got = {}

    def other():
        b = kernel._mask_bias("causal", 2, 9)
        got["same"] = b is mine
        got["value"] = np.array(b)

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert got["same"] is False
    np.testing.assert_array_equal(got["value"], np.array(mine))
