"""The BLAS behind MLX's CPU matmuls on Linux: numpy's own OpenBLAS, through a preload shim.

MLX's Linux CPU wheel bundles a slow reference BLAS. Preloading an OpenBLAS replaces it;
this module builds the library to preload (`cblas_forward.c`): three CBLAS entry points
(`cblas_sgemm`, `cblas_dgemm`, `cblas_cgemm`, all MLX calls) forwarded to the OpenBLAS
that numpy ships (scipy-openblas, prefixed ILP64 symbols). Against Debian's OpenBLAS
0.3.21, preloaded whole before:

- its few-row products are faster, so a pass over a few tokens costs less beside one
  token's (`benchmarks/blas_preload.py`, each preload in fresh processes, alternating:
  decoding passes of 4 and 8 rows in 0.84x and 0.82x Debian's time, one row 0.95x;
  benchmarks/results/batching.md);
- the process holds one OpenBLAS, not two, and `threadpoolctl` limits reach all its
  callers (MLX's products, numpy's long-prompt attention and activation);
- that OpenBLAS's pool workers wait THREAD_TIMEOUT (2^4 cycles) before sleeping, not
  OpenBLAS's default 2^28 (about 0.1 s): after every MLX product a spinning worker took
  a core from the numpy attention blocks that run next. The shim sets
  OPENBLAS_THREAD_TIMEOUT (unless it is already set) before it opens the library.
  With the default wait the shim's 8,190-token prefill took 1.17-1.18x Debian's time in
  `benchmarks/blas_preload.py`; with the short one, 0.96x (docs/prefill.md).

Few-row products (1 to 32 activation rows against a weight matrix: a decoding pass's
tokens) do not go to OpenBLAS: its general product streams the weights at about 9 GB/s on
this CPU whatever the row count, and a matrix-vector product (`sgemv`) for one row would
favour single-token steps, which the accelerator the product runs on does not. The shim's
own kernel (`cblas_skinny.h`) reads each weight row once for all the rows, the weight stream
prefetched ahead, on two threads: SmolLM2's 538 MB of weights in 26.1 / 29.5 / 37.9 ms for
1 / 4 / 8 rows against 63.6 / 88.3 / 90.8 ms with `EDGESPEC_SKINNY=0` (`benchmarks/cpu_kernels.py
--only weights --reps 3`, once each way, 2026-12-06), a decoding pass of one token in about 0.6x
the time (a one-off timing); each row of a few-row product is bitwise that row alone. Misaligned
activation rows (MLX's arrays are 8-byte aligned) are copied to an aligned buffer first: a pass of
8 tokens about 4% faster (`--only align`, docs/batching.md). `EDGESPEC_SKINNY=0` (or
`edgespec_cblas_skinny(0)` through ctypes) sends them to OpenBLAS, for comparisons.

Which row counts the kernel takes is this host's verdict (`apply_verdicts`, at the first model
loaded for inference): each row class timed through the kernel and through OpenBLAS once per
machine, kept in kernels/verdicts.py's store; a class the kernel loses goes to OpenBLAS. On an
AVX2 host without AVX-512 it loses nothing up to 15 rows (docs/batching.md).

`make setup` builds it into .cache/lib (`python -m edgespec.kernels.cpu_blas OUT`),
checks it in a fresh process, and the Makefile preloads it; where it cannot be built
(no C compiler, a numpy without a bundled OpenBLAS) the Makefile falls back to Debian's
OpenBLAS. Only the CPU backend reads it: Metal never calls a CBLAS product.
"""

from __future__ import annotations

import ctypes
import functools
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

SOURCE = Path(__file__).with_name("cblas_forward.c")
LIBRARY_NAME = "libedgespec_cblas.so"
FORWARDED = ("cblas_sgemm", "cblas_dgemm", "cblas_cgemm")
THREAD_TIMEOUT = 4  # OPENBLAS_THREAD_TIMEOUT: workers spin 2^n cycles after a call before they sleep
# (prefix, suffix) of an OpenBLAS's exported names: scipy-openblas64, scipy-openblas32,
# a plain OpenBLAS built with a 64_ suffix, a plain one.
_NAMINGS = (("scipy_", "64_"), ("scipy_", ""), ("", "64_"), ("", ""))


