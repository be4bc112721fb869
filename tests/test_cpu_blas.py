"""The preload shim that runs MLX's CPU matmuls on numpy's OpenBLAS (edgespec/kernels/cpu_blas.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from edgespec.kernels import cpu_blas

linux_with_cc = pytest.mark.skipif(
    sys.platform != "linux" or not any(shutil.which(c) for c in ("cc", "gcc", "clang")),
    reason="the shim is built for MLX's Linux CPU wheel, with a C compiler")


def _made_shim() -> Path | None:
    """The shim `make` built and this run preloads, when it is newer than every source it is built
    from (`cpu_blas.build` made and checked it: `make test` rebuilds it when a source changes)."""
    made = (Path(__file__).resolve().parents[1] / ".cache" / "lib" / cpu_blas.LIBRARY_NAME)
    preloaded = [Path(p).resolve() for p in os.environ.get("LD_PRELOAD", "").split() if p]
    if made.resolve() not in preloaded or not made.is_file():
        return None
    sources = (cpu_blas.SOURCE, cpu_blas.SOURCE.with_name("cblas_skinny.h"), Path(cpu_blas.__file__))
    return made if all(made.stat().st_mtime >= s.stat().st_mtime for s in sources) else None


@pytest.fixture(scope="module")
def shim(tmp_path_factory):
    """The shim for this module's tests: the one `make` built for this run when it is current
    (compiling it takes minutes on a small host), else built here once. -> (its path, the
    OpenBLAS it forwards to)."""
    made = _made_shim()
    if made is not None:
        return made, cpu_blas.numpy_openblas()
    out = tmp_path_factory.mktemp("shim") / "lib" / cpu_blas.LIBRARY_NAME
    return out, cpu_blas.build(out)


def run_with(shim_path: Path, code: str, **env) -> str:
    """`code` in a fresh Python with the shim preloaded; its stdout (the test fails on an error)."""
    r = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, LD_PRELOAD=str(shim_path), **env),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


@linux_with_cc
def test_built_shim_answers_mlx_products_with_numpys_openblas(shim):
    out, target = shim
    assert out.is_file() and not [p for p in out.parent.iterdir() if p != out]  # no temp file left
    assert target.version != "?" and Path(target.path).is_file()
    # In a fresh process: MLX's products equal numpy's, `cblas_sgemm` is the shim's, and
    # the only BLAS loaded is numpy's own file.
    line = cpu_blas.check(out)
    assert line == f"ok {target.path}"
    # And an mlx.nn.Linear layer (weight and bias) through it.
    code = ("import mlx.core as mx, mlx.nn as nn, numpy as np; mx.set_default_device(mx.cpu); "
            "mx.random.seed(3); l = nn.Linear(64, 48); x = mx.random.normal((5, 64)); "
            "want = np.array(x) @ np.array(l.weight).T + np.array(l.bias); "
            "print(float(np.abs(np.array(l(x)) - want).max()))")
    assert float(run_with(out, code)) < 1e-4


FEW_ROWS = """
import ctypes, os, sys, threading
import mlx.core as mx, numpy as np
mx.set_default_device(mx.cpu)
shim = ctypes.CDLL(None)
shim.edgespec_cblas_skinny_calls.restype = ctypes.c_long
rng = np.random.default_rng(5)
w = mx.array(rng.standard_normal((2048, 320)).astype(np.float32))  # large enough for the helper
xs = [mx.array(rng.standard_normal((r, 320)).astype(np.float32)) for r in (1, 3, 8, 13, 16, 17, 24, 29, 32)]
"""


@linux_with_cc
def test_few_row_products_are_the_one_row_products_bitwise(shim):
    """Each row of a few-row product (a verify pass) is bitwise that row alone (a plain step),
    in either operand order, and the products ran in the shim's kernel; past 16 rows too,
    where the rows meet each block of weight rows 16 at a time."""
    code = FEW_ROWS + """
before = shim.edgespec_cblas_skinny_calls()
for x in xs:
    one = np.concatenate([np.array(x[i : i + 1] @ w.T) for i in range(x.shape[0])])
    assert np.array_equal(np.array(x @ w.T), one), x.shape
    assert np.array_equal(np.array((w @ x.T).T), one), x.shape
    want = np.array(x).astype(np.float64) @ np.array(w).T.astype(np.float64)
    assert np.abs(one - want).max() / np.abs(want).max() < 1e-6
