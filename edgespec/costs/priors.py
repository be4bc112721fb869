"""The planner's priors for Metal, in one table: what each is, where it is defined, its value on
the CPU and on Metal, and what the Metal value rests on.

Every prior of the planner applies only until the quantity is measured on the machine itself
(edgespec/calibration.py, edgespec/adaptive/estimate.py); the CPU values were measured on a
2-core x86 machine or guessed there. On Metal nothing was measured: the values below come from
the roofline model of the mid-range profile (edgespec.costs.model, calibrated to published
figures) for the default model at q4_0 where the model can say, and are guesses otherwise.
`metal_priors()` computes the model-derived entries; docs/costs.md explains the model.
"""

from __future__ import annotations

from edgespec.costs.model import SHAPES, RooflineCosts
from edgespec.costs.profiles import MID_RANGE

# name -> (defined in, CPU value and its basis, Metal value's basis)
METAL_PRIORS: dict[str, tuple[str, str, str]] = {
    "PRIOR_SLOPE[gpu]": ("edgespec/calibration.py", "0.08 plain steps per extra token (measured, 2-core x86)",
                         "0.02 in the code (a guess); the roofline: `slope` below"),
    "PRIOR_STEP_S": ("edgespec/calibration.py", "0.05 s (a guess: only ratios matter)",
                     "the roofline's plain step: `plain_step_s` below"),
    "DRAFT_PRIOR_FACTOR": ("edgespec/calibration.py", "1.5 x the drafter's weight share (measured: 0.087 "
                           "of a step for the shipped drafter on the 2-core x86)",
                           "the roofline: a small drafter is launch-bound, `draft_share` below"),
    "SIZES (calibration grid)": ("edgespec/calibration.py", "1..16, 20, 24, 32, 48, 64 (measured bends of "
                                 "a CPU BLAS)", "a guess: the same grid"),
    "SIZES (tree grid)": ("edgespec/tree/controller.py", "1..64, dense below 8 (a guess)", "a guess"),
    "DEFAULTS_GPU (lookahead)": ("edgespec/modes/lookahead.py", "DEFAULTS: W=2, N=3, G=2 (measured sweep, "
                                 "2-core x86)", "W=5, N=4, G=5: a guess (the paper's larger window)"),
    "RUNNER_UPS": ("edgespec/adaptive/sources.py", "0 (measured: runner-ups lost on the CPU)", "a guess: 0"),
    "MAX_BATCH_CAP": ("edgespec/batch/memory.py", "8 (measured: 8 rows ~1.4x one pass on the CPU)",
                      "a guess; the roofline prices 8 rows at `batch8` below"),
    "contention model (SCALE_MAX .. BUSY)": ("edgespec/adaptive/estimate.py",
                                             "tuned under load on the 2-core x86 (guesses)",
                                             "a guess: the same; a Mac's GPU is not shared the same way"),
}


def metal_priors(profile: str = MID_RANGE, model: str = "smollm2-135m", fmt: str = "q4_0",
                 drafter: str | None = None, L: int = 256) -> dict[str, float]:
    """The model-derived Metal values: the plain step's seconds, the slope per extra token in
    plain steps (over 1..8 tokens), a drafted token's share of a plain step for a 2-layer drafter
    of the model's width (the shipped distilled drafter's depth) and a pass of 8 tokens in steps."""
    m = RooflineCosts(profile, SHAPES[model], fmt)
    one = m.verify(1, L)
    s = SHAPES[model]
    small = SHAPES[drafter] if drafter else type(s)(2, s.hidden, s.intermediate, s.heads, s.kv_heads,
                                                     s.head_dim, s.vocab, s.tied)
    return dict(plain_step_s=one, slope=(m.verify(8, L) / one - 1.0) / 7.0,
                draft_share=m.draft_step(small, fmt, "gpu", L=L) / one, batch8=m.verify(8, L) / one)
