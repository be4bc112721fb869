"""The MoE experts' Metal kernels (edgespec.kernels.experts), their exact source compiled as C++,
against MLX's gathered matmuls (SwitchGLU's path): dense float32 and 2/4/8-bit affine weights."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from edgespec.kernels import emulate
from edgespec.kernels.experts import MAX_TOKENS, expert_glu_reference, kernel_applies, launch_args

_compiled: dict = {}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Runs both kernels of a call through the emulation: -> y (N, k, E)."""
    if emulate.compiler() is None:
        pytest.skip("no C++ compiler to emulate Metal kernels")
    folder = tmp_path_factory.mktemp("experts")

    def go(x, idx, gate, up, down, act, init=np.nan):
        (s1, in1, g1, sh1), (s2, in2, g2, sh2) = launch_args(x, idx, gate, up, down, act)
        in2 = [np.zeros(sh1, np.float32)] + in2  # h's dtype, for the signature
        outs = []
        for spec, ins, grid, shape in ((s1, in1, g1, sh1), (s2, in2, g2, sh2)):
            if outs:
                ins = [outs[-1]] + ins[1:]
            key = (spec.name, tuple(a.dtype.str for a in ins))
            if key not in _compiled:
                _compiled[key] = emulate.EmulatedKernel(spec, [a.dtype for a in ins], [np.float32], folder)
            (out,) = _compiled[key](ins, grid, [shape], init=init)  # nan: every element must be written
            outs.append(out)
        return outs[-1]

    return go


def layer(N, K, X, E, F, seed=0, bits=None, group=32):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((N, E)).astype(np.float32)
    idx = np.stack([rng.choice(X, K, replace=False) for _ in range(N)]).astype(np.int32)
    shapes = {"gate": (X, F, E), "up": (X, F, E), "down": (X, E, F)}
    projs = {}
    for name, shape in shapes.items():
        w = (rng.standard_normal(shape) * shape[-1] ** -0.5 * 2).astype(np.float32)
        if bits is None:
            projs[name] = {"weight": w}
        else:
            q, s, b = mx.quantize(mx.array(w), group, bits)
            projs[name] = {"weight": np.array(q), "scales": np.array(s), "biases": np.array(b),
                           "group_size": group, "bits": bits}
    return x, idx, projs


def as_mx(x, idx, projs):
    conv = {n: {k: (mx.array(v) if isinstance(v, np.ndarray) else v) for k, v in p.items()} for n, p in projs.items()}
    return mx.array(x), mx.array(idx), conv["gate"], conv["up"], conv["down"]


SHAPES = [(1, 2, 4, 32, 16), (4, 3, 8, 64, 40), (MAX_TOKENS, 8, 16, 64, 96)]  # N, k, experts, hidden, width


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "N{}k{}X{}E{}F{}".format(*s))
@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
def test_dense_emulated_equals_gather_mm(run, shape, act):
    x, idx, p = layer(*shape, seed=shape[0])
    got = run(x, idx, p["gate"], p["up"], p["down"], act)
    want = np.array(expert_glu_reference(*as_mx(x, idx, p), act))
    assert got.shape == want.shape == (shape[0], shape[1], shape[3])
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_dense_matches_the_definition(run):
    """Independent of MLX: y[n, j] = W_down[e] (silu(W_gate[e] x_n) * W_up[e] x_n), e = idx[n, j]."""
    x, idx, p = layer(3, 2, 5, 32, 24, seed=7)
    got = run(x, idx, p["gate"], p["up"], p["down"], "silu")
    for n in range(3):
        for j in range(2):
            e = idx[n, j]
            g, u = p["gate"]["weight"][e] @ x[n], p["up"]["weight"][e] @ x[n]
            want = p["down"]["weight"][e] @ (g / (1 + np.exp(-g)) * u)
            np.testing.assert_allclose(got[n, j], want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("shape", [(1, 2, 4, 64, 64), (5, 4, 8, 128, 192)], ids=lambda s: "N{}k{}X{}E{}F{}".format(*s))
@pytest.mark.parametrize("bits,group", [(4, 32), (4, 64), (2, 64), (8, 32)])
def test_quantized_emulated_equals_gather_qmm(run, shape, bits, group):
    x, idx, p = layer(*shape, seed=group + bits, bits=bits, group=group)
    got = run(x, idx, p["gate"], p["up"], p["down"], "silu")
    want = np.array(expert_glu_reference(*as_mx(x, idx, p), "silu"))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_a_token_gets_the_same_numbers_alone_or_in_a_verify_pass(run):
    """Decoding steps (one token) and verify passes (several) must agree bit for bit."""
    x, idx, p = layer(6, 3, 8, 32, 16, seed=2)
    whole = run(x, idx, p["gate"], p["up"], p["down"], "silu")
    for n in range(6):
        alone = run(x[n : n + 1], idx[n : n + 1], p["gate"], p["up"], p["down"], "silu")
        np.testing.assert_array_equal(alone[0], whole[n])


def test_the_kernels_apply_to_few_tokens_and_known_formats():
    x, idx, p = layer(2, 2, 4, 64, 32, bits=4)
    q = [p[n] for n in ("gate", "up", "down")]
    dense = [{"weight": v["weight"]} for v in q]
    assert kernel_applies(idx, *dense, "silu") and kernel_applies(idx, *q, "gelu_pytorch_tanh")
    assert not kernel_applies(np.zeros((MAX_TOKENS + 1, 2), np.int32), *dense, "silu")  # a prompt chunk
    assert not kernel_applies(idx, *dense, "gelu")  # erf: not in Metal's library
    assert kernel_applies(idx, *[dict(v, bits=8) for v in q], "silu")
    assert not kernel_applies(idx, *[dict(v, bits=3) for v in q], "silu")  # 3-bit values straddle words
    assert not kernel_applies(idx, *[dict(v, mode="mxfp4") for v in q], "silu")
    assert not kernel_applies(idx, q[0], q[1], dict(q[2], bits=8), "silu")  # widths differ
    assert not kernel_applies(idx, q[0], *dense[1:], "silu")  # mixed formats


@pytest.mark.metal
def test_metal_switch_glu_equals_gather_mm():
    from edgespec.kernels.experts import expert_glu_metal

    for bits in (None, 4, 8):
        x, idx, p = layer(4, 2, 8, 128, 64, bits=bits, group=64)
        args = as_mx(x, idx, p)
        np.testing.assert_allclose(np.array(expert_glu_metal(*args, "silu")),
                                   np.array(expert_glu_reference(*args, "silu")), rtol=1e-4, atol=1e-4)
