"""Which CPU kernels run on this host: each is used only where it beats what it replaces here.

`settle()` is called when a model is loaded for inference (kernels/linear.keep_transposed). It
applies this machine's verdicts (edgespec.kernels.verdicts), timing a kernel against what it
replaces the first time a machine meets it, in an order where each check meets the paths already
settled:

1. the BLAS shim's few-row product, per row class, against OpenBLAS (cpu_blas);
2. the base-2 exponentials against MLX's `exp` (base2);
3. attention: the grouped base-2 path against MLX's fused kernel, numpy's prompt-chunk path
   against the decoding one (attention);
4. the gated activation's numpy path for prompt chunks against MLX's graph (activation).

The int8 drafter's native pass is not among them: it replaces no other pass of its own; what it
costs is measured by the decoder that drafts with it, which prices it against plain steps and
stops drafting with it where it does not pay (edgespec.adaptive).

Off the CPU device, or with EDGESPEC_KERNEL_CHECKS=off (the test suite), every kernel runs as
built and nothing is timed. `edgespec doctor` lists the verdicts.
"""

from __future__ import annotations

import threading

from edgespec.kernels import activation, attention, base2, cpu_blas

_LOCK = threading.Lock()


def settle() -> dict[str, object]:
    """Apply this host's verdicts to every CPU kernel (timing those not yet judged here)
    -> what runs: {"blas_rows_mask", "base2", "attention", "activation"}."""
    with _LOCK:
        mask = cpu_blas.apply_verdicts()
        b2 = base2.apply_verdicts()
        att = attention.apply_verdicts()
        act = activation.apply_verdicts()
    return {"blas_rows_mask": mask, "base2": b2, "attention": att, "activation": act}
