"""The gated MLP activation, act(gate) * up, for prompt chunks on the CPU device.

MLX's CPU backend evaluates transcendental functions element by element at about 15 ns
each (measured here, mlx 0.32: `nn.silu(gate) * up` on a 512 x 1,536 chunk of SmolLM2
took 15 ms, three times the down projection's matmul; a 512-token prefill runs about
1.3x faster with this path, benchmarks/cpu_kernels.py). numpy's `exp`/`tanh` run at about 2.3 ns an element, so past
`CPU_NUMPY_MIN_ROWS` rows the CPU computes the activation with numpy, on the same
buffers, the rows split over one thread per core (numpy releases the GIL in its loops).

Only calls that need no gradient may take this path (numpy is invisible to MLX's
autodiff): models pass `inference=True` only when they run with a KV cache, as the
attention path does. Metal, and decoding steps everywhere, keep MLX's kernels.
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from edgespec.kernels import base2, exact
from edgespec.kernels.attention import CPU_NUMPY_MIN_QUERIES, _pool, _workers

# Prompt chunks only, as for attention: verification rounds (at most 64 rows) and decoding
# steps stay in one MLX graph (a numpy call is a synchronisation point).
CPU_NUMPY_MIN_ROWS = CPU_NUMPY_MIN_QUERIES
# Whether numpy's path runs at all: as built until this host's verdict (apply_verdicts).
KERNEL = "cpu_numpy_activation"
TAKES = {"numpy": True}
_GELU_C = np.float32(math.sqrt(2 / math.pi))


def _silu_times(g: np.ndarray, u: np.ndarray, out: np.ndarray) -> None:
    np.negative(g, out=out)
    np.exp(out, out=out)  # g below -88 gives inf, and g / inf = -0: silu's limit
    out += 1.0
    np.divide(g, out, out=out)
    out *= u


def _gelu_tanh_times(g: np.ndarray, u: np.ndarray, out: np.ndarray) -> None:
    # 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))), in the order MLX's gelu_approx uses
    np.multiply(g, g, out=out)
    out *= np.float32(0.044715)
    out *= g
    out += g
    out *= _GELU_C
    np.tanh(out, out=out)
    out += 1.0
    out *= g
    out *= np.float32(0.5)
    out *= u


_NUMPY = {"silu": _silu_times, "gelu_pytorch_tanh": _gelu_tanh_times}
_MLX = {"silu": nn.silu, "gelu_pytorch_tanh": nn.gelu_approx, "gelu": nn.gelu}
ACTIVATIONS = tuple(_MLX)

# Float32 on the CPU device: SiLU and the tanh GELU through power(2, .) (edgespec.kernels.base2).
_BASE2 = {"silu": base2.silu, "gelu_pytorch_tanh": base2.gelu_tanh}


def activate(kind: str, gate: mx.array) -> mx.array:
    """act(gate) for the activation named `kind` (an ACTIVATIONS entry), in MLX's graph."""
    return _BASE2[kind](gate) if kind in _BASE2 else _MLX[kind](gate)


def use_numpy_activation(kind: str, gate: mx.array) -> bool:
    rows = gate.size // gate.shape[-1] if gate.ndim else 0
    # not in bitwise mode: numpy's exp rounds other than MLX's, which one-token passes use
    return (TAKES["numpy"] and kind in _NUMPY and rows >= CPU_NUMPY_MIN_ROWS and mx.default_device() == mx.cpu
            and not exact.enabled())


def gated_activation(kind: str, gate: mx.array, up: mx.array, inference: bool = False) -> mx.array:
    """act(gate) * up for the activation named `kind` (an ACTIVATIONS entry)."""
    if not (inference and use_numpy_activation(kind, gate)):
        return activate(kind, gate) * up
    return numpy_gated(kind, gate, up)


def numpy_gated(kind: str, gate: mx.array, up: mx.array) -> mx.array:
    """act(gate) * up computed by numpy (kinds in _NUMPY), the rows split over one thread a core."""
    mx.eval(gate, up)
    f32 = gate.dtype == mx.float32 and up.dtype == mx.float32
    g = np.asarray(gate if f32 else gate.astype(mx.float32)).reshape(-1, gate.shape[-1])
    u = np.asarray(up if f32 else up.astype(mx.float32)).reshape(-1, up.shape[-1])
    out = np.empty(g.shape, np.float32)
    fn = _NUMPY[kind]
    workers = _workers()
    cuts = np.linspace(0, g.shape[0], workers + 1).astype(int)

    def piece(i: int) -> None:
        a, b = cuts[i], cuts[i + 1]
        with np.errstate(over="ignore"):
            fn(g[a:b], u[a:b], out[a:b])

    if workers == 1:
        piece(0)
    else:
        list(_pool().map(piece, range(workers)))
    result = mx.array(out.reshape(gate.shape))
    return result if gate.dtype == mx.float32 else result.astype(gate.dtype)


def apply_verdicts() -> dict[str, bool]:
    """Whether numpy's path runs in this process (TAKES): timed once per machine against MLX's
    graph (the base-2 form where that runs) on a 256-row prompt chunk of a 1,536-wide SiLU MLP,
    the verdict kept (edgespec.kernels.verdicts). Off the CPU device or with checks off: as built.
    Call after base2.apply_verdicts (what it replaces depends on it)."""
    from edgespec.kernels import verdicts

    if mx.default_device() != mx.cpu or not verdicts.checks_on():
        return dict(TAKES)
    keys = mx.random.split(mx.random.key(13), 2)
    g, u = (mx.random.normal((256, 1536), key=k) for k in keys)
    mx.eval(g, u)
    variant = f"against={'base2' if base2.applies(g) else 'mlx'}"

    def check():
        return verdicts.race(KERNEL, variant, lambda: mx.eval(numpy_gated("silu", g, u)),
                             lambda: mx.eval(activate("silu", g) * u), what="MLX's graph")
    TAKES["numpy"] = verdicts.decide(KERNEL, variant, check).used
    return dict(TAKES)
