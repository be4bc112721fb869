"""Run a kernel's exact Metal source on the CPU, as C++, for tests without a Mac.

`EmulatedKernel(spec, in_dtypes, out_dtypes)` writes a C++17 file: the header
`metal_emu.h` (the subset of the Metal language the kernels use), the kernel
signature the way `mx.fast.metal_kernel` generates it (`const device T* name`
per input, `device T* name` per output, `uint3 thread_position_in_grid`), the
spec's source string unchanged as the body, and a driver that calls the body
once per grid position. It is compiled with g++ into a shared library and
called through ctypes on numpy buffers.

Buffers of Metal's 16-bit floats: numpy's float16 is `float16_t` (Metal's `half`); bfloat16,
which numpy lacks, is given as the string "bfloat16" and held as its 16 bits (np.uint16), the
way MLX stores it (`mx.array.view(mx.uint16)`). metal_emu.h gives both Metal's rounding.

`MetalStandIn(spec)` is called like the kernel `mx.fast.metal_kernel` returns (MLX arrays
in and out): with `standing_in()` (the tests' switch), `spec.on_metal()` is true and
`spec.metal()` hands these out, so every dispatcher takes its Metal path on any machine.

Limits: threads run one after another, so races between threads and
threadgroup-level features cannot be checked (the kernels use neither).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import mlx.core as mx
import numpy as np

from edgespec.kernels import spec as _spec
from edgespec.kernels.spec import KernelSpec

HEADER = Path(__file__).with_name("metal_emu.h")

# numpy dtype -> the type name MLX writes into the signature.
_TYPES = {
    np.dtype(np.float32): "float",
    np.dtype(np.int32): "int32_t",
    np.dtype(np.uint32): "uint32_t",
    np.dtype(np.int64): "int64_t",
    np.dtype(np.bool_): "bool",
    np.dtype(np.uint8): "uint8_t",
    np.dtype(np.float16): "float16_t",
}
BFLOAT16 = "bfloat16"  # numpy has no bfloat16: its bits travel as uint16


def _storage(d) -> tuple[np.dtype, str]:
    """(numpy dtype of the buffer, the type name MLX writes into the signature) for a dtype."""
    if isinstance(d, str) and d == BFLOAT16:
        return np.dtype(np.uint16), "bfloat16_t"
    if isinstance(d, mx.Dtype):
        return _storage(BFLOAT16 if d == mx.bfloat16 else np.dtype(_MX_TO_NP[d]))
    d = np.dtype(d)
    return d, _TYPES[d]


_MX_TO_NP = {mx.float32: np.float32, mx.float16: np.float16, mx.int32: np.int32, mx.uint32: np.uint32,
             mx.int64: np.int64, mx.bool_: np.bool_, mx.uint8: np.uint8}


def compiler() -> str | None:
    return shutil.which("g++") or shutil.which("clang++")


def signature(spec: KernelSpec, in_types: list[str], out_types: list[str]) -> str:
    """The kernel function header, in the form mx.fast.metal_kernel generates."""
    params = [
        f"  const device {t}* {n} [[buffer({i})]]"
        for i, (n, t) in enumerate(zip(spec.inputs, in_types, strict=False))
    ]
    k = len(params)
    params += [
        f"  device {t}* {n} [[buffer({k + i})]]"
        for i, (n, t) in enumerate(zip(spec.outputs, out_types, strict=False))
    ]
    params.append("  uint3 thread_position_in_grid [[thread_position_in_grid]]")
    return f"[[kernel]] void custom_kernel_{spec.name}(\n" + ",\n".join(params) + ")"


def cpp_source(spec: KernelSpec, in_types: list[str], out_types: list[str]) -> str:
    args = [f"({t}*)bufs[{i}]" for i, t in enumerate(in_types + out_types)]
    args.append("uint3{x, y, z}")
    return "\n".join(
        [
            f'#include "{HEADER}"',
            spec.header,
            signature(spec, in_types, out_types) + " {",
            spec.source,
            "}",
            "#undef device",
            "#undef constant",
            "#undef thread",
            'extern "C" void run_grid(void** bufs, unsigned gx, unsigned gy, unsigned gz) {',
            "  for (unsigned z = 0; z < gz; ++z)",
            "    for (unsigned y = 0; y < gy; ++y)",
            "      for (unsigned x = 0; x < gx; ++x)",
            f"        custom_kernel_{spec.name}({', '.join(args)});",
            "}",
            "",
        ]
    )


class EmulatedKernel:
    """A KernelSpec compiled for the CPU; call it like mx.fast.metal_kernel's kernel."""

    def __init__(self, spec: KernelSpec, in_dtypes, out_dtypes, workdir: str | Path | None = None):
        cxx = compiler()
        if cxx is None:
            raise RuntimeError(
                "no C++ compiler (g++ or clang++) on PATH: cannot emulate Metal kernels"
            )
        self.spec = spec
        ins, outs = [_storage(d) for d in in_dtypes], [_storage(d) for d in out_dtypes]
        self.in_dtypes, in_t = [d for d, _ in ins], [t for _, t in ins]
        self.out_dtypes, out_t = [d for d, _ in outs], [t for _, t in outs]
        self.code = cpp_source(spec, in_t, out_t)
        digest = hashlib.sha1(self.code.encode()).hexdigest()[:16]
        folder = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="edgespec_emu_"))
        src, lib = folder / f"{spec.name}_{digest}.cpp", folder / f"{spec.name}_{digest}.so"
        if not lib.exists():
            src.write_text(self.code)
            cmd = [cxx, "-std=c++17", "-O1", "-shared", "-fPIC", "-Wno-attributes", "-Werror=return-type",
                   "-o", str(lib), str(src)]  # fmt: skip
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                raise RuntimeError(
                    f"emulated Metal kernel {spec.name} failed to compile:\n{r.stderr[-3000:]}"
                )
        self._fn = ctypes.CDLL(str(lib)).run_grid
        self._fn.argtypes = [
            ctypes.POINTER(ctypes.c_void_p),
            ctypes.c_uint,
            ctypes.c_uint,
            ctypes.c_uint,
        ]

    def __call__(self, inputs, grid, output_shapes, init=0) -> list[np.ndarray]:
        """Run every grid position; outputs start filled with `init` (GPU memory is not; a
        bfloat16 output starts as the bits of `init` as a bfloat16: 0 or NaN)."""
        ins = [
            np.ascontiguousarray(a, dtype=d) for a, d in zip(inputs, self.in_dtypes, strict=False)
        ]
        outs = [
            np.full(s, init, dtype=d) if d != np.uint16 or init == 0 else np.full(s, 0x7FC0, dtype=d)
            for s, d in zip(output_shapes, self.out_dtypes, strict=False)
        ]
        bufs = (ctypes.c_void_p * (len(ins) + len(outs)))(*[a.ctypes.data for a in ins + outs])
        self._fn(bufs, *[int(g) for g in grid])
        return outs


