"""The native kernels of CPU long-prompt attention (edgespec/kernels/cpu_attention.c via
edgespec.kernels.native): the fused attention of a block of rows and the softmax pass
between BLAS products; built on first use, checked, and equal to numpy and to MLX's
fused kernel."""

import os
import warnings

import mlx.core as mx
import numpy as np
import pytest

from edgespec.kernels import attention as attn
from edgespec.kernels import cpu_blas, native


@pytest.fixture(scope="module")
def kernel():
    try:
        cpu_blas.compiler()
    except cpu_blas.BlasShimError as e:
        pytest.skip(f"no C compiler here: {e}")
    fn = native.softmax_rows()
    assert fn is not None, "a compiler is here, yet the kernel was not built (see the warning)"
    return fn


@pytest.fixture(scope="module")
def fused(kernel):
    return native.attention_rows()


@pytest.mark.parametrize("rows,n,D,first,group,ldv", [
    (13, 700, 64, 600, 3, 64),  # causal, grouped heads, several key tiles, a partial row group
    (6, 16, 16, 3, 2, 16),  # one panel
    (7, 300, 32, -1, 1, 48),  # no limit; values with a row stride wider than D
    (5, 40, 16, 0, 1, 16),  # the first row sees one key
    (12, 1000, 128, 990, 1, 128),  # the limit past a tile boundary, D = 128
    (25, 517, 16, 500, 5, 16),  # n not a multiple of 16, the last tile partial
])
def test_fused_kernel_matches_numpy(fused, rows, n, D, first, group, ldv):
    rng = np.random.default_rng(rows * n)
    q = (rng.standard_normal((rows, D)) * 0.4).astype(np.float32)
    k = rng.standard_normal((n, D)).astype(np.float32)
    vfull = rng.standard_normal((n, ldv)).astype(np.float32)
    v = vfull[:, :D]
    q[0] *= 8  # a row whose scores are far apart (rescaling by the running max matters)
    packed = native.pack_keys(k)
    out = np.full((rows + 1, D), 7.0, np.float32)
    assert fused(q.ctypes.data, rows, D, packed.ctypes.data, vfull.ctypes.data, ldv, n, D, first, group,
                 out.ctypes.data, D) == 0
    # float32 scores against float64 ones: row 0's large scores carry ~1e-5 relative error
    np.testing.assert_allclose(out[:rows], native.reference_attention(q, k, v, first, group), rtol=1e-4, atol=3e-5)
    assert (out[rows] == 7.0).all()  # nothing written past the block


def test_fused_kernel_with_no_rows_writes_nothing(fused):
    k = np.ones((20, 16), np.float32)
    out = np.full((1, 16), 7.0, np.float32)
    # success, not "no memory", and no pointer touched (the keys' is NULL)
    assert fused(k.ctypes.data, 0, 16, None, k.ctypes.data, 16, 20, 16, 0, 1, out.ctypes.data, 16) == 0
    assert (out == 7.0).all()


def test_packed_keys_layout():
    k = np.arange(35 * 4, dtype=np.float32).reshape(35, 4)
    p = native.pack_keys(k)
    assert p.shape == (3, 4, 16) and p.flags.c_contiguous
    assert p[1, 2, 5] == k[21, 2] and p[2, 3, 2] == k[34, 3]
    assert not p[2, :, 3:].any()  # past the last key: zeros


