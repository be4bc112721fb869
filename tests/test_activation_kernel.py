"""The CPU prompt-chunk MLP activation (edgespec.kernels.activation) against MLX's own."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

import edgespec.kernels.activation as act

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
