"""Mode `tree` with a drafter that grows whole trees itself (DrafterCaps.trees: an EAGLE-3 head).

Such a drafter keeps its own state and drafts from where the committed sequence stands (it may
read the verifier's cache: `bind_verifier_cache`), so the mode hands it the plan and takes its
`DraftTree` into the pass's candidate trie, each node tagged "drafter" with its path score:
- dynamic: `depth` levels, the `width` best new nodes by score expanded per level, `topk`
  children each; the tree keeps the best nodes the budget picks (TreeBudget.pick on the sorted
  scores, as for an MLX drafter's tree);
- static: every node of a level expanded, `branching[d]` children at depth d; all kept.
After verification the drafter is synced to the committed sequence at its next call (the tree's
own entries are dropped there): nothing to commit.
"""

from __future__ import annotations

from edgespec.drafters.base import request_drafter
from edgespec.tree.candidates import SourceTree
from edgespec.tree.drafting import TreePlan


class ProposedTreeDrafter:
    """The `TreeDrafter` interface (begin / grow / commit / close) over a tree-drafting drafter."""

    def __init__(self, drafter):
        if not drafter.caps.trees:
            raise ValueError(f"drafter {drafter.name!r} does not draft trees of its own")
        self.drafter = request_drafter(drafter)  # a state of its own for this request
        self.name = drafter.name

    def bind_verifier_cache(self, cache) -> None:
        """The verifier cache of this request, for a drafter that reads it."""
        if self.drafter.caps.reads_verifier:
            self.drafter.bind_verifier_cache(cache)

    def begin(self, prompt: list[int]) -> None:
        self.drafter.begin(list(prompt))

    def grow(self, seq: list[int], tree: SourceTree, plan: TreePlan, pick_budget=None) -> int:
        """Add the drafter's tree below the root of `tree` (x0 = seq[-1]); returns drafter calls."""
        self.drafter.sync(list(seq))
        if plan.shape == "static":
            dt = self.drafter.draft_tree(len(plan.branching), None, plan.branching)
        else:
            dt = self.drafter.draft_tree(plan.depth, plan.width, plan.topk, pick_budget)
        node_of = [0] * len(dt)
        for i in range(len(dt)):
            p = dt.parents[i]
            node_of[i] = tree.child(0 if p < 0 else node_of[p], dt.tokens[i], "drafter", dt.scores[i])
        return dt.levels

    def commit(self, path: list[int], tree: SourceTree) -> None:
        pass  # the next grow syncs the drafter to the committed sequence

    def close(self) -> None:
        self.drafter.close()
