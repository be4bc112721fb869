"""Run a kernel's exact Metal source on the CPU, as C++, for tests without a Mac.

`EmulatedKernel(spec, in_dtypes, out_dtypes)` writes a C++17 file: the header
`metal_emu.h` (the subset of the Metal language the kernels use), the kernel
signature the way `mx.fast.metal_kernel` generates it (`const device T* name`
per input, `device T* name` per output, `uint3 thread_position_in_grid`), the
spec's source string unchanged as the body, and a driver that calls the body
once per grid position. It is compiled with g++ into a shared library and
called through ctypes on numpy buffers.

Limits: threads run one after another, so races between threads and
threadgroup-level features cannot be checked (the kernels use neither).
"""

from __future__ import annotations

import ctypes
import hashlib
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np

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
}


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
        self.in_dtypes = [np.dtype(d) for d in in_dtypes]
        self.out_dtypes = [np.dtype(d) for d in out_dtypes]
        in_t = [_TYPES[d] for d in self.in_dtypes]
        out_t = [_TYPES[d] for d in self.out_dtypes]
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
        """Run every grid position; outputs start filled with `init` (GPU memory is not)."""
        ins = [
            np.ascontiguousarray(a, dtype=d) for a, d in zip(inputs, self.in_dtypes, strict=False)
        ]
        outs = [
            np.full(s, init, dtype=d) for s, d in zip(output_shapes, self.out_dtypes, strict=False)
        ]
        bufs = (ctypes.c_void_p * (len(ins) + len(outs)))(*[a.ctypes.data for a in ins + outs])
        self._fn(bufs, *[int(g) for g in grid])
        return outs
