"""Native CPU kernels, compiled on first use: long-prompt attention on the CPU device.

On the CPU device a long prompt's attention runs outside MLX (`edgespec.kernels.attention`).
`cpu_attention.c` holds two kernels for it:
- `attention_rows`: fused attention of a block of query rows (scores, online softmax and
  P.V, tile by tile in cache, with register-blocked products), for head sizes that are
  multiples of 16 and causal masks;
- `softmax_rows`: the pass between two BLAS products for everything else (a boolean
  mask, Gemma 2's soft-cap, other head sizes): the softmax numerators and row totals of a
  score block, row by row in two passes while the row is in cache, with a vectorised
  `exp` (numpy takes three passes over the block, with a scalar float32 `exp` on CPUs
  without AVX-512, about 2.3 ns an element here).

The library is built with the system's C compiler the first time it is needed, into
`$EDGESPEC_HOME/kernels/` (named by a hash of the source, the flags and the CPU, written
atomically), both kernels checked against numpy on small blocks, and loaded with ctypes
(which drops the GIL during the call, so the attention threads run them in parallel).
Where it cannot be built or fails its check (no compiler, a read-only home)
`attention_rows()` and `softmax_rows()` return None, with one warning, and attention runs
BLAS products with numpy's passes: all give the same numbers within float32 rounding
(tests/test_native_attention.py).

Metal never uses it: the fused attention kernel runs there.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import re
import subprocess
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import numpy as np

from edgespec.kernels import cpu_blas  # its functions looked up per call: tests replace them
from edgespec.paths import home as default_home

SOURCE = Path(__file__).with_name("cpu_attention.c")
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


def library_path(flags: tuple[str, ...], home: Path | None = None, source: Path | None = None,
                 stem: str = "libedgespec_attention") -> Path:
    source = SOURCE if source is None else source  # read at the call: tests swap SOURCE
    if home is None:
        home = default_home()
    text = source.read_bytes()
    # The headers it includes by name (cpu_simd.h), beside it: a change to one rebuilds.
    headers = b"".join((source.parent / name.decode()).read_bytes()
                       for name in re.findall(rb'#include "([^"]+)"', text) if (source.parent / name.decode()).is_file())
    h = hashlib.sha256(text + headers + repr((flags, _cpu_key())).encode()).hexdigest()[:16]
    return Path(home) / "kernels" / f"{stem}-{h}.so"


def build(home: Path | None = None, source: Path | None = None, stem: str = "libedgespec_attention",
          extra_flags: tuple[str, ...] = ()) -> Path:
    """The compiled library's path, building it first if it is not there. `source`: a C file
    (default SOURCE, cpu_attention.c; edgespec/kernels/exact.py builds cpu_exact.c)."""
    source = SOURCE if source is None else source
    paths = {flags + extra_flags: library_path(flags + extra_flags, home, source, stem) for flags in FLAG_SETS}
    built = next((p for p in paths.values() if p.exists()), None)
    if built is not None:
        return built
    try:
        cc = cpu_blas.compiler()
    except cpu_blas.BlasShimError as e:
        raise NativeBuildError(str(e)) from None
    errors = []
    for flags, out in paths.items():
        def compile_to(tmp: str, flags=flags) -> bool:
            r = subprocess.run([cc, *flags, "-shared", "-fPIC", "-fvisibility=hidden", "-o", tmp, str(source)],
                               capture_output=True, text=True, timeout=120)
            if r.returncode != 0:
                errors.append(f"{cc} {' '.join(flags)}: {r.stderr.strip()[-300:]}")
            return r.returncode == 0

        if cpu_blas.write_library(out, compile_to):
            return out
    raise NativeBuildError("; ".join(errors))


class Kernels(NamedTuple):
    softmax_rows: Callable  # f(scores_ptr, rows, cols, ld, first, group, sums_ptr)
    attention_rows: Callable  # f(q, rows, ldq, packed_keys, v, ldv, n, D, first, group, out, ldo) -> 0 | -1


def load(path: Path) -> Kernels:
    """The library's two kernels, each checked against numpy on random blocks."""
    lib = ctypes.CDLL(str(path))
    sm = lib.edgespec_softmax_rows
    sm.restype = None
    sm.argtypes = [ctypes.c_void_p] + [ctypes.c_int64] * 5 + [ctypes.c_void_p]
    at = lib.edgespec_attention_rows
    at.restype = ctypes.c_int
    at.argtypes = ([ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]
                   + [ctypes.c_int64] * 5 + [ctypes.c_void_p, ctypes.c_int64])
    rng = np.random.default_rng(0)
    for rows, cols, first, group in ((7, 45, 30, 3), (4, 64, -1, 1), (3, 5, 1, 1)):
        s = (rng.standard_normal((rows, cols)) * 30).astype(np.float32)
        s[0, 3] = -np.inf
        want = reference(s, first, group)
        sums = np.full(rows, np.nan, np.float32)
        sm(s.ctypes.data, rows, cols, cols, first, group, sums.ctypes.data)
        err = max(float(np.abs(s - want).max()), float(np.abs(sums / want.sum(axis=1) - 1).max()))
        if not err < 1e-6:
            raise NativeBuildError(f"{path}: wrong results (max error {err:.2e} against numpy)")
    for rows, n, D, first, group in ((13, 300, 32, 290, 3), (5, 40, 16, -1, 1), (4, 20, 16, 0, 2)):
        q = (rng.standard_normal((rows, D)) * 0.5).astype(np.float32)
        k, v = (rng.standard_normal((n, D)).astype(np.float32) for _ in range(2))
        out = np.full((rows, D), np.nan, np.float32)
        packed = pack_keys(k)
        if at(q.ctypes.data, rows, D, packed.ctypes.data, v.ctypes.data, D, n, D, first, group,
              out.ctypes.data, D) != 0:
            raise NativeBuildError(f"{path}: the attention kernel found no memory for its scratch")
        err = float(np.abs(out - reference_attention(q, k, v, first, group)).max())
        if not err < 1e-5:
            raise NativeBuildError(f"{path}: wrong results (max error {err:.2e} against numpy)")
    return Kernels(sm, at)


