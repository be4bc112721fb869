"""Every Metal kernel at every dtype a Mac gives it, through its dispatcher with Metal stood in
for by the C++ emulation (edgespec.kernels.emulate.standing_in): the dispatcher takes its Metal
path, the kernel's exact source runs, and the result equals the pure-MLX reference. A Mac's KV
caches are half (bfloat16 for bfloat16 checkpoints), so the gather runs at float16 and bfloat16;
the expert kernels read activations and weights in the model's dtype; the exact and delta-rule
kernels are handed float32 whatever the model's dtype (their dispatchers cast). Also: the
emulator's half and bfloat round as Metal does (to nearest, ties to even)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from edgespec.kernels import emulate, exact, verdicts
from edgespec.kernels.delta import delta_rule_metal
from edgespec.kernels.delta_reference import delta_recurrent
from edgespec.kernels.experts import expert_glu_metal, expert_glu_reference
from edgespec.kernels.kv import kv_gather, kv_gather_reference
from edgespec.kernels.spec import KernelSpec
from edgespec.kernels.tree import tree_accept, tree_accept_reference, tree_mask, tree_mask_reference

pytestmark = pytest.mark.skipif(emulate.compiler() is None, reason="no C++ compiler to emulate Metal kernels")

FLOATS = (mx.float32, mx.float16, mx.bfloat16)


@pytest.fixture(scope="module")
def emu_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("emu")


@pytest.fixture
def mac(emu_dir, tmp_path, monkeypatch):
    """Metal stood in for; verdicts kept in a throwaway home. Yields {kernel name: stand-in}."""
    monkeypatch.setenv("EDGESPEC_HOME", str(tmp_path / "home"))
    verdicts.forget()
    with emulate.standing_in(emu_dir) as made:
        yield made
    verdicts.forget()


def _bits(a: mx.array) -> np.ndarray:
    return np.array(a.view(mx.uint16) if a.dtype in (mx.float16, mx.bfloat16) else a)


# ---------------------------------------------------------------- the emulator's 16-bit floats

CONVERT = KernelSpec("edgespec_test_convert", ("x",), ("h", "b", "hh", "bb"), """
    uint i = thread_position_in_grid.x;
    h[i] = x[i];
    b[i] = x[i];
    half p = h[i];
    bfloat q = b[i];
    hh[i] = float(p * p);
    bb[i] = float(q + q * q);
