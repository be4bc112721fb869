"""edgespec.kernels.linear.Linear: nn.Linear's results and parameters, another BLAS call."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

import edgespec.kernels.linear as lin
from edgespec.kernels import cpu_blas


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
    the CBLAS shim's few-row kernel in the process (taking 1..`native` rows), calls it takes keep
    MLX's `x @ W.T` (both forms reach the kernel, with the same bits: tests/test_cpu_blas.py)."""
    monkeypatch.setattr(cpu_blas, "_TAKEN", (1 << native) - 1)
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


@pytest.mark.parametrize("bias", [False, True])
def test_a_kept_transposed_view_gives_the_same_bits_and_follows_the_weight(monkeypatch, bias):
    """keep_transposed (models loaded for inference): the products read a kept view of W.T,
    bit for bit what nn.Linear computes; the view is no parameter, and a weight replaced
    afterwards (training, `update`) is what the next product uses, not the old view."""
    monkeypatch.setattr(cpu_blas, "_TAKEN", 0xFFFFFFFF)  # decoding-sized calls take MLX's form
    mx.random.seed(2)
    holder = nn.Sequential(lin.Linear(48, 80, bias=bias), nn.ReLU(), lin.Linear(80, 8))
    ref = nn.Sequential(nn.Linear(48, 80, bias=bias), nn.ReLU(), nn.Linear(80, 8))
    ref.update(holder.parameters())
    assert lin.keep_transposed(holder) == 2
    assert "_transposed" in holder.layers[0].__dict__
    names = {k for k, _ in tree_flatten(holder.parameters())}
    assert not any("_transposed" in k for k in names)
    for shape in [(1, 1, 48), (4, 48), (1, 20, 48), (200, 48)]:
        x = mx.random.normal(shape)
        assert mx.array_equal(holder(x), ref(x)).item()
    # training swaps the weights: the gradient is the weight's, and the stale view is dropped
    x = mx.random.normal((3, 48))
    g1 = nn.value_and_grad(holder, lambda m: m(x).square().sum())(holder)[1]
    g2 = nn.value_and_grad(ref, lambda m: m(x).square().sum())(ref)[1]
    np.testing.assert_allclose(np.array(g1["layers"][0]["weight"]), np.array(g2["layers"][0]["weight"]),
                               rtol=1e-5, atol=1e-5)
    lin.keep_transposed(holder)
    new = {"layers": [{"weight": holder.layers[0].weight * 2}, {}, {}]}
    holder.update(new)
    ref.update(new)
    assert mx.array_equal(holder(x), ref(x)).item()
    assert "_transposed" not in holder.layers[0].__dict__
    assert "_transposed" in holder.layers[2].__dict__  # untouched: still kept
