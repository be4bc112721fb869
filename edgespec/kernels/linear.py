"""Linear layers whose few-row products take the faster BLAS call on the CPU device.

MLX computes `x @ W.T` for a Linear layer. On its CPU backend (OpenBLAS) a product of a
few rows against a transposed weight is slow for row counts that are not a multiple of
16, while the same product written `(W @ x.T).T` is not (measured here, 576 -> 1,536
weights: 4 rows 0.53 vs 0.31 ms, 8 rows 0.54 vs 0.40 ms; at 64 rows both 1.07 ms).
Whole SmolLM2 decoding passes (benchmarks/cpu_kernels.py): 4 and 8 rows 5-16% faster
the second way in three runs of four, 11-14% slower in one; 1 row within noise (see
benchmarks/results/batching.md). So on the CPU, calls of up to CPU_SWAP_MAX_ROWS rows
(decoding steps, verification rounds, batched passes) use the second form; prompt
chunks, and every call on Metal, keep MLX's. Both forms are differentiable.

Where the CBLAS shim's few-row kernel answers MLX's products (Linux, `make`; cpu_blas.py),
both forms reach that kernel and give the same bits, so calls of a row count it takes
(`cpu_blas.takes`: those where it beats OpenBLAS on this host) keep `x @ W.T`: three ops fewer a product (the transposes and the
reshape), which a verifier pass pays when its graph is built and run. Passes of SmolLM2 at 150 keys, the two forms in pairs
(one-off script, 80 pairs): -0.29 / -1.01 / -1.28 / -0.98 ms for 1 / 2 / 4 / 8 tokens, the
graph's building -0.35 to -0.45 ms of them (benchmarks/results/adaptive.md).

`W.T` is itself a graph node, built and run at every call: 210 a SmolLM2 pass. A model loaded
for inference (`edgespec.weights.loader.build_model`) has each Linear keep its weight's
transposed view (`keep_transposed`: a view, no copy), used while the weight is the one it was
taken of; a replaced weight (training, `update`) drops it. The product is the same call on the
same strides, so the same bits. Passes of SmolLM2 at 150 keys, in pairs (60 pairs, one-off
script): -1.0 / -0.7 / -0.2 ms at 1 / 4 / 8 tokens (of 50 / 55 / 63).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from edgespec.kernels import cpu_blas, exact, host
from edgespec.kernels.spec import on_metal

CPU_SWAP_MAX_ROWS = 64


class Linear(nn.Linear):
    """nn.Linear (same parameters, same quantization) with the CPU few-row product above."""

    def __call__(self, x: mx.array) -> mx.array:
        if exact.enabled():  # bitwise verification: rows independent of the pass width (kernels/exact.py)
            return exact.exact_linear(x, self["weight"], self["bias"] if "bias" in self else None)
        rows = x.size // x.shape[-1] if x.ndim >= 2 else 0
        if not rows or rows > CPU_SWAP_MAX_ROWS or cpu_blas.takes(rows) \
                or mx.default_device() != mx.cpu:
            kept = self.__dict__.get("_transposed")
            if kept is None:
                return super().__call__(x)
            if kept[0] is not self["weight"]:  # replaced since: the view is of the old weight
                del self.__dict__["_transposed"]
                return super().__call__(x)
            if "bias" in self:  # nn.Linear's two forms, on the kept view
                return mx.addmm(self["bias"], x, kept[1])
            return x @ kept[1]
        y = (self["weight"] @ x.reshape(-1, x.shape[-1]).T).T.reshape(*x.shape[:-1], -1)
        return y + self["bias"] if "bias" in self else y

    def to_quantized(self, *args, **kw):
        """Quantized as nn.Linear is, into the QuantizedLinear below (bitwise mode reaches it)."""
        q = super().to_quantized(*args, **kw)
        q.__class__ = QuantizedLinear
        return q


def keep_transposed(model: nn.Module) -> int:
    """Each `Linear` of `model` keeps its weight's transposed view for its products (evaluated
    here; it shares the weight's memory). For models loaded for inference. -> how many.
    Also settles which CPU kernels run on this host (kernels/host.py: each only where it beats
    what it replaces here)."""
    host.settle()
    kept = []
    for _, mod in model.named_modules():
        if type(mod) is Linear:  # not a QuantizedLinear (no "weight" to transpose as such)
            w = mod["weight"]
            wt = w.T
            # outside the module's parameter tree: a plain attribute, not a parameter
            mod.__dict__["_transposed"] = (w, wt)
            kept.append(wt)
    mx.eval(kept)
    return len(kept)


class QuantizedLinear(nn.QuantizedLinear):
    """nn.QuantizedLinear whose product keeps rows independent of the pass width in bitwise
    mode on Metal (edgespec/kernels/exact.py). MLX's CPU product is row by row already."""

    def __call__(self, x: mx.array) -> mx.array:
        if exact.enabled() and on_metal():
            return exact.exact_quantized_linear(x, self)
        return super().__call__(x)
