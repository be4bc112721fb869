"""edgespec.kernels.linear.Linear: nn.Linear's results and parameters, another BLAS call."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

import edgespec.kernels.linear as lin


@pytest.mark.parametrize("shape", [(1, 1, 48), (3, 48), (2, 5, 48), (1, lin.CPU_SWAP_MAX_ROWS, 48), (2, 40, 48)])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_the_definition(shape, bias):
    mx.random.seed(0)
    layer = lin.Linear(48, 80, bias=bias)
    x = mx.random.normal(shape)
    ref = np.array(x) @ np.array(layer.weight).T + (np.array(layer.bias) if bias else 0)
    out = layer(x)
    assert out.shape == shape[:-1] + (80,)
    np.testing.assert_allclose(np.array(out), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("native", [0, 16])
def test_few_rows_take_the_swapped_product_on_the_cpu(monkeypatch, native):
    """The few-row form is what runs for decoding-sized calls on the CPU, and only there; with
    the CBLAS shim's few-row kernel in the process (NATIVE_FEW_ROWS rows), calls it takes keep
    MLX's `x @ W.T` (both forms reach the kernel, with the same bits: tests/test_cpu_blas.py)."""
    monkeypatch.setattr(lin, "NATIVE_FEW_ROWS", native)
    layer = lin.Linear(16, 8)
    calls = []
    real = nn.Linear.__call__
    monkeypatch.setattr(nn.Linear, "__call__", lambda self, x: calls.append(x.shape) or real(self, x))
    layer(mx.zeros((2, 3, 16)))  # 6 rows
    assert (calls == []) == (mx.default_device() == mx.cpu and not native)
    calls.clear()
    layer(mx.zeros((1, 17, 16)))  # past the kernel's rows: the swapped form on the CPU
    assert (calls == []) == (mx.default_device() == mx.cpu)
    layer(mx.zeros((1, lin.CPU_SWAP_MAX_ROWS + 1, 16)))  # a prompt chunk: MLX's product
    assert calls[-1] == (1, lin.CPU_SWAP_MAX_ROWS + 1, 16)


def test_parameters_gradients_and_quantization_are_nn_linears():
    mx.random.seed(1)
    layer, ref = lin.Linear(32, 64), nn.Linear(32, 64)
    ref.update(layer.parameters())
    x = mx.random.normal((4, 32))
    g1 = nn.value_and_grad(layer, lambda m: m(x).square().sum())(layer)[1]
    g2 = nn.value_and_grad(ref, lambda m: m(x).square().sum())(ref)[1]
    np.testing.assert_allclose(np.array(g1["weight"]), np.array(g2["weight"]), rtol=1e-4, atol=1e-4)
    holder = nn.Sequential(lin.Linear(64, 64))
    nn.quantize(holder, group_size=32, bits=4)
    assert isinstance(holder.layers[0], nn.QuantizedLinear)
