"""Exponentials as `power(2, .)` on the CPU device: the softmax of attention, SiLU, the tanh GELU
and sigmoid gates.

MLX's CPU `exp` evaluates its polynomial with a call to libm's `fmaf` for each term (mlx 0.32:
`fmaf` is among libmlx's imports), about 21 ns an element here, `sigmoid` 26 and `tanh` 19,
against 0.4 ns for a product; `power(2, x)` runs at about 6 ns. A verifier pass pays these per
token: SiLU over 8 tokens of SmolLM2 (30 layers of 1,536) took about 8 ms of a 60-90 ms pass,
and attention's softmax over 8 queries against 600 keys most of a layer's attention. So on the
CPU device, for float32:

- `sigmoid(x) = 1 / (1 + 2 ** (-x log2 e))`, `silu(x) = x / (1 + 2 ** (-x log2 e))`, and the
  tanh GELU `0.5 x (1 + tanh u) = x sigmoid(2u)`; within float32 rounding of the float64
  definitions (tests/test_activation_kernel.py), and element by element, so a row is the same
  in a pass of any width (bitwise mode keeps them);
- attention scores in base 2 (`kernels.attention.grouped_attention`).

Metal keeps MLX's own (its `exp` is fast), as do half-precision arrays (a half-precision
exponent argument in base 2 would round more than MLX's own). `EDGESPEC_BASE2=0` turns this off
for the process (comparisons: docs/adaptive.md); learnt costs are kept apart (the calibration
key names the setting). Where it is on, it is used only where it wins: `apply_verdicts` times it
against MLX's own exponentials once per machine (the MLX build's `exp` may be fast), and a host
where it loses keeps MLX's forms (edgespec.kernels.verdicts).
"""

from __future__ import annotations

import os

import mlx.core as mx
import mlx.nn as nn

ENABLED = os.environ.get("EDGESPEC_BASE2", "1") != "0"
LOG2E = 1.4426950408889634
_GELU_2C = 2 * 0.7978845608028654  # 2 sqrt(2 / pi)


KERNEL = "cpu_base2_exp"


def apply_verdicts() -> bool:
    """Whether the base-2 forms run in this process: on (EDGESPEC_BASE2) and, on the CPU device
    with kernel checks on, no slower on this machine than MLX's `exp` (SiLU over a 16-row pass of
    a 1,536-wide MLP and a softmax's exponentials over 72 query rows against 600 keys, timed once
    per machine, the verdict kept). -> ENABLED as it now stands."""
    global ENABLED
    from edgespec.kernels import verdicts

    if not ENABLED or mx.default_device() != mx.cpu or not verdicts.checks_on():
        return ENABLED
    key = mx.random.key(7)
    x, s = mx.random.normal((16, 1536), key=key), mx.random.normal((72, 600), key=mx.random.split(key)[0])
    mx.eval(x, s)

    def check():
        return verdicts.race(KERNEL, "", lambda: mx.eval([(_silu(x), mx.power(2.0, s)) for _ in range(8)]),
                             lambda: mx.eval([(nn.silu(x), mx.exp(s)) for _ in range(8)]), what="MLX's exp")
    ENABLED = verdicts.decide(KERNEL, "", check).used
    return ENABLED


def applies(*arrays: mx.array) -> bool:
    """True where these arrays take the base-2 forms: on, the CPU device, all float32."""
    return ENABLED and all(a.dtype == mx.float32 for a in arrays) and mx.default_device() == mx.cpu


def sigmoid(x: mx.array) -> mx.array:
    return _sigmoid(x) if applies(x) else mx.sigmoid(x)


def silu(x: mx.array) -> mx.array:
    return _silu(x) if applies(x) else nn.silu(x)


def gelu_tanh(x: mx.array) -> mx.array:
    """0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) = x sigmoid(2 sqrt(2/pi) (x + 0.044715 x^3))."""
    return _gelu_tanh(x) if applies(x) else nn.gelu_approx(x)


# Not mx.compile'd: measured the same (power is the cost), and a compiled function is one more
# C++ compilation for a fresh machine's first request.
def _sigmoid(x):
    return 1.0 / (1.0 + mx.power(2.0, x * -LOG2E))


def _silu(x):
    return x / (1.0 + mx.power(2.0, x * -LOG2E))  # x below about -88: x / inf = -0, SiLU's limit


def _gelu_tanh(x):
    return x / (1.0 + mx.power(2.0, (x * (1.0 + 0.044715 * (x * x))) * (-_GELU_2C * LOG2E)))
