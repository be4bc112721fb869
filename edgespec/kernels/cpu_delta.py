"""The gated delta rule's recurrent form as native CPU code (cpu_delta.c), for comparison.

`delta_rule_cpu` has the arguments and results of edgespec.caches.recurrent.delta_rule; it evaluates
its inputs, runs the C loop on their buffers (heads split over one thread per core; ctypes
drops the GIL) and wraps the results. The library is built with the system's C compiler on
first use into `$EDGESPEC_HOME/kernels/` (named by a hash of the source, flags and CPU) and
checked against the MLX reference before use: `kernel()` is None where it cannot be built
or fails the check.

benchmarks/kernels_new.py measures it against MLX's composition (edgespec.caches.recurrent.delta_recurrent).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import subprocess
from pathlib import Path

import mlx.core as mx
import numpy as np

from edgespec.kernels import cpu_blas  # its functions looked up per call: tests replace them
from edgespec.kernels.attention import _pool, _workers
from edgespec.kernels.delta import tree_slots
from edgespec.kernels.delta_reference import delta_recurrent
from edgespec.kernels.native import NativeBuildError, _cpu_key
from edgespec.paths import home as default_home

SOURCE = Path(__file__).with_name("cpu_delta.c")
FLAG_SETS = (("-O3", "-march=native"), ("-O3",))
PARALLEL_MIN = 1 << 20  # state updates (T x heads x Dk x Dv) from which the heads go over the cores


def library_path(flags: tuple[str, ...], home: Path | None = None) -> Path:
    if home is None:
        home = default_home()
    h = hashlib.sha256(SOURCE.read_bytes() + repr((flags, _cpu_key())).encode()).hexdigest()[:16]
    return Path(home) / "kernels" / f"libedgespec_delta-{h}.so"


def build(home: Path | None = None) -> Path:
    paths = {flags: library_path(flags, home) for flags in FLAG_SETS}
    built = next((p for p in paths.values() if p.exists()), None)
    if built is not None:
        return built
    cc, errors = cpu_blas.compiler(), []
    for flags, out in paths.items():
        def compile_to(tmp: str, flags=flags) -> bool:
            r = subprocess.run([cc, *flags, "-shared", "-fPIC", "-fvisibility=hidden", "-o", tmp, str(SOURCE), "-lm"],
                               capture_output=True, text=True, timeout=120)
            if r.returncode != 0:
                errors.append(f"{cc} {' '.join(flags)}: {r.stderr.strip()[-300:]}")
            return r.returncode == 0

        if cpu_blas.write_library(out, compile_to):
            return out
    raise NativeBuildError("; ".join(errors))


@functools.cache
def kernel():
    """The C function, checked against delta_recurrent on a small tree pass with grouped heads;
    None where it cannot be built or loaded or gives other numbers."""
    try:
        fn = ctypes.CDLL(str(build())).edgespec_delta_rule
    except (NativeBuildError, OSError, subprocess.SubprocessError):
        return None
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p] * 7 + [ctypes.c_int64] * 7 + [ctypes.c_void_p] * 4
    rng = np.random.default_rng(0)
    q, k = (rng.standard_normal((1, 5, 2, 16)).astype(np.float32) * 0.25 for _ in range(2))
    v = rng.standard_normal((1, 5, 4, 8)).astype(np.float32)
    g, beta = -rng.uniform(0.1, 1, (1, 5, 4)).astype(np.float32), rng.uniform(0, 1, (1, 5, 4)).astype(np.float32)
    S = rng.standard_normal((1, 4, 16, 8)).astype(np.float32)
    parents = [-1, 0, 0, 2, -1]
    out, state = _call(fn, q, k, v, g, beta, S, parents, workers=1)
    want = delta_recurrent(*(mx.array(np.repeat(a, 2, axis=2)) for a in (q, k)),
                           *(mx.array(a) for a in (v, g, beta, S)), parents=parents)
    if not all(np.allclose(a, np.array(b), rtol=1e-5, atol=1e-5) for a, b in zip((out, state), want, strict=True)):
        return None
    return fn


def _call(fn, qn, kn, vn, gn, bn, sn, parents, workers: int):
    """The C loop on contiguous float32 numpy arrays -> (out, state) as numpy arrays."""
    B, T, H, Dv = vn.shape
    Hk, Dk = kn.shape[2], kn.shape[3]
    par, _, _ = tree_slots(parents, T)
    pn = np.array(par, np.int32)
    out = np.empty((B, T, H, Dv), np.float32)
    state = np.empty((B, H, Dk, Dv), np.float32)
    tree = parents is not None and any(p != t - 1 for t, p in enumerate(par))
    workers = min(workers, B * H)
    cuts = np.linspace(0, B * H, workers + 1).astype(int)

    def run(i: int) -> None:
        saved = np.empty((T, Dk, Dv), np.float32) if tree else None
        work = np.empty(2 * Dv, np.float32)
        fn(qn.ctypes.data, kn.ctypes.data, vn.ctypes.data, gn.ctypes.data, bn.ctypes.data, sn.ctypes.data,
           pn.ctypes.data, T, H, Hk, Dk, Dv, int(cuts[i]), int(cuts[i + 1]), out.ctypes.data, state.ctypes.data,
           None if saved is None else saved.ctypes.data, work.ctypes.data)

    if workers == 1:
        run(0)
    else:
        list(_pool().map(run, range(workers)))
    return out, state


def delta_rule_cpu(q, k, v, g, beta, S, parents: list[int] | None = None):
    """As edgespec.caches.recurrent.delta_rule, through cpu_delta.c (raises RuntimeError where it is unavailable)."""
    fn = kernel()
    if fn is None:
        raise RuntimeError("the native gated delta rule is unavailable here (no C compiler, or it failed its check)")
    B, T, H, Dv = v.shape
    Dk = k.shape[3]
    arrs = [a if a.dtype == mx.float32 else a.astype(mx.float32) for a in (q, k, v, g, beta, S)]
    mx.eval(arrs)
    # Small passes on one thread: handing work to the pool costs about 0.05 ms.
    workers = _workers() if T * B * H * Dk * Dv >= PARALLEL_MIN else 1
    out, state = _call(fn, *(np.ascontiguousarray(a) for a in arrs), parents, workers)
    return mx.array(out), mx.array(state)
