"""The CPU prompt-chunk MLP activation (edgespec.kernels.activation) against MLX's own."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

import edgespec.kernels.activation as act
from edgespec.kernels import base2

ON_CPU = mx.default_device() == mx.cpu


def _gate_up(rows, F=96, dtype=mx.float32, seed=0):
    mx.random.seed(seed)
    gate = (mx.random.normal((2, rows, F)) * 4).astype(dtype)  # tails past +-10 reach exp's edges
    up = mx.random.normal((2, rows, F)).astype(dtype)
    return gate, up


@pytest.mark.parametrize("kind,ref", [("silu", nn.silu), ("gelu_pytorch_tanh", nn.gelu_approx)])
def test_numpy_activation_matches_mlx(kind, ref):
    gate, up = _gate_up(act.CPU_NUMPY_MIN_ROWS + 3)
    gate = mx.concatenate([gate, mx.array([[[-200.0, 200.0] + [0.0] * 94] * 1] * 2)], axis=1)  # overflow edge
    up = mx.concatenate([up, mx.ones((2, 1, 96))], axis=1)
    assert act.use_numpy_activation(kind, gate) == ON_CPU
    out = act.gated_activation(kind, gate, up, inference=True)
    assert out.shape == gate.shape and out.dtype == mx.float32
    np.testing.assert_allclose(np.array(out), np.array(ref(gate) * up), rtol=2e-5, atol=2e-6)
    assert np.isfinite(np.array(out)).all()


def test_half_precision_comes_back_in_its_dtype():
    gate, up = _gate_up(act.CPU_NUMPY_MIN_ROWS, dtype=mx.bfloat16)
    out = act.gated_activation("silu", gate, up, inference=True)
    assert out.dtype == mx.bfloat16
    ref = nn.silu(gate.astype(mx.float32)) * up.astype(mx.float32)
    np.testing.assert_allclose(np.array(out.astype(mx.float32)), np.array(ref), rtol=2e-2, atol=2e-2)


def test_short_calls_exact_gelu_and_training_keep_mlx(monkeypatch):
    """Verification rounds (< CPU_NUMPY_MIN_ROWS rows), the exact erf GELU (numpy has no erf)
    and any call without inference=True stay in MLX's graph: differentiable."""
    gate, up = _gate_up(act.CPU_NUMPY_MIN_ROWS)
    assert not act.use_numpy_activation("silu", gate[:, :1])  # 2 rows
    assert not act.use_numpy_activation("gelu", gate)
    calls = []
    monkeypatch.setitem(act._NUMPY, "silu", lambda *a: calls.append(1))
    g = mx.grad(lambda x: act.gated_activation("silu", x, up).sum())(gate)
    assert not calls
    sig = mx.sigmoid(gate)
    np.testing.assert_allclose(np.array(g), np.array(up * (sig + gate * sig * (1 - sig))), rtol=1e-4, atol=1e-5)
    if ON_CPU:
        act.gated_activation("silu", gate, up, inference=True)
        assert calls  # the same call with inference=True takes numpy


def test_a_model_prefill_uses_it_and_training_does_not(monkeypatch):
    """A tiny model's prefill (with a cache) goes through the numpy activation and gives the
    logits of the MLX path; a call without a cache keeps the MLP's gradients."""
    from conftest import make_tiny_model

    from edgespec.generate import prefill

    model = make_tiny_model(4)
    toks = np.random.default_rng(3).integers(0, 64, 300).tolist()
    taken = []
    real = act._silu_times
    monkeypatch.setitem(act._NUMPY, "silu", lambda *a: (taken.append(a[0].shape), real(*a)))
    logits = {}
    for name, rows in (("numpy", act.CPU_NUMPY_MIN_ROWS), ("mlx", 1 << 62)):
        monkeypatch.setattr(act, "CPU_NUMPY_MIN_ROWS", rows)
        logits[name] = prefill(model, model.make_cache(), toks, chunk=128)
    assert bool(taken) == ON_CPU
    np.testing.assert_allclose(np.array(logits["numpy"]), np.array(logits["mlx"]), rtol=1e-4, atol=1e-4)

    monkeypatch.setattr(act, "CPU_NUMPY_MIN_ROWS", 1)
    taken.clear()
    x = mx.array([toks[:100]])
    _, grads = nn.value_and_grad(model, lambda: model(x)[0, -1].sum())()
    assert not taken
    assert float(mx.abs(grads["model"]["layers"][0]["mlp"]["gate_proj"]["weight"]).max()) > 0


