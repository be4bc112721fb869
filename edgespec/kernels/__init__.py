"""Custom kernels for the hot spots of decoding (tree / lookahead steps first), each with an MLX reference.

Each kernel is a Metal source string (`KernelSpec`) run through
`mx.fast.metal_kernel` on Apple GPUs, with a pure-MLX reference of identical
semantics that the dispatcher uses everywhere else. `emulate` compiles the
same Metal strings as C++ so the tests check them on Linux too.
"""

from edgespec.kernels.kv import KV_GATHER, commit_kv, kv_gather, kv_gather_reference
from edgespec.kernels.spec import KernelSpec, on_metal
from edgespec.kernels.tree import (
    TREE_ACCEPT,
    TREE_MASK,
    check_parents,
    tree_accept,
    tree_accept_reference,
    tree_mask,
    tree_mask_reference,
)

KERNELS = (TREE_MASK, TREE_ACCEPT, KV_GATHER)

# Bumped whenever a kernel change moves what a verifier pass costs, so that learnt costs from
# before are not reused (edgespec/calibration.py keys them on it). 2: the CPU device's base-2
# softmax and activations (kernels/attention.py, kernels/activation.py).
COSTS_REVISION = 2

__all__ = [
    "COSTS_REVISION",
    "KERNELS",
    "KV_GATHER",
    "TREE_ACCEPT",
    "TREE_MASK",
    "KernelSpec",
    "check_parents",
    "commit_kv",
    "kv_gather",
    "kv_gather_reference",
    "on_metal",
    "tree_accept",
    "tree_accept_reference",
    "tree_mask",
    "tree_mask_reference",
]