class BlasShimError(RuntimeError):
    """The shim cannot be built or does not work here (the message says why)."""


@dataclass(frozen=True)
class OpenBLAS:
    path: str
    prefix: str
    suffix: str
    ilp64: bool
    config: str  # openblas_get_config(): version, integer width, kernel family

    @property
    def version(self) -> str:
        words = self.config.split()
        return words[1] if len(words) > 1 and words[0] == "OpenBLAS" else "?"


def numpy_openblas() -> OpenBLAS:
    """numpy's bundled OpenBLAS: its file, symbol names and integer width."""
    import numpy  # noqa: F401  (loads its BLAS, so threadpoolctl sees it)
    from threadpoolctl import threadpool_info  # only when building the shim

    numpy_dir = Path(numpy.__file__).resolve().parent.parent
    found = [d for d in threadpool_info() if d.get("internal_api") == "openblas"
             and Path(d["filepath"]).resolve().is_relative_to(numpy_dir)
             and "numpy" in Path(d["filepath"]).parent.name]
    if not found:
        raise BlasShimError("this numpy does not ship its own OpenBLAS (numpy.libs); nothing to forward to")
    path = found[0]["filepath"]
    lib = ctypes.CDLL(path)
    for prefix, suffix in _NAMINGS:
        if all(hasattr(lib, f"{prefix}{name}{suffix}") for name in FORWARDED):
            get_config = getattr(lib, f"{prefix}openblas_get_config{suffix}")
            get_config.restype = ctypes.c_char_p
            config = get_config().decode(errors="replace").strip()
            return OpenBLAS(path, prefix, suffix, "USE64BITINT" in config.split(), config)
    raise BlasShimError(f"{path} exports none of the CBLAS names expected ({', '.join(FORWARDED)})")


def compiler() -> str:
    for cc in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cc and shutil.which(cc):
            return cc
    raise BlasShimError("no C compiler (cc, gcc or clang on PATH, or $CC)")


