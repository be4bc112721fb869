"""What a kernel is, independent of where it runs.

A `KernelSpec` holds the Metal body handed to `mx.fast.metal_kernel` and the
names of its inputs and outputs (the generated signature's parameter order).
`edgespec.kernels.emulate` compiles the very same strings as C++ on machines
without Metal; `metal()` builds the real kernel once per spec on Apple GPUs.

Self-check at first use: a dispatcher asks `usable(spec, variant, check)` before it runs a
kernel. On Metal the first ask per (kernel, variant: the dtype it is given) runs `check`, which
compiles the kernel and compares it with its pure-MLX reference on small inputs; the verdict is
kept per machine, device and MLX version (edgespec.kernels.verdicts, in $EDGESPEC_HOME), so the
check runs once per machine, not once per process. A compile error or a disagreement makes the
kernel's reference ops run instead, with a one-line warning, and the run goes on.
"""

from __future__ import annotations

import functools
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from edgespec.kernels.verdicts import Verdict, decide


@dataclass(frozen=True)
class KernelSpec:
    name: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    source: str
    header: str = ""


def prologue(threads: str, dims: str) -> str:
    """The opening lines every kernel body shares: its grid coordinates named (x, y, z in
    order: `threads`) and the entries of its `dims` input named in order (`dims`), e.g.
    prologue("d j n", "N K E") gives `uint d = thread_position_in_grid.x;` ... `int E = dims[2];`."""
    lines = [f"    uint {t} = thread_position_in_grid.{'xyz'[i]};" for i, t in enumerate(threads.split())]
    lines += [f"    int {d} = dims[{i}];" for i, d in enumerate(dims.split())]
    return "\n" + "\n".join(lines)


# Tests only (edgespec.kernels.emulate.standing_in): a function spec -> a callable standing in
# for the compiled kernel. While set, on_metal() is true and metal() returns its callables.
_backend: Callable[[KernelSpec], Callable] | None = None


def set_backend(build: Callable[[KernelSpec], Callable] | None):
    """Route metal() through `build` (None: the real mx.fast.metal_kernel); returns the previous
    one. Forgets this process's self-check outcomes (they were about the other backend)."""
    global _backend
    previous, _backend = _backend, build
    forget_checks()
    return previous


def on_metal() -> bool:
    """True where `mx.fast.metal_kernel` can run (an Apple GPU is the default device)."""
    if _backend is not None:
        return True
    try:
        return bool(mx.metal.is_available()) and mx.default_device().type == mx.DeviceType.gpu
    except Exception:  # noqa: BLE001 - builds without the metal module
        return False


def metal(spec: KernelSpec):
    """The kernel for `spec` (built once: every build is a Metal library compile; the compile
    itself happens at the first call's evaluation)."""
    if _backend is not None:
        return _backend(spec)
    return _compiled(spec)


@functools.cache
def _compiled(spec: KernelSpec):
    return mx.fast.metal_kernel(
        name=spec.name,
        input_names=list(spec.inputs),
        output_names=list(spec.outputs),
        source=spec.source,
        header=spec.header,
    )


# ---------------------------------------------------------------- self-check at first use


class KernelMismatch(RuntimeError):
    """A kernel's output disagreed with its reference's on the self-check's inputs."""


def compare(name: str, got, want, tol: float = 0.0) -> None:
    """Raise KernelMismatch unless `got` equals `want` (within `tol`, relative to want's scale),
    shape included; both MLX arrays (any dtype) or numpy arrays."""
    g = np.asarray(got.astype(mx.float32) if isinstance(got, mx.array) and got.dtype == mx.bfloat16 else got)
    w = np.asarray(want.astype(mx.float32) if isinstance(want, mx.array) and want.dtype == mx.bfloat16 else want)
    if g.shape != w.shape:
        raise KernelMismatch(f"{name}: shape {g.shape}, its reference's {w.shape}")
    if tol == 0.0:
        bad = ~((g == w) | (np.isnan(g.astype(np.float64)) & np.isnan(w.astype(np.float64))))
        if bad.any():
            at = tuple(int(i) for i in np.argwhere(bad)[0])
            raise KernelMismatch(f"{name}: {int(bad.sum())} of {g.size} entries differ from its reference "
                                 f"(first at {at}: {g[at]} vs {w[at]})")
        return
    g64, w64 = g.astype(np.float64), w.astype(np.float64)
    err = float(np.max(np.abs(g64 - w64), initial=0.0))
    scale = max(1.0, float(np.max(np.abs(w64), initial=0.0)))
    if not err <= tol * scale:  # NaN fails too
        raise KernelMismatch(f"{name}: differs from its reference by {err:.3g} (allowed {tol * scale:.3g})")


_checked: dict[tuple[str, str], bool] = {}
_check_lock = threading.Lock()


def forget_checks() -> None:
    """Ask the verdict store again at the next use (tests; a new backend)."""
    with _check_lock:
        _checked.clear()


def usable(spec: KernelSpec, variant: str, check: Callable[..., None], *args) -> bool:
    """Whether to run `spec`'s kernel at `variant` (the dtype it is given): off Metal never; on
    Metal once it has passed its self-check here. The first ask per (kernel, variant) in a
    process reads the verdict kept for this machine or, if none, runs `check(*args)` (compiles
    and runs the kernel on small inputs, raising on a compile error or on a mismatch with its
    reference) and keeps the outcome. A kernel that failed warns once, in one line, and its
    dispatcher runs the reference ops instead."""
    if not on_metal():
        return False
    key = (spec.name, variant)
    ok = _checked.get(key)
    if ok is not None:
        return ok
    with _check_lock:
        ok = _checked.get(key)
        if ok is None:
            v = decide(spec.name, variant, functools.partial(_run_check, spec, variant, check, args))
            ok = v.used
            if not ok:
                warnings.warn(f"edgespec: Metal kernel {spec.name} ({variant or 'any dtype'}) is not used on this "
                              f"machine ({v.status}: {v.note}); its reference ops run instead", RuntimeWarning,
                              stacklevel=3)
            _checked[key] = ok
    return ok


def _run_check(spec: KernelSpec, variant: str, check: Callable[..., None], args) -> Verdict:
    check(*args)
    return Verdict(spec.name, variant, "native", "agrees with its reference on the self-check's inputs")


def dtype_name(dtype) -> str:
    """The variant name of an MLX dtype ("float16", "bfloat16", "float32", ...)."""
    return str(dtype).rpartition(".")[2]
