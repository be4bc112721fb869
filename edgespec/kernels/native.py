"""Native CPU kernels, compiled on first use: the softmax pass of long-prompt attention.

On the CPU device a long prompt's attention runs in numpy (`edgespec.kernels.attention`):
two BLAS products and, between them, the softmax numerators of a score block that is
megabytes large. numpy takes three passes over it (max, subtract, `exp`), with a scalar
float32 `exp` on CPUs without AVX-512 (about 2.3 ns an element here). `softmax.c` does the
same row by row in two passes while the row is in cache, with a vectorised `exp`.

The library is built with the system's C compiler the first time it is needed, into
`$EDGESPEC_HOME/kernels/` (named by a hash of the source, the flags and the CPU, written
atomically), checked against numpy on a small block, and loaded with ctypes (which drops
the GIL during the call, so the attention threads run it in parallel). Where it cannot
be built or fails its check (no compiler, a read-only home) `softmax_rows()` returns
None, with one warning, and attention keeps numpy's passes: the two give the same
numbers within float32 rounding (tests/test_native_softmax.py).

Metal never uses it: the fused attention kernel runs there.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import subprocess
import warnings
from pathlib import Path

import numpy as np

SOURCE = Path(__file__).with_name("softmax.c")
FLAG_SETS = (("-O3", "-march=native"), ("-O3",))  # the first the compiler accepts
# EDGESPEC_NATIVE=0 keeps numpy's passes (for comparisons: benchmarks/cpu_kernels.py)
ENABLED = os.environ.get("EDGESPEC_NATIVE", "1") != "0"


class NativeBuildError(RuntimeError):
    """The native kernels cannot be built or loaded here (the message says why)."""


def _cpu_key() -> str:
    """What -march=native depends on: the machine, and its CPU's feature flags where listed."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    return f"{platform.machine()} {flags.strip()}"


def library_path(flags: tuple[str, ...], home: Path | None = None) -> Path:
    if home is None:
        from edgespec.default_model import home as default_home

        home = default_home()
    h = hashlib.sha256(SOURCE.read_bytes() + repr((flags, _cpu_key())).encode()).hexdigest()[:16]
    return Path(home) / "kernels" / f"libedgespec_softmax-{h}.so"


def build(home: Path | None = None) -> Path:
    """The compiled library's path, building it first if it is not there."""
    from edgespec.kernels.cpu_blas import BlasShimError, compiler, write_library

    paths = {flags: library_path(flags, home) for flags in FLAG_SETS}
    built = next((p for p in paths.values() if p.exists()), None)
    if built is not None:
        return built
    try:
        cc = compiler()
    except BlasShimError as e:
        raise NativeBuildError(str(e)) from None
    errors = []
    for flags, out in paths.items():
        def compile_to(tmp: str, flags=flags) -> bool:
            r = subprocess.run([cc, *flags, "-shared", "-fPIC", "-fvisibility=hidden", "-o", tmp, str(SOURCE)],
                               capture_output=True, text=True, timeout=120)
            if r.returncode != 0:
                errors.append(f"{cc} {' '.join(flags)}: {r.stderr.strip()[-300:]}")
            return r.returncode == 0

        if write_library(out, compile_to):
            return out
    raise NativeBuildError("; ".join(errors))


def load(path: Path):
    """The library's `edgespec_softmax_rows`, checked against numpy on random rows."""
    lib = ctypes.CDLL(str(path))
    fn = lib.edgespec_softmax_rows
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p] + [ctypes.c_int64] * 5 + [ctypes.c_void_p]
    rng = np.random.default_rng(0)
    for rows, cols, first, group in ((7, 45, 30, 3), (4, 64, -1, 1), (3, 5, 1, 1)):
        s = (rng.standard_normal((rows, cols)) * 30).astype(np.float32)
        s[0, 3] = -np.inf
        want = reference(s, first, group)
        sums = np.full(rows, np.nan, np.float32)
        fn(s.ctypes.data, rows, cols, cols, first, group, sums.ctypes.data)
        err = max(float(np.abs(s - want).max()), float(np.abs(sums / want.sum(axis=1) - 1).max()))
        if not err < 1e-6:
            raise NativeBuildError(f"{path}: wrong results (max error {err:.2e} against numpy)")
    return fn


def reference(s: np.ndarray, first: int, group: int) -> np.ndarray:
    """numpy's version of the kernel (float64 inside), for checks and tests."""
    rows, cols = s.shape
    out = np.zeros_like(s)
    for r in range(rows):
        n = cols if first < 0 else max(0, min(cols, first + r // group + 1))
        x = s[r, :n].astype(np.float64)
        if n and np.isfinite(x.max()):
            out[r, :n] = np.exp(x - x.max())
    return out


@functools.cache
def softmax_rows():
    """`f(ptr, rows, cols, ld, first, group, sums_ptr)` (see softmax.c) or None where unavailable."""
    try:
        return load(build())
    except (NativeBuildError, OSError, subprocess.SubprocessError) as e:
        warnings.warn(f"edgespec: native softmax kernel unavailable, using numpy's ({e})", RuntimeWarning,
                      stacklevel=2)
        return None
