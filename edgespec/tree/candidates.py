"""The candidate tree of one tree-speculation pass, with where each node came from.

A `SourceTree` is the lookahead `StepTree` (node 0 = the last committed token
x0, parents in topological order, a trie: one node per distinct root path)
plus, per node, the source that first proposed it ("drafter", "prompt_lookup",
"pool", "window") and the drafter's path score (product of its probabilities
along the root path; 0 for nodes no drafter scored). Sources merge into one
trie, so a continuation proposed twice is fed to the verifier once and is
attributed to the source that inserted it first.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from edgespec.lookahead.tree import StepTree


@dataclass
class SourceTree(StepTree):
    sources: list[str] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)

    @classmethod
    def rooted(cls, x0: int) -> SourceTree:
        return cls([x0], [-1], [{}], sources=["verifier"], scores=[1.0])

    def add_node(self, token: int, parent: int, source: str = "window", score: float = 0.0) -> int:
        node = super().add_node(token, parent)
        self.sources.append(source)
        self.scores.append(score)
        return node

    def child(self, parent: int, token: int, source: str, score: float = 0.0) -> int:
        """The child of `parent` with `token`, created (tagged `source`) if missing."""
        if self.window:
            raise RuntimeError("add candidates before the lookahead window")
        node = self.children[parent].get(token)
        if node is None:
            return self.add_node(token, parent, source, score)
        self.scores[node] = max(self.scores[node], score)
        return node

    def add_path(self, path: list[int], source: str = "pool", parent: int = 0) -> None:
        node = parent
        for tok in path:
            node = self.child(node, tok, source)

    def depth(self) -> int:
        d = [0] * len(self.tokens)
        for t in range(1, len(self.tokens)):
            d[t] = d[self.parents[t]] + 1
        return max(d)