@pytest.mark.parametrize("kind", ["silu", "gelu_pytorch_tanh"])
def test_base2_activation_matches_float64_and_keeps_its_edges(kind):
    """The CPU device's float32 SiLU and tanh GELU through power(2, .) (MLX's CPU exp is scalar):
    within float32 rounding of the float64 definition over -120..120, finite at the overflow
    edges, -0 and 0 kept; other dtypes keep MLX's own."""
    x = np.concatenate([np.linspace(-120, 120, 40001), [-1e30, 1e30, -200.0, 200.0, 0.0, -1e-30]]).astype(np.float32)
    xd = x.astype(np.float64)
    with np.errstate(over="ignore"):
        if kind == "silu":
            want = xd / (1 + np.exp(-xd))
        else:
            want = 0.5 * xd * (1 + np.tanh(np.sqrt(2 / np.pi) * (xd + 0.044715 * xd**3)))
    got = np.array(act.activate(kind, mx.array(x))).astype(np.float64)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=4e-6, atol=2e-6)
    mlx_own = {"silu": nn.silu, "gelu_pytorch_tanh": nn.gelu_approx}[kind]
    half = mx.array(x[:1000]).astype(mx.bfloat16)
    out = act.activate(kind, half)
    assert out.dtype == mx.bfloat16
    np.testing.assert_array_equal(np.array(out.astype(mx.float32)), np.array(mlx_own(half).astype(mx.float32)))
    if ON_CPU:  # the float32 path is not MLX's own formula: the dispatch is visible
        assert not np.array_equal(got, np.array(mlx_own(mx.array(x))).astype(np.float64))


def test_base2_sigmoid_matches_float64_and_other_dtypes_keep_mlx():
    x = np.concatenate([np.linspace(-120, 120, 40001), [-1e30, 1e30, 0.0]]).astype(np.float32)
    with np.errstate(over="ignore"):
        want = 1 / (1 + np.exp(-x.astype(np.float64)))
    got = np.array(base2.sigmoid(mx.array(x)))
    assert got.dtype == np.float32 and np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=4e-6, atol=2e-7)
    half = mx.array(x[:100]).astype(mx.float16)
    assert base2.sigmoid(half).dtype == mx.float16
    np.testing.assert_array_equal(np.array(base2.sigmoid(half)), np.array(mx.sigmoid(half)))


def test_the_off_switch_gives_mlx_own_everywhere(monkeypatch):
    """EDGESPEC_BASE2=0 (read at import into base2.ENABLED): MLX's own activations and the
    fused attention kernel, bitwise."""
    from edgespec.kernels.attention import attention, grouped_attention

    monkeypatch.setattr(base2, "ENABLED", False)
    x = mx.array(np.linspace(-30, 30, 999).astype(np.float32))
    np.testing.assert_array_equal(np.array(act.activate("silu", x)), np.array(nn.silu(x)))
    np.testing.assert_array_equal(np.array(act.activate("gelu_pytorch_tanh", x)), np.array(nn.gelu_approx(x)))
    np.testing.assert_array_equal(np.array(base2.sigmoid(x)), np.array(mx.sigmoid(x)))
    q, k, v = (mx.random.normal(s) for s in ((1, 4, 3, 16), (1, 2, 20, 16), (1, 2, 20, 16)))
    assert grouped_attention(q, k, v, 0.25, "causal") is None
    np.testing.assert_array_equal(np.array(attention(q, k, v, 0.25, "causal")),
                                  np.array(mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask="causal")))
