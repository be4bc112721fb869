"""What a kernel is, independent of where it runs.

A `KernelSpec` holds the Metal body handed to `mx.fast.metal_kernel` and the
names of its inputs and outputs (the generated signature's parameter order).
`edgespec.kernels.emulate` compiles the very same strings as C++ on machines
without Metal; `metal()` builds the real kernel once per spec on Apple GPUs.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import mlx.core as mx


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


def on_metal() -> bool:
    """True where `mx.fast.metal_kernel` can run (an Apple GPU is the default device)."""
    try:
        return bool(mx.metal.is_available()) and mx.default_device().type == mx.DeviceType.gpu
    except Exception:  # noqa: BLE001 - builds without the metal module
        return False


@functools.cache
def metal(spec: KernelSpec):
    """The compiled kernel (built once: every build is a Metal library compile)."""
    return mx.fast.metal_kernel(
        name=spec.name,
        input_names=list(spec.inputs),
        output_names=list(spec.outputs),
        source=spec.source,
        header=spec.header,
    )