@pytest.mark.parametrize("rows,cols,first,group", [
    (12, 8190, -1, 1),  # a long row, no limit
    (9, 45, 30, 3),  # causal, grouped heads: rows 0-2 see 31 slots, 3-5 32, 6-8 33
    (5, 7, 0, 1),  # shorter than one vector; the first row sees one slot
    (6, 100, 98, 2),  # limits past the end are clipped
])
def test_kernel_matches_numpy(kernel, rows, cols, first, group):
    rng = np.random.default_rng(rows * cols)
    s = (rng.standard_normal((rows, cols)) * 25).astype(np.float32)
    s[1, ::3] = -np.inf  # masked slots
    want = native.reference(s, first, group)
    sums = np.full(rows, np.nan, np.float32)
    kernel(s.ctypes.data, rows, cols, cols, first, group, sums.ctypes.data)
    np.testing.assert_allclose(s, want, rtol=3e-7, atol=1e-7)
    np.testing.assert_allclose(sums, want.sum(axis=1), rtol=2e-6)  # the row totals, from the same pass
    again = s.copy()
    kernel(again.ctypes.data, rows, cols, cols, first, group, None)  # no totals asked: NULL is fine
    np.testing.assert_allclose(again, native.reference(s, first, group), rtol=3e-7, atol=1e-7)
    if first >= 0:  # nothing past a row's limit survives
        assert all(not s[r, first + r // group + 1:].any() for r in range(rows))


def test_a_row_that_sees_nothing_becomes_zeros_and_strides_are_honoured(kernel):
    s = np.full((3, 20), -np.inf, np.float32)
    s[1] = np.linspace(-5, 5, 20, dtype=np.float32)
    big = np.full((3, 32), 7.0, np.float32)  # rows 20 floats long inside rows of 32
    big[:, :20] = s
    sums = np.full(3, np.nan, np.float32)
    kernel(big.ctypes.data, 3, 20, 32, -1, 1, sums.ctypes.data)
    assert not big[0, :20].any() and not big[2, :20].any()
    assert sums[0] == 0 and sums[2] == 0  # totals of rows that see nothing: 0, not NaN
    np.testing.assert_allclose(big[1, :20], np.exp(s[1].astype(np.float64) - 5.0), rtol=3e-7)
    assert (big[:, 20:] == 7.0).all()  # beyond each row's columns: untouched


@pytest.mark.parametrize("mask", ["causal", "bool"])
def test_attention_with_the_kernel_equals_numpy_passes_and_the_fused_kernel(kernel, monkeypatch, mask):
    H, Hk, T, S, D = 6, 2, attn.BLOCK_ROWS // 3 + 50, 900, 16
    mx.random.seed(3)
    q, k, v = (mx.random.normal((1, h, n, D)) for h, n in ((H, T), (Hk, S), (Hk, S)))
    m = "causal"
    if mask == "bool":
        m = (mx.arange(S)[None] <= (S - T + mx.arange(T))[:, None]) & (mx.random.uniform(shape=(1, 1, T, S)) > 0.3)
        m = m | mx.eye(T, S, k=S - T, dtype=mx.bool_)
    ref = np.array(mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=m))
    calls = {"softmax": [], "fused": []}
    fused = native.attention_rows()
    monkeypatch.setattr(native, "softmax_rows", lambda: lambda *a: (calls["softmax"].append(a), kernel(*a)))
    monkeypatch.setattr(native, "attention_rows", lambda: lambda *a: (calls["fused"].append(a), fused(*a))[1])
    with_kernel = np.array(attn.numpy_attention(q, k, v, 0.25, m))
    # causal: the fused kernel does it all; a boolean mask: BLAS products around the softmax pass
    assert (bool(calls["fused"]), bool(calls["softmax"])) == ((True, False) if mask == "causal" else (False, True))
    monkeypatch.setattr(native, "ENABLED", False)
    without = np.array(attn.numpy_attention(q, k, v, 0.25, m))
    np.testing.assert_allclose(with_kernel, ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(with_kernel, without, rtol=1e-5, atol=1e-5)


def test_head_sizes_the_fused_kernel_cannot_take_use_the_softmax_pass(kernel, monkeypatch):
    calls = []
    monkeypatch.setattr(native, "softmax_rows", lambda: lambda *a: (calls.append(a), kernel(*a)))
    mx.random.seed(5)
    q, k, v = mx.random.normal((1, 4, 100, 24)), mx.random.normal((1, 2, 700, 24)), mx.random.normal((1, 2, 700, 24))
    got = np.array(attn.numpy_attention(q, k, v, 0.2, "causal"))
    assert calls  # D = 24 is not a multiple of 16
    ref = np.array(mx.fast.scaled_dot_product_attention(q, k, v, scale=0.2, mask="causal"))
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


def test_the_library_is_built_once_atomically_per_source_and_cpu(kernel, tmp_path):
    path = native.build(tmp_path)
    assert path.parent == tmp_path / "kernels" and path.exists()
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temp file left beside it
    mtime = os.stat(path).st_mtime_ns
    assert native.build(tmp_path) == path and os.stat(path).st_mtime_ns == mtime  # not rebuilt
    native.load(path)  # passes its own check


def test_no_compiler_falls_back_to_numpy_with_one_warning(monkeypatch, tmp_path):
    def none():
        raise cpu_blas.BlasShimError("no C compiler (test)")

    monkeypatch.setattr(cpu_blas, "compiler", none)
    monkeypatch.setenv("EDGESPEC_HOME", str(tmp_path))
    native.kernels.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="no C compiler"):
            assert native.softmax_rows() is None
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert native.softmax_rows() is None  # remembered: no second warning, no retry
        mx.random.seed(4)
        q, k, v = mx.random.normal((1, 2, 80, 8)), mx.random.normal((1, 2, 900, 8)), mx.random.normal((1, 2, 900, 8))
        ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.3, mask="causal")
        np.testing.assert_allclose(np.array(attn.numpy_attention(q, k, v, 0.3, "causal")), np.array(ref),
                                   rtol=1e-5, atol=1e-5)
    finally:
        native.kernels.cache_clear()


def test_a_wrong_library_is_refused(kernel, tmp_path, monkeypatch):
    """A library that computes something else fails the load check instead of being used."""
    src = tmp_path / "bad.c"
    src.write_text(native.SOURCE.read_text())
    header = native.SOURCE.with_name("cpu_simd.h").read_text()  # exp's polynomial lives there
    assert "p = p * z + r + splat(1.0f);" in header
    (tmp_path / "cpu_simd.h").write_text(header.replace("p = p * z + r + splat(1.0f);", "p = p * z + r + splat(1.5f);"))
    monkeypatch.setattr(native, "SOURCE", src)
    with pytest.raises(native.NativeBuildError, match="wrong results"):
        native.load(native.build(tmp_path))
