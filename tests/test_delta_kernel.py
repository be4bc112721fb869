"""The gated delta rule's Metal kernel (edgespec.kernels.delta), its exact source compiled as C++,
against the MLX reference edgespec.caches.recurrent.delta_recurrent: chains and tree passes."""

from __future__ import annotations

import random

import mlx.core as mx
import numpy as np
import pytest

from edgespec.caches.recurrent import RECURRENT_MAX, delta_recurrent, delta_rule
from edgespec.kernels import emulate
from edgespec.kernels.delta import DELTA_RULE, delta_spec, emulator_inputs, tree_slots

F32, I32 = np.float32, np.int32


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    """The emulated kernel, compiled with the column size delta_rule_metal would pick for Dk."""
    if emulate.compiler() is None:
        pytest.skip("no C++ compiler to emulate Metal kernels")
    folder, built = tmp_path_factory.mktemp("delta"), {}

    def run(ins, grid, shapes, init):
        spec = delta_spec(int(ins[1].shape[-1]))
        if spec not in built:
            built[spec] = emulate.EmulatedKernel(spec, [F32] * 6 + [I32] * 3, [F32] * 3, folder)
        return built[spec](ins, grid, shapes, init=init)

    return run


def inputs(B, T, Hk, H, Dk, Dv, seed=0):
    """What Qwen3.5's layer feeds the rule: q, k L2-normed (q scaled by Dk^-0.5), Hk heads;
    g = log decay < 0, beta in (0, 1); a non-zero state before the pass."""
    rng = np.random.default_rng(seed)
    q, k = (rng.standard_normal((B, T, Hk, Dk)).astype(F32) for _ in range(2))
    q = q / np.linalg.norm(q, axis=-1, keepdims=True) * Dk**-0.5
    k = k / np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((B, T, H, Dv)).astype(F32)
    g = -rng.uniform(0.01, 2.0, (B, T, H)).astype(F32)
    beta = rng.uniform(0.05, 1.0, (B, T, H)).astype(F32)
    S = (rng.standard_normal((B, H, Dk, Dv)) * 0.5).astype(F32)
    return q, k, v, g, beta, S


def reference(q, k, v, g, beta, S, parents=None):
    r = v.shape[2] // k.shape[2]
    q, k = (np.repeat(a, r, axis=2) for a in (q, k))
    out, state = delta_recurrent(*(mx.array(a) for a in (q, k, v, g, beta, S)), parents=parents)
    return np.array(out), np.array(state)


def emulated(kernel, q, k, v, g, beta, S, parents=None):
    ins, grid, shapes = emulator_inputs(q, k, v, g, beta, S, parents)
    out, state, _ = kernel(ins, grid, shapes, init=np.nan)  # every output element must be written
    return out, state


def random_tree(rng, T):
    return [-1] + [rng.randrange(-1, t) for t in range(1, T)]


SHAPES = [  # B, T, Hk, H, Dk, Dv
    (1, 1, 2, 2, 16, 8),
    (1, 1, 2, 4, 32, 16),  # Hk < Hv: one decoding step
    (2, 5, 1, 3, 8, 24),
    (1, RECURRENT_MAX, 2, 4, 32, 16),  # the longest pass the recurrent form runs
    (1, 7, 4, 4, 128, 8),  # Qwen3.5's Dk
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}T{}Hk{}H{}Dk{}Dv{}".format(*s))
def test_chain_emulated_equals_reference(kernel, shape):
    a = inputs(*shape, seed=sum(shape))
    out, state = emulated(kernel, *a)
    want_out, want_state = reference(*a)
    np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(state, want_state, rtol=1e-5, atol=1e-5)
    assert np.abs(state - a[5]).max() > 1e-2  # the pass did move the state


