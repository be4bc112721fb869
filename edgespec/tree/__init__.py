"""Tree speculation: candidate trees from several sources, dynamic shapes, and the cascade drafter."""

from edgespec.tree.candidates import SourceTree
from edgespec.tree.cascade import CascadeDrafter
from edgespec.tree.controller import TreeBudget, TreeCosts, calibrate_tree
from edgespec.tree.drafting import TreeDrafter, TreePlan

__all__ = [
    "CascadeDrafter",
    "SourceTree",
    "TreeBudget",
    "TreeCosts",
    "TreeDrafter",
    "TreePlan",
    "calibrate_tree",
]
