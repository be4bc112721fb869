"""Weight-free lookahead decoding: Jacobi window + n-gram pool, verified as one token tree."""

from edgespec.lookahead.controller import StepController
from edgespec.lookahead.pool import JacobiWindow, NgramPool
from edgespec.lookahead.tree import StepTree
from edgespec.lookahead.verify import greedy_pass, sample_walk, tree_forward, verify_step

__all__ = [
    "JacobiWindow",
    "NgramPool",
    "StepController",
    "StepTree",
    "greedy_pass",
    "sample_walk",
    "tree_forward",
    "verify_step",
]