@pytest.mark.parametrize("shape", [s for s in SHAPES if s[1] > 1], ids=lambda s: "B{}T{}Hk{}H{}Dk{}Dv{}".format(*s))
@pytest.mark.parametrize("form", ["random", "star", "two-chains"])
def test_tree_emulated_equals_reference(kernel, shape, form):
    T = shape[1]
    rng = random.Random(T * 31 + shape[4])
    parents = {"random": random_tree(rng, T), "star": [-1] + [0] * (T - 1),
               "two-chains": [t - 1 if t != T // 2 else -1 for t in range(T)]}[form]
    a = inputs(*shape, seed=T)
    out, state = emulated(kernel, *a, parents=parents)
    want_out, want_state = reference(*a, parents=parents)
    np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(state, want_state, rtol=1e-5, atol=1e-5)


def test_a_tree_node_sees_exactly_its_branch(kernel):
    """Independent of the reference: each node's output equals a chain pass over its root path
    (so siblings do not leak into each other through the saved states)."""
    B, T, Hk, H, Dk, Dv = 1, 9, 1, 2, 16, 8
    parents = [-1, 0, 1, 0, 3, -1, 5, 2, 6]
    a = inputs(B, T, Hk, H, Dk, Dv, seed=5)
    out, _ = emulated(kernel, *a, parents=parents)
    for t in range(T):
        path, node = [], t
        while node >= 0:
            path.append(node)
            node = parents[node]
        path = path[::-1]
        sub = [x[:, path] for x in a[:5]] + [a[5]]
        chain_out, _ = emulated(kernel, *sub)
        np.testing.assert_allclose(out[:, t], chain_out[:, -1], rtol=1e-6, atol=1e-6)


def test_a_pass_equals_its_positions_one_by_one_bit_for_bit(kernel):
    """A verify pass and the decoding steps of plain decoding must leave the same state: the
    kernel's T-position pass equals T one-position calls exactly (speculation is lossless)."""
    a = inputs(1, 6, 2, 4, 32, 16, seed=9)
    out, state = emulated(kernel, *a)
    S = a[5]
    for t in range(6):
        o, S = emulated(kernel, *[x[:, t : t + 1] for x in a[:5]], S)
        np.testing.assert_array_equal(o[:, 0], out[:, t])
    np.testing.assert_array_equal(S, state)


def test_the_column_size_follows_the_key_head_size():
    assert delta_spec(128).header == "#define EDGESPEC_DK_MAX 128\n" and delta_spec(100) == delta_spec(128)
    assert delta_spec(8).source == DELTA_RULE.source and "EDGESPEC_DK_MAX 32" in delta_spec(8).header
    with pytest.raises(ValueError, match="key head size 300"):
        delta_spec(300)


def test_scratch_holds_only_branch_points():
    assert tree_slots(None, 5) == ([-1, 0, 1, 2, 3], [-1] * 5, 0)
    par, slots, n = tree_slots([-1, 0, 1, 0, 3, -1, 5, 2], 8)
    assert n == 2 and slots == [0, -1, 1, -1, -1, -1, -1, -1]  # 0 (parent of 3), 2 (parent of 7)
    assert tree_slots([-1, 0, 1], 3)[2] == 0  # a chain given as parents: nothing saved
    for bad in ([-1, 1], [0, 0], [-1, -2]):
        with pytest.raises(ValueError, match="parents"):
            tree_slots(bad, 2)


def test_dispatcher_off_metal_is_the_reference_with_grouped_heads():
    a = inputs(1, 4, 2, 6, 16, 8, seed=3)
    out, state = delta_rule(*(mx.array(x) for x in a), parents=[-1, 0, 0, 2])
    want_out, want_state = reference(*a, parents=[-1, 0, 0, 2])
    np.testing.assert_array_equal(np.array(out), want_out)
    np.testing.assert_array_equal(np.array(state), want_state)
    with pytest.raises(ValueError, match="heads"):
        delta_rule(*(mx.array(x) for x in inputs(1, 2, 4, 6, 16, 8)))


@pytest.mark.metal
@pytest.mark.parametrize("parents", [None, [-1, 0, 0, 2, -1]])
def test_metal_kernel_equals_reference(parents):
    from edgespec.kernels.delta import delta_rule_metal

    a = inputs(1, 5, 2, 4, 128, 128, seed=1)
    out, state = delta_rule_metal(*(mx.array(x) for x in a), parents=parents)
    want_out, want_state = reference(*a, parents=parents)
    np.testing.assert_allclose(np.array(out), want_out, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.array(state), want_state, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------- the native CPU loop (off by default)


@pytest.fixture(scope="module")
def native():
    from edgespec.kernels.cpu_delta import delta_rule_cpu, kernel

    if kernel() is None:
        pytest.skip("no C compiler for the native gated delta rule")
    return delta_rule_cpu


@pytest.mark.parametrize("parents", [None, [-1, 0, 1, 0, 3, -1, 5]])
def test_native_cpu_loop_equals_reference(native, parents):
    a = inputs(2, 7, 2, 4, 32, 16, seed=11)
    out, state = native(*(mx.array(x) for x in a), parents=parents)
    want_out, want_state = reference(*a, parents=parents)
    np.testing.assert_allclose(np.array(out), want_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.array(state), want_state, rtol=1e-5, atol=1e-5)


def test_native_pass_equals_its_steps_bit_for_bit_and_training_keeps_mlx(native, monkeypatch):
    import edgespec.caches.recurrent as rec
    import edgespec.kernels.cpu_delta as cd

    a = [mx.array(x) for x in inputs(1, 5, 2, 4, 64, 64, seed=4)]
    monkeypatch.setattr(cd, "PARALLEL_MIN", 1)  # the heads split over threads for the whole pass
    out, state = native(*a)
    monkeypatch.setattr(cd, "PARALLEL_MIN", 1 << 62)  # one thread for the steps
    S = a[5]
    for t in range(5):
        o, S = native(*[x[:, t : t + 1] for x in a[:5]], S)
        assert mx.array_equal(o[:, 0], out[:, t])
    assert mx.array_equal(S, state)
    monkeypatch.setattr(rec, "CPU_NATIVE", True)
    calls = []
    monkeypatch.setattr("edgespec.kernels.cpu_delta.delta_rule_cpu", lambda *x, **kw: calls.append(1) or native(*x, **kw))
    rec.delta_rule(*a, inference=True)
    assert calls == [1]
    grad = mx.grad(lambda v: rec.delta_rule(a[0], a[1], v, *a[3:])[0].sum())(a[2])  # no cache: MLX, differentiable
    assert calls == [1] and float(mx.abs(grad).max()) > 0
