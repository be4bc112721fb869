"""Each kernel's exact Metal source, compiled as C++ against metal_emu.h, equals its pure-MLX reference."""

from __future__ import annotations

import random

import mlx.core as mx
import numpy as np
import pytest

from edgespec.kernels import (
    KERNELS,
    KV_GATHER,
    TREE_ACCEPT,
    TREE_MASK,
    check_parents,
    commit_kv,
    emulate,
    kv_gather,
    kv_gather_reference,
    tree_accept,
    tree_accept_reference,
    tree_mask,
    tree_mask_reference,
)
from edgespec.kernels.spec import metal

needs_cxx = pytest.mark.skipif(
    emulate.compiler() is None, reason="no C++ compiler to emulate Metal kernels"
)


def random_tree(rng: random.Random, T: int, shape: str = "random") -> list[int]:
    if shape == "chain":
        return [-1] + list(range(T - 1))
    if shape == "star":
        return [-1] + [0] * (T - 1)
    return [-1] + [rng.randrange(t) for t in range(1, T)]


@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    if emulate.compiler() is None:
        pytest.skip("no C++ compiler to emulate Metal kernels")
    d = tmp_path_factory.mktemp("metal_emu")
    return {
        "mask": emulate.EmulatedKernel(TREE_MASK, [np.int32, np.int32], [np.bool_, np.int32], d),
        "accept": emulate.EmulatedKernel(TREE_ACCEPT, [np.int32] * 4, [np.int32], d),
        "gather": emulate.EmulatedKernel(
            KV_GATHER, [np.float32, np.int32, np.int32], [np.float32], d
        ),
    }


CASES = [(1, 0), (1, 5), (2, 0), (3, 1), (7, 0), (16, 3), (33, 64), (64, 257)]


@needs_cxx
@pytest.mark.parametrize("T,P", CASES)
@pytest.mark.parametrize("shape", ["random", "chain", "star"])
def test_tree_mask_emulated_equals_reference(emu, T, P, shape):
    rng = random.Random(T * 1000 + P)
    parents = random_tree(rng, T, shape)
    # Outputs start as garbage-like 1s/-7s: every entry must be written by the kernel.
    mask, pos = emu["mask"](
        [np.array(parents), np.array([T, P])], (P + T, T, 1), [(T, P + T), (T,)], init=1
    )
    ref_mask, ref_pos = tree_mask_reference(mx.array(parents, dtype=mx.int32), P)
    np.testing.assert_array_equal(mask, np.array(ref_mask))
    np.testing.assert_array_equal(pos, np.array(ref_pos))
    # Semantics, independent of both: a chain is causal, a star sees only the root and itself.
    if shape == "chain":
        np.testing.assert_array_equal(mask[:, P:], np.tril(np.ones((T, T), bool)))
        np.testing.assert_array_equal(pos, P + np.arange(T))
    if shape == "star" and T > 2:
        assert not mask[2, P + 1] and mask[2, P] and mask[2, P + 2]


@needs_cxx
@pytest.mark.parametrize("T", [1, 2, 5, 20, 90])
@pytest.mark.parametrize("vocab", [2, 3, 50])
def test_tree_accept_emulated_equals_reference(emu, T, vocab):
    rng = random.Random(T * 7 + vocab)
    for _ in range(5):
        parents = random_tree(rng, T)
        tokens = np.array([rng.randrange(vocab) for _ in range(T)], np.int32)
        pred = np.array([rng.randrange(vocab) for _ in range(T)], np.int32)
        (res,) = emu["accept"](
            [tokens, np.array(parents), pred, np.array([T])], (1, 1, 1), [(3,)], init=-9
        )
        ref = tree_accept_reference(
            mx.array(tokens), mx.array(parents, dtype=mx.int32), mx.array(pred)
        )
        np.testing.assert_array_equal(res, np.array(ref))


def test_tree_accept_finds_the_deepest_matching_path():
    # Tree: 0 -> 1 -> 2 -> 3 and 0 -> 4 -> 5; predictions accept 1, 2 but not 3; 4, 5 all match.
    parents = [-1, 0, 1, 2, 0, 4]
    tokens = [9, 11, 12, 99, 21, 22]
    pred = [11, 12, 13, 0, 22, 23]  # argmax after each node
    pred[0] = 21  # the verifier's choice after x0 is 21: branch 1 fails at once
    best, depth, bonus = tree_accept_reference(
        mx.array(tokens), mx.array(parents), mx.array(pred)
    ).tolist()
    assert (best, depth, bonus) == (5, 2, 23)
    pred[0] = 11
    best, depth, bonus = tree_accept_reference(
        mx.array(tokens), mx.array(parents), mx.array(pred)
    ).tolist()
    assert (best, depth, bonus) == (2, 2, 13)