# ---------------------------------------------------------------- standing in for Metal


def to_numpy(a: mx.array) -> np.ndarray:
    """An MLX array as the buffer a kernel reads (bfloat16 as its 16 bits)."""
    return np.array(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a)


def from_numpy(a: np.ndarray, dtype: mx.Dtype) -> mx.array:
    out = mx.array(a)
    return out.view(mx.bfloat16) if dtype == mx.bfloat16 else out


class MetalStandIn:
    """Called like the kernel `mx.fast.metal_kernel` builds for `spec`: MLX arrays in, MLX arrays
    out, the spec's source run by the C++ emulation (one compile per dtype signature)."""

    def __init__(self, spec: KernelSpec, workdir: str | Path):
        self.spec, self.workdir, self.built, self.calls = spec, Path(workdir), {}, 0

    def __call__(self, *, inputs, grid, threadgroup, output_shapes, output_dtypes, init_value=None,
                 verbose=False, template=None, stream=None):
        if template:
            raise NotImplementedError("the emulation has no template arguments (no kernel uses them)")
        arrays = [a if isinstance(a, mx.array) else mx.array(a) for a in inputs]
        mx.eval(arrays)
        key = (tuple(a.dtype for a in arrays), tuple(output_dtypes))
        if key not in self.built:
            self.built[key] = EmulatedKernel(self.spec, list(key[0]), list(key[1]), self.workdir)
        outs = self.built[key]([to_numpy(a) for a in arrays], grid, [tuple(s) for s in output_shapes],
                               init=0 if init_value is None else init_value)
        self.calls += 1
        return [from_numpy(o, d) for o, d in zip(outs, output_dtypes, strict=True)]


_lock = threading.Lock()


@contextlib.contextmanager
def standing_in(workdir: str | Path | None = None):
    """Within: `on_metal()` is true and every kernel runs through MetalStandIn (the tests'
    switch that makes this machine take a Mac's kernel paths). Yields {spec name: stand-in}."""
    folder = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="edgespec_emu_"))
    folder.mkdir(parents=True, exist_ok=True)
    made: dict[str, MetalStandIn] = {}

    def build(spec: KernelSpec):
        with _lock:
            if spec.name not in made:
                made[spec.name] = MetalStandIn(spec, folder)
            return made[spec.name]

    previous = _spec.set_backend(build)
    try:
        yield made
    finally:
        _spec.set_backend(previous)