""")


def test_half_and_bfloat_round_as_metal_does(emu_dir):
    rng = np.random.default_rng(0)
    edge = [0.0, -0.0, 1.0, 65504.0, 65519.99, 65520.0, 1e6, -1e6, np.inf, -np.inf, np.nan, 2.0 ** -24,
            2.0 ** -25, 1.5 * 2.0 ** -25, 2.0 ** -14 - 2.0 ** -25, 6e-8, 1.0 + 2.0 ** -11, 1.0 + 3 * 2.0 ** -11,
            1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -8, 3.3895e38]
    x = np.concatenate([np.array(edge, np.float32),
                        (rng.standard_normal(4000) * 2.0 ** rng.integers(-30, 20, 4000)).astype(np.float32),
                        rng.integers(0, 2 ** 32, 4000, dtype=np.uint64).astype(np.uint32).view(np.float32)])
    k = emulate.EmulatedKernel(CONVERT, [np.float32], [np.float16, emulate.BFLOAT16, np.float32, np.float32],
                               emu_dir)
    h, b, hh, bb = k([x], (x.size, 1, 1), [x.shape] * 4)
    with np.errstate(all="ignore"):
        want_h = x.astype(np.float16)
        np.testing.assert_array_equal(h.view(np.uint16)[~np.isnan(x)], want_h.view(np.uint16)[~np.isnan(x)])
        assert np.isnan(h[np.isnan(x)]).all()
        np.testing.assert_array_equal(hh, (want_h * want_h).astype(np.float32))  # half * half is half
    want_b = mx.array(x).astype(mx.bfloat16)
    fin = ~np.isnan(x)
    np.testing.assert_array_equal(b[fin], _bits(want_b)[fin])
    assert (b[~fin] == 0x7FC0).all()
    q = want_b
    np.testing.assert_array_equal(bb[fin], np.array((q + q * q).astype(mx.float32))[fin])


# ---------------------------------------------------------------- each kernel at each dtype


@pytest.mark.parametrize("dtype", FLOATS, ids=["float32", "float16", "bfloat16"])
def test_kv_gather_at_each_cache_dtype(mac, dtype):
    rng = np.random.default_rng(1)
    src = mx.array(rng.standard_normal((2, 3, 17, 24)).astype(np.float32) * 300).astype(dtype)
    idx = mx.array([3, 9, 4, 16, 0], dtype=mx.int32)
    got = kv_gather(src, idx)
    assert got.dtype == dtype
    np.testing.assert_array_equal(_bits(got), _bits(kv_gather_reference(src, idx)))  # bit for bit
    assert mac["edgespec_kv_gather"].calls >= 2  # the self-check's call, then this one
    assert verdicts.get("edgespec_kv_gather", str(dtype).rpartition(".")[2]).used


@pytest.mark.parametrize("parents", [[-1, 0, 1, 2], [-1, 0, 0, 1, 2, 2, 3, 0], [-1]])
def test_tree_kernels_int32(mac, parents):
    rng = np.random.default_rng(len(parents))
    p = mx.array(parents, dtype=mx.int32)
    for prefix in (0, 5):
        for a, b in zip(tree_mask(p, prefix), tree_mask_reference(p, prefix), strict=True):
            np.testing.assert_array_equal(np.array(a), np.array(b))
    for _ in range(5):
        tok = mx.array(rng.integers(0, 2, len(parents)), dtype=mx.int32)
        pred = mx.array(rng.integers(0, 2, len(parents)), dtype=mx.int32)
        np.testing.assert_array_equal(np.array(tree_accept(tok, p, pred)), np.array(tree_accept_reference(tok, p, pred)))
    assert mac["edgespec_tree_mask"].calls and mac["edgespec_tree_accept"].calls


@pytest.mark.parametrize("dtype", FLOATS, ids=["float32", "float16", "bfloat16"])
def test_exact_kernels_given_any_model_dtype(mac, dtype):
    rng = np.random.default_rng(2)
    x = mx.array(rng.standard_normal((2, 3, 40)).astype(np.float32)).astype(dtype)
    w = mx.array(rng.standard_normal((12, 40)).astype(np.float32)).astype(dtype)
    y = exact.exact_linear(x, w)
    assert y.dtype == dtype
    want = (np.array(x.astype(mx.float32), np.float64) @ np.array(w.astype(mx.float32), np.float64).T)
    np.testing.assert_allclose(np.array(y.astype(mx.float32)), want, rtol=1e-2 if dtype != mx.float32 else 1e-5,
                               atol=5e-2 if dtype != mx.float32 else 1e-5)
    q = mx.array(rng.standard_normal((1, 4, 3, 16)).astype(np.float32)).astype(dtype)
    k, v = (mx.array(rng.standard_normal((1, 2, 9, 16)).astype(np.float32)).astype(dtype) for _ in range(2))
    out = exact.exact_attention(q, k, v, 0.25, "causal")
    assert out.dtype == dtype
    f = [np.array(a.astype(mx.float32)) for a in (q, k, v)]
    np.testing.assert_allclose(np.array(out.astype(mx.float32)), exact.reference_attention(*f, 0.25, None),
                               rtol=1e-2, atol=1e-2 if dtype != mx.float32 else 1e-5)
    assert mac["edgespec_exact_linear"].calls and mac["edgespec_exact_attention"].calls


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16], ids=["float32", "float16"])
def test_delta_rule_given_any_model_dtype(mac, dtype):
    rng = np.random.default_rng(3)
    B, T, H, Hk, Dk, Dv = 1, 3, 4, 2, 32, 8
    q, k = (mx.array(rng.standard_normal((B, T, Hk, Dk)).astype(np.float32) * 0.2).astype(dtype) for _ in range(2))
    v = mx.array(rng.standard_normal((B, T, H, Dv)).astype(np.float32)).astype(dtype)
    g = mx.array(-rng.random((B, T, H)).astype(np.float32)).astype(dtype)
    beta = mx.array(rng.random((B, T, H)).astype(np.float32)).astype(dtype)
    S = mx.array(rng.standard_normal((B, H, Dk, Dv)).astype(np.float32) * 0.1)
    out, state = delta_rule_metal(q, k, v, g, beta, S, [-1, 0, 0])
    f = [a.astype(mx.float32) for a in (q, k, v, g, beta)]
    want_out, want_state = delta_recurrent(mx.repeat(f[0], 2, axis=2), mx.repeat(f[1], 2, axis=2), *f[2:], S,
                                           [-1, 0, 0])
    np.testing.assert_allclose(np.array(out), np.array(want_out), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.array(state), np.array(want_state), rtol=1e-4, atol=1e-5)
    assert mac["edgespec_gated_delta_32"].calls >= 2


@pytest.mark.parametrize("x_dtype", FLOATS, ids=["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("fmt", ["dense", "q4", "q8"])
def test_expert_kernels_at_each_dtype(mac, x_dtype, fmt):
    rng = np.random.default_rng(4)
    E, F, X = 64, 64, 4
    x = mx.array(rng.standard_normal((2, E)).astype(np.float32)).astype(x_dtype)
    idx = mx.array([[1, 3], [0, 1]], dtype=mx.uint32)

    def proj(rows, cols):
        w = mx.array(rng.standard_normal((X, rows, cols)).astype(np.float32) * cols ** -0.5)
        if fmt == "dense":
            return {"weight": w.astype(x_dtype)}
        wq, s, b = mx.quantize(w, group_size=32, bits=int(fmt[1:]))
        return {"weight": wq, "scales": s.astype(x_dtype), "biases": b.astype(x_dtype), "group_size": 32,
                "bits": int(fmt[1:])}

    projs = proj(F, E), proj(F, E), proj(E, F)
    got = expert_glu_metal(x, idx, *projs, "silu")
    assert got.dtype == x_dtype
    # (the CPU's gather_mm is float32 only: the reference runs on the same values upcast)
    up32 = [{k: v.astype(mx.float32) if k in ("scales", "biases") or fmt == "dense" and k == "weight" else v
             for k, v in p.items()} for p in projs]
    want = expert_glu_reference(x.astype(mx.float32), idx, *up32, "silu").astype(x_dtype)
    tol = 1e-4 if x_dtype == mx.float32 else 3e-2
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32)), rtol=tol, atol=tol)
    name = "edgespec_expert_gate_up" + ("" if fmt == "dense" else "_q")
    assert mac[name].calls >= 2 and all(v.used for v in verdicts.all_verdicts())