# Run in a fresh process with the shim preloaded: MLX's float32 products of the shapes a
# decoder makes (1, a few, many rows; both operand orders) must equal numpy's, the
# process must hold the shim's `cblas_sgemm` and one OpenBLAS only, the shim must forward
# to that one, and it must have set the pool's wait (the check's environment leaves it unset).
_CHECK = r"""
import ctypes, os, sys
import mlx.core as mx
import numpy as np
from threadpoolctl import threadpool_info
shim = ctypes.CDLL(sys.argv[1])
glob = ctypes.CDLL(None)
assert ctypes.cast(glob.cblas_sgemm, ctypes.c_void_p).value == ctypes.cast(shim.cblas_sgemm, ctypes.c_void_p).value, \
    "cblas_sgemm does not resolve to the shim"
mx.set_default_device(mx.cpu)
rng = np.random.default_rng(0)
for rows, k, n in ((1, 96, 160), (3, 96, 160), (8, 200, 64), (130, 64, 300)):
    x = rng.standard_normal((rows, k)).astype(np.float32)
    w = rng.standard_normal((n, k)).astype(np.float32)
    want = x.astype(np.float64) @ w.T.astype(np.float64)
    for got in (mx.array(x) @ mx.array(w).T, (mx.array(w) @ mx.array(x).T).T):
        err = float(np.abs(np.array(got) - want).max() / np.abs(want).max())
        assert err < 1e-5, f"({rows}x{k}) @ ({k}x{n}): relative error {err:.2e}"
# The few-row products (cblas_skinny.h): 1..32 rows in MLX's three forms (x @ W.T, W @ x.T
# as a view and as a copy, with and without a bias added by the product), weights large
# enough for the helper thread, each row bitwise the row a one-row product gives.
shim.edgespec_cblas_skinny_calls.restype = ctypes.c_long
before = shim.edgespec_cblas_skinny_calls()
w = mx.array(rng.standard_normal((1100, 300)).astype(np.float32))
bias = mx.array(rng.standard_normal(1100).astype(np.float32))
for rows in range(1, 33):
    x = mx.array(rng.standard_normal((rows, 300)).astype(np.float32))
    want = np.array(x).astype(np.float64) @ np.array(w).T.astype(np.float64)
    forms = (x @ w.T, (w @ x.T).T, (w @ mx.contiguous(x.T)).T, mx.addmm(bias, x, w.T) - bias)
    for f, got in enumerate(forms):
        err = float(np.abs(np.array(got) - want).max() / np.abs(want).max())
        assert err < 1e-5, f"few-row form {f}, {rows} rows: relative error {err:.2e}"
    one = np.concatenate([np.array(x[i : i + 1] @ w.T) for i in range(rows)])
    assert np.array_equal(np.array(forms[0]), one), f"{rows} rows: not bitwise the one-row products"
    assert np.array_equal(np.array(forms[1]), one), f"{rows} rows (W @ x.T): not bitwise the one-row products"
assert shim.edgespec_cblas_skinny_calls() - before >= 32 * 4, "the few-row products did not reach the shim's kernel"
blas = [d["filepath"] for d in threadpool_info() if d.get("user_api") == "blas"]
assert len(blas) == 1, f"more than one BLAS loaded: {blas}"
shim.edgespec_cblas_target.restype = ctypes.c_char_p
target = shim.edgespec_cblas_target()
assert target is not None, "the shim forwards nowhere (its OpenBLAS could not be opened)"
assert os.path.realpath(target.decode()) == os.path.realpath(blas[0]), f"forwards to {target!r}, not {blas[0]}"
assert os.environ.get("OPENBLAS_THREAD_TIMEOUT") == sys.argv[2], \
    f"OPENBLAS_THREAD_TIMEOUT is {os.environ.get('OPENBLAS_THREAD_TIMEOUT')!r}, not {sys.argv[2]}"
print("ok", blas[0])
"""