print(shim.edgespec_cblas_skinny_calls() - before)
"""
    assert int(run_with(shim[0], code)) >= 9 * 4


@linux_with_cc
def test_misaligned_rows_copied_aligned_give_the_same_bits(shim):
    """The kernel copies misaligned activation rows into an aligned buffer (cblas_skinny.h):
    every product equals, bitwise, the one computed from the rows where they lie, for rows
    at odd offsets and strides, a length with a tail (k = 300), and x given transposed."""
    code = FEW_ROWS + """
big = mx.array(rng.standard_normal((32, 700)).astype(np.float32))
w300 = mx.array(rng.standard_normal((1100, 300)).astype(np.float32))
cases = []
for r in (2, 5, 8, 16, 21, 32):
    cases += [(big[:r, 3:323], w), (big[:r, 1:301], w300), (mx.array(rng.standard_normal((r, 300)).astype(np.float32)), w300)]
def products():
    out = []
    for x, wt in cases:
        out += [np.array(x @ wt.T), np.array((wt @ x.T).T), np.array((wt @ mx.contiguous(x.T)).T)]
    return out
shim.edgespec_cblas_skinny_align(1)
on = products()
shim.edgespec_cblas_skinny_align(0)
off = products()
shim.edgespec_cblas_skinny_align(1)
assert all(np.array_equal(a, b) for a, b in zip(on, off, strict=True))
for (x, wt), got in zip(cases, on[::3]):
    want = np.array(x).astype(np.float64) @ np.array(wt).T.astype(np.float64)
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-6
print(len(on))
"""
    assert int(run_with(shim[0], code)) == 6 * 3 * 3


@linux_with_cc
def test_the_process_can_ask_how_many_rows_the_kernel_takes(shim):
    """cpu_blas.few_row_kernel(): 32 with the shim preloaded, 0 with its kernel off or no shim."""
    code = "from edgespec.kernels import cpu_blas; print(cpu_blas.few_row_kernel())"
    assert run_with(shim[0], code).strip() == "32"
    assert run_with(shim[0], code, EDGESPEC_SKINNY="0").strip() == "0"
    r = subprocess.run([sys.executable, "-c", code], env={k: v for k, v in os.environ.items() if k != "LD_PRELOAD"},
                       capture_output=True, text=True, timeout=120)
    assert r.stdout.strip() == "0", r.stderr[-500:]


@linux_with_cc
def test_few_row_products_off_go_to_openblas(shim):
    code = FEW_ROWS + """
shim.edgespec_cblas_skinny(1)
on = [np.array(x @ w.T) for x in xs]
shim.edgespec_cblas_skinny(0)
before = shim.edgespec_cblas_skinny_calls()
off = [np.array(x @ w.T) for x in xs]
assert shim.edgespec_cblas_skinny_calls() == before  # none taken
assert all(np.abs(a - b).max() < 1e-3 for a, b in zip(on, off))
print("same")
"""
    assert run_with(shim[0], code).strip() == "same"
    # and off from the start, by the environment
    code = FEW_ROWS + "np.array(xs[2] @ w.T)\nprint(shim.edgespec_cblas_skinny_calls())"
    assert run_with(shim[0], code, EDGESPEC_SKINNY="0").strip() == "0"


@linux_with_cc
def test_few_row_products_from_threads_and_after_fork(shim):
    """Products from 4 threads at once (one has the helper thread, the others compute alone)
    are right, and a forked child makes its own helper instead of waiting for its parent's
    (which the child does not have)."""
    code = FEW_ROWS + """
want = [np.array(x).astype(np.float64) @ np.array(w).T.astype(np.float64) for x in xs]
np.array(xs[4] @ w.T)  # the helper thread started here
errs = []
def work(t):
    for _ in range(20):
        for x, ref in zip(xs, want):
            errs.append(float(np.abs(np.array(x @ w.T) - ref).max()))
threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
for t in threads: t.start()
for t in threads: t.join()
assert max(errs) < 1e-3 and len(errs) == 4 * 20 * len(xs)
# The child calls the shim's cblas_sgemm itself (MLX does not run in a forked child).
P = ctypes.POINTER(ctypes.c_float)
sgemm = shim.cblas_sgemm
sgemm.argtypes = [ctypes.c_int] * 6 + [ctypes.c_float, P, ctypes.c_int, P, ctypes.c_int, ctypes.c_float, P, ctypes.c_int]
wn, xn = np.array(w), np.array(xs[2])
def product():
    c = np.zeros((8, 2048), np.float32)
    sgemm(101, 111, 112, 8, 2048, 320, 1.0, xn.ctypes.data_as(P), 320, wn.ctypes.data_as(P), 320, 0.0,
          c.ctypes.data_as(P), 2048)
    return c
