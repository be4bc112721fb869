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


@linux_with_cc
def test_built_shim_answers_mlx_products_with_numpys_openblas(tmp_path):
    out = tmp_path / "lib" / cpu_blas.LIBRARY_NAME
    target = cpu_blas.build(out)
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
    r = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, LD_PRELOAD=str(out)),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert float(r.stdout) < 1e-4


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
    cpu_blas.compile_shim(gone, lib)
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