def check(library: Path, python: str = sys.executable) -> str:
    """Load the shim in a fresh process and run `_CHECK`; its one line, or BlasShimError."""
    env = dict(os.environ, LD_PRELOAD=str(Path(library).resolve()))
    env.pop("OPENBLAS_THREAD_TIMEOUT", None)
    r = subprocess.run([python, "-c", _CHECK, str(Path(library).resolve()), str(THREAD_TIMEOUT)], env=env,
                       capture_output=True, text=True, timeout=300)
    if r.returncode != 0 or not r.stdout.startswith("ok"):
        tail = (r.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise BlasShimError(f"{library} failed its check: {tail}")
    return r.stdout.strip()


def compile_shim(target: OpenBLAS, out: str | Path, cc: str | None = None, opt: str = "-O3") -> None:
    """Compile cblas_forward.c for `target` into `out` (no check); `opt`: the optimisation level."""
    if '"' in target.path or "\\" in target.path:
        raise BlasShimError(f"cannot name {target.path!r} in C source")
    cc = cc or compiler()
    cmd = [cc, opt, "-pthread", "-shared", "-fPIC", "-fvisibility=hidden", "-o", str(out), str(SOURCE),
           f'-DFWD_LIBRARY="{target.path}"', f"-DFWD_PREFIX={target.prefix}", f"-DFWD_SUFFIX={target.suffix}",
           f"-DFWD_INT={'int64_t' if target.ilp64 else 'int'}", f'-DFWD_THREAD_TIMEOUT="{THREAD_TIMEOUT}"', "-ldl", "-lpthread"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise BlasShimError(f"{cc} failed: {r.stderr.strip()[-500:]}")


def build(out: Path) -> OpenBLAS:
    """Compile the shim to `out` (atomically: a temp file beside it, checked, then renamed)."""
    if sys.platform != "linux":
        raise BlasShimError(f"only for Linux (MLX's CPU wheel); this is {sys.platform}")
    target = numpy_openblas()
    cc = compiler()  # before anything is written

    def make(tmp: str) -> bool:
        compile_shim(target, tmp, cc)
        check(Path(tmp))  # raises if it does not work
        return True

    write_library(Path(out).resolve(), make)
    return target


def write_library(out: Path, make) -> bool:
    """Atomically: `make(tmp)` writes a temp file beside `out` and says whether to keep it;
    kept, it becomes `out` (executable). The temp file never outlives the call."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    os.close(fd)
    try:
        if not make(tmp):
            return False
        os.chmod(tmp, 0o755)
        os.replace(tmp, out)
        return True
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _initial_mask() -> int:
    calls = _mask_calls()
    if calls is not None:
        return calls[1]() if few_row_kernel() else 0
    return (1 << few_row_kernel()) - 1  # a shim built before the mask: every row up to its most


def few_row_kernel() -> int:
    """The most rows of an MLX product this process's shim answers with its own kernel (its
    SK_MAX_ROWS); 0 with no shim preloaded, its kernel off (EDGESPEC_SKINNY=0), or a shim built
    before it could be asked."""
    try:
        rows = ctypes.CDLL(None).edgespec_cblas_skinny_rows
    except (AttributeError, OSError):
        return 0
    rows.restype = ctypes.c_int
    return int(rows())


# ------------------------------------------------------------------ the host's verdicts
# Row classes of a few-row product, each timed on this host against OpenBLAS at its first row
# count: the kernel takes a class only where it wins (kernels/verdicts.py keeps the verdict).
ROW_CLASSES = ((1, 1), (2, 2), (3, 3), (4, 5), (6, 7), (8, 11), (12, 15), (16, 23), (24, 32))
# Weights timed (out x in): SmolLM2-135M's MLP and attention shapes and a larger MLP's, 30 MB in
# all: more than a last-level cache, so the weight stream is timed as a pass meets it.
CHECK_SHAPES = ((1536, 576), (576, 1536), (576, 576), (4096, 1024), (1024, 4096))
CHECK_REPS = 5
KERNEL = "blas_few_rows"


def _mask_calls():
    """(set, get) of the preloaded shim's row mask; None without a shim that has one."""
    try:
        lib = ctypes.CDLL(None)
        set_mask, get_mask = lib.edgespec_cblas_skinny_mask, lib.edgespec_cblas_skinny_get_mask
    except (AttributeError, OSError):
        return None
    set_mask.argtypes, set_mask.restype = [ctypes.c_uint], None
    get_mask.restype = ctypes.c_uint
    return set_mask, get_mask


def takes(rows: int) -> bool:
    """Whether this process's shim answers a product of `rows` activation rows with its own kernel."""
    return 0 < rows <= 32 and bool((_TAKEN >> (rows - 1)) & 1)


@functools.cache
def _check_weights() -> list:
    """The weights every row class is timed on (made once for a call of apply_verdicts)."""
    import mlx.core as mx

    weights = [mx.random.normal((n, k), key=mx.random.key(i)) for i, (n, k) in enumerate(CHECK_SHAPES)]
    mx.eval(weights)
    return weights


def _time_class(rows: int, set_mask, reps: int = CHECK_REPS) -> tuple[float, float]:
    """Median seconds of one sweep over CHECK_SHAPES at `rows` rows: the kernel's, OpenBLAS's
    (alternating rep by rep, so both meet the same load)."""
    import time

    import mlx.core as mx

    weights = _check_weights()
    xs = [mx.random.normal((rows, w.shape[1]), key=mx.random.key(100 + i)) for i, w in enumerate(weights)]
    mx.eval(weights, xs)
    times = {True: [], False: []}
    for rep in range(reps + 1):
        for on in ((True, False) if rep % 2 else (False, True)):
            set_mask(0xFFFFFFFF if on else 0)
            t0 = time.perf_counter()
            # each in the form kernels/linear.py gives it: x @ W.T to the kernel, W @ x.T to OpenBLAS
            mx.eval([x @ w.T if on else w @ x.T for x, w in zip(xs, weights, strict=True)])
            if rep:  # the first is a warm-up
                times[on].append(time.perf_counter() - t0)
    med = lambda v: sorted(v)[len(v) // 2]  # noqa: E731
    return med(times[True]), med(times[False])


def apply_verdicts() -> int:
    """Set the shim's row mask from this host's verdicts (timing each row class once per machine,
    kept in kernels/verdicts.py's store): the few-row kernel takes the classes where it is at least
    as fast as OpenBLAS. Off the CPU device, without the shim, with its kernel off
    (EDGESPEC_SKINNY=0) or with EDGESPEC_KERNEL_CHECKS=off (the kernel then takes every class, as
    built): nothing timed. -> the mask in force."""
    global _TAKEN
    import mlx.core as mx

    from edgespec.kernels import verdicts

    calls = _mask_calls()
    if calls is None or few_row_kernel() == 0:
        return _TAKEN
    set_mask, get_mask = calls
    if not verdicts.checks_on() or mx.default_device() != mx.cpu:
        return get_mask()
    with _LOCK:
        mask = 0
        for lo, hi in ROW_CLASSES:
            def check(lo=lo, hi=hi):
                kernel_s, blas_s = _time_class(lo, set_mask)
                won = kernel_s <= blas_s
                return verdicts.Verdict(
                    KERNEL, f"rows={lo}-{hi}", "native" if won else "slower",
                    f"{lo} rows: {kernel_s * 1e3:.2f} ms against OpenBLAS's {blas_s * 1e3:.2f} ms",
                    {"rows": lo, "kernel_ms": round(kernel_s * 1e3, 3), "openblas_ms": round(blas_s * 1e3, 3)})
            if verdicts.decide(KERNEL, f"rows={lo}-{hi}", check).used:
                mask |= ((1 << hi) - 1) ^ ((1 << (lo - 1)) - 1)
        _check_weights.cache_clear()  # 30 MB not kept past the timing
        set_mask(mask)
        _TAKEN = get_mask()
        return _TAKEN


def describe(preload: str | None = None) -> str | None:
    """Which BLAS answers MLX's CPU products in this process, from LD_PRELOAD; None if none."""
    preload = os.environ.get("LD_PRELOAD", "") if preload is None else preload
    for item in preload.replace(":", " ").split():
        if os.path.basename(item) == LIBRARY_NAME:
            try:
                return f"numpy's OpenBLAS {numpy_openblas().version} (preloaded via {LIBRARY_NAME})"
            except BlasShimError:
                return f"{LIBRARY_NAME} (preloaded)"
        if "openblas" in os.path.basename(item).lower():
            return f"OpenBLAS (preloaded: {item})"
    return None


_LOCK = threading.Lock()
_TAKEN = _initial_mask()  # bit m-1: products of m rows go to the shim's kernel in this process


def main(argv: list[str] | None = None) -> int:
    import argparse  # only when building the shim

    ap = argparse.ArgumentParser(
        prog="python -m edgespec.kernels.cpu_blas",
        description="Build the library to preload (LD_PRELOAD) so MLX's CPU matmuls run on numpy's OpenBLAS.")
    ap.add_argument("out", type=Path, help=f"where to write it, e.g. .cache/lib/{LIBRARY_NAME}")
    args = ap.parse_args(argv)
    try:
        target = build(args.out)
    except (BlasShimError, OSError, subprocess.SubprocessError) as e:
        print(f"cpu_blas: not built: {e}", file=sys.stderr)
        return 1
    print(f"cpu_blas: {args.out} forwards {', '.join(FORWARDED)} to {target.path} ({target.config})",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