def reference(s: np.ndarray, first: int, group: int) -> np.ndarray:
    """numpy's version of the softmax kernel (float64 inside), for checks and tests."""
    rows, cols = s.shape
    out = np.zeros_like(s)
    for r in range(rows):
        n = cols if first < 0 else max(0, min(cols, first + r // group + 1))
        x = s[r, :n].astype(np.float64)
        if n and np.isfinite(x.max()):
            out[r, :n] = np.exp(x - x.max())
    return out


def reference_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, first: int, group: int) -> np.ndarray:
    """numpy's version of the attention kernel (float64 inside): softmax(q k^T) v, row r seeing
    keys up to first + r // group when first >= 0; zeros for a row that sees nothing."""
    p = reference(q.astype(np.float64) @ k.T.astype(np.float64), first, group)
    total = p.sum(axis=1, keepdims=True)
    total[total == 0] = 1.0
    return ((p / total) @ v.astype(np.float64)).astype(np.float32)


def pack_keys(k: np.ndarray) -> np.ndarray:
    """Keys (n, D) in the attention kernel's layout: panels of 16 keys, dims major inside
    a panel (packed[p, d, c] = k[16 p + c, d]), zeros past n. Contiguous float32."""
    n, D = k.shape
    panels = -(-n // 16)
    packed = np.empty((panels, D, 16), np.float32)
    full = n // 16
    packed[:full] = k[: full * 16].reshape(full, 16, D).transpose(0, 2, 1)
    if full < panels:
        tail = np.zeros((16, D), np.float32)
        tail[: n - full * 16] = k[full * 16 :]
        packed[full] = tail.T
    return packed


@functools.cache
def kernels() -> Kernels | None:
    """Both kernels, or None where the library cannot be built or fails its checks (one warning)."""
    try:
        return load(build())
    except (NativeBuildError, OSError, subprocess.SubprocessError) as e:
        warnings.warn(f"edgespec: native attention kernels unavailable, using numpy's passes ({e})",
                      RuntimeWarning, stacklevel=2)
        return None


def softmax_rows() -> Callable | None:
    """`f(ptr, rows, cols, ld, first, group, sums_ptr)` (see cpu_attention.c) or None where unavailable."""
    k = kernels()
    return None if k is None else k.softmax_rows


def attention_rows() -> Callable | None:
    """`f(q, rows, ldq, packed_keys, v, ldv, n, D, first, group, out, ldo)` (see cpu_attention.c)
    or None where unavailable."""
    k = kernels()
    return None if k is None else k.attention_rows
