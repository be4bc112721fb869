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

# Every Metal kernel by the name its self-check verdict is kept under (edgespec.kernels.spec.usable;
# a name ending in "_" is a family, one kernel per key head size), what it does, and the dtypes
# the test suite runs it at through the C++ emulation (tests/test_kernels_dtypes.py): the dtypes
# a Mac gives it. `edgespec doctor` lists them.
METAL_KERNELS: dict[str, tuple[str, tuple[str, ...]]] = {
    "edgespec_tree_mask": ("tree and lookahead steps: attention mask and positions", ("int32",)),
    "edgespec_tree_accept": ("greedy acceptance of a token tree", ("int32",)),
    "edgespec_kv_gather": ("KV commit of an accepted tree path", ("float32", "float16", "bfloat16")),
    "edgespec_exact_linear": ("bitwise mode: width-invariant products (given float32)",
                              ("float32", "float16", "bfloat16")),
    "edgespec_exact_attention": ("bitwise mode: width-invariant attention (given float32)",
                                 ("float32", "float16", "bfloat16")),
    "edgespec_gated_delta_": ("Gated DeltaNet recurrent passes (given float32)", ("float32", "float16")),
    "edgespec_expert_gate_up": ("MoE experts, dense weights (with edgespec_expert_down)",
                                ("float32", "float16", "bfloat16")),
    "edgespec_expert_gate_up_q": ("MoE experts, 2/4/8-bit weights (with edgespec_expert_down_q)",
                                  ("float32", "float16", "bfloat16")),
}

# Bumped whenever a kernel change moves what a verifier pass costs, so that learnt costs from
# before are not reused (edgespec/calibration.py keys them on it). 2: the CPU device's base-2
# softmax and activations (kernels/attention.py, kernels/activation.py).
COSTS_REVISION = 2

__all__ = [
    "COSTS_REVISION",
    "KERNELS",
    "KV_GATHER",
    "METAL_KERNELS",
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