assert np.abs(product() - want[2]).max() < 1e-3
pid = os.fork()
if pid == 0:
    os._exit(0 if np.abs(product() - want[2]).max() < 1e-3 else 1)
_, status = os.waitpid(pid, 0)
print(os.waitstatus_to_exitcode(status))
"""
    assert run_with(shim[0], code).strip() == "0"


@linux_with_cc
def test_check_refuses_a_library_whose_products_are_wrong(tmp_path):
    # A cblas_sgemm that leaves C untouched: MLX's results are garbage, and the check says so.
    src = tmp_path / "bad.c"
    src.write_text("void cblas_sgemm(int o, int a, int b, int m, int n, int k, float al, const float *A, "
                   "int lda, const float *B, int ldb, float be, float *C, int ldc) "
                   "{ for (int i = 0; i < m; i++) for (int j = 0; j < n; j++) C[i * ldc + j] = 0.0f; }\n")
    lib = tmp_path / "libbad.so"
    subprocess.run([cpu_blas.compiler(), "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    with pytest.raises(cpu_blas.BlasShimError, match="failed its check: .*relative error"):
        cpu_blas.check(lib)


def test_build_without_a_compiler_says_so_and_writes_nothing(tmp_path, monkeypatch):
    if sys.platform != "linux":
        with pytest.raises(cpu_blas.BlasShimError, match="only for Linux"):
            cpu_blas.build(tmp_path / "x.so")
        return
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(cpu_blas.shutil, "which", lambda name: None)
    with pytest.raises(cpu_blas.BlasShimError, match="no C compiler"):
        cpu_blas.build(tmp_path / "lib" / "x.so")
    assert not (tmp_path / "lib").exists() or not list((tmp_path / "lib").iterdir())
    # The command-line entry point reports it on stderr with status 1, no traceback.
    assert cpu_blas.main([str(tmp_path / "y.so")]) == 1


def test_numpy_openblas_names_its_symbols():
    target = cpu_blas.numpy_openblas()
    import ctypes

    lib = ctypes.CDLL(target.path)
    for name in cpu_blas.FORWARDED:
        assert hasattr(lib, f"{target.prefix}{name}{target.suffix}")
    assert target.config.startswith("OpenBLAS ")
    assert target.ilp64 == ("USE64BITINT" in target.config)


def test_describe_names_what_is_preloaded():
    assert cpu_blas.describe("") is None
    assert cpu_blas.describe("/usr/lib/libjemalloc.so.2") is None
    assert cpu_blas.describe("/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0") == \
        "OpenBLAS (preloaded: /usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0)"
    shim = cpu_blas.describe(f"/x/libjemalloc.so:/repo/.cache/lib/{cpu_blas.LIBRARY_NAME}")
    assert shim.startswith("numpy's OpenBLAS ") and shim.endswith(f"(preloaded via {cpu_blas.LIBRARY_NAME})")
    assert cpu_blas.numpy_openblas().version in shim


@linux_with_cc
def test_a_shim_whose_openblas_is_gone_warns_and_stays_correct(tmp_path):
    # numpy upgraded under a built shim: its OpenBLAS file is gone. MLX's products go on to
    # MLX's own BLAS (the next definition), with one warning, instead of crashing the process.
    real = cpu_blas.numpy_openblas()
    gone = cpu_blas.OpenBLAS(str(tmp_path / "libgone.so"), real.prefix, real.suffix, real.ilp64, real.config)
    lib = tmp_path / cpu_blas.LIBRARY_NAME
    cpu_blas.compile_shim(gone, lib, opt="-O1")  # its forwarding is the point, not its kernel's speed
    code = ("import mlx.core as mx, numpy as np; mx.set_default_device(mx.cpu); "
            "x = np.arange(12, dtype=np.float32).reshape(3, 4); w = np.ones((5, 4), np.float32); "
            "print(float(np.abs(np.array(mx.array(x) @ mx.array(w).T) - x @ w.T).max()))")
    r = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, LD_PRELOAD=str(lib)),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert float(r.stdout) == 0.0
    assert r.stderr.count("edgespec cblas shim: cannot use") == 1 and "make setup" in r.stderr
    with pytest.raises(cpu_blas.BlasShimError, match="failed its check: .*forwards nowhere"):
        cpu_blas.check(lib)  # so `make setup` would not install it