@needs_cxx
@pytest.mark.parametrize(
    "shape,idx",
    [((1, 1, 1, 1), [0]), ((1, 3, 20, 8), [3, 5, 9]), ((2, 2, 300, 64), [0, 7, 8, 299])],
)
def test_kv_gather_emulated_equals_reference(emu, shape, idx):
    src = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    B, H, C, D = shape
    n = len(idx)
    (out,) = emu["gather"](
        [src, np.array(idx), np.array([C, D, n])], (D, n, B * H), [(B, H, n, D)], init=np.nan
    )
    np.testing.assert_array_equal(out, np.array(kv_gather_reference(mx.array(src), mx.array(idx))))


def test_dispatchers_use_the_reference_off_metal():
    parents = mx.array([-1, 0, 0, 1], dtype=mx.int32)
    m1, p1 = tree_mask(parents, 3)
    m2, p2 = tree_mask_reference(parents, 3)
    assert mx.array_equal(m1, m2) and mx.array_equal(p1, p2)
    assert p1.tolist() == [3, 4, 4, 5]
    src = mx.arange(2 * 5 * 3).reshape(1, 2, 5, 3).astype(mx.float32)
    assert mx.array_equal(kv_gather(src, mx.array([1, 4])), src[:, :, mx.array([1, 4])])


def test_commit_kv_packs_accepted_entries():
    from edgespec.caches.kv import KVCache

    c = KVCache()
    k = mx.arange(1 * 1 * 6 * 2).reshape(1, 1, 6, 2).astype(mx.float32)
    c.update_and_fetch(k, k + 100)
    commit_kv([c], 1, [0, 2, 4])  # the step wrote positions 1..5; keep 1, 3, 5
    keys, values = c.state
    assert c.offset == 4
    assert keys[0, 0, :, 0].tolist() == [0, 2, 6, 10]
    assert values[0, 0, :, 0].tolist() == [100, 102, 106, 110]


def test_check_parents_rejects_bad_trees():
    check_parents([-1, 0, 1, 0])
    for bad in ([], [0], [-1, 1], [-1, 0, 5], [-1, -1]):
        with pytest.raises(ValueError, match="parent"):
            check_parents(bad)


def test_emulated_signature_matches_metal_kernel_convention():
    sig = emulate.signature(TREE_MASK, ["int32_t", "int32_t"], ["bool", "int32_t"])
    assert "const device int32_t* parents [[buffer(0)]]" in sig
    assert "device bool* mask [[buffer(2)]]" in sig
    assert "uint3 thread_position_in_grid [[thread_position_in_grid]]" in sig


@pytest.mark.metal
@pytest.mark.parametrize("T,P", CASES)
def test_metal_tree_kernels_equal_reference(T, P):
    rng = random.Random(T + P)
    parents = mx.array(random_tree(rng, T), dtype=mx.int32)
    mask, pos = metal(TREE_MASK)(
        inputs=[parents, mx.array([T, P], dtype=mx.int32)],
        grid=(P + T, T, 1),
        threadgroup=(min(P + T, 256), 1, 1),
        output_shapes=[(T, P + T), (T,)],
        output_dtypes=[mx.bool_, mx.int32],
    )
    rm, rp = tree_mask_reference(parents, P)
    assert mx.array_equal(mask, rm) and mx.array_equal(pos, rp)
    tokens = mx.random.randint(0, 3, (T,)).astype(mx.int32)
    pred = mx.random.randint(0, 3, (T,)).astype(mx.int32)
    assert mx.array_equal(
        tree_accept(tokens, parents, pred), tree_accept_reference(tokens, parents, pred)
    )


@pytest.mark.metal
def test_metal_kv_gather_equals_reference():
    src = mx.random.normal((1, 3, 300, 64))
    idx = mx.array([0, 5, 6, 299], dtype=mx.int32)
    assert mx.array_equal(kv_gather(src, idx), kv_gather_reference(src, idx))
    assert len(KERNELS) == 3
