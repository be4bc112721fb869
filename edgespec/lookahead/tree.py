"""The token tree one lookahead step feeds to the verifier.

Node 0 is the last committed token x0 (not yet in the KV cache). Below it:
- the verification branch: pooled candidates merged into a trie (shared
  prefixes are fed once);
- the lookahead branch: a window of W columns x (N-1) levels. Level 0 is a
  guessed continuation chain x0 -> (0,0) -> (0,1) -> ... ; the node at level j,
  column i hangs below (j-1, i). So node (j, i) sees x0, (0,0..i), (1..j, i):
  a causal context at consecutive positions p+1 .. p+1+i+j, the paper's
  lookahead mask written as a tree.
Every node is a point-mass guess whose context is its root path, so any root
path may be accepted (verification walks the whole tree, window included).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StepTree:
    tokens: list[int]
    parents: list[int]
    children: list[dict[int, int]] = field(default_factory=list)  # node -> {token: first child}
    window: list[list[int]] = field(default_factory=list)  # [level][column] -> node index

    @classmethod
    def rooted(cls, x0: int) -> StepTree:
        return cls([x0], [-1], [{}])

    def is_chain(self) -> bool:
        """Every node the child of the one before it (no branches, no window)."""
        return all(p == i - 1 for i, p in enumerate(self.parents))

    def add_node(self, token: int, parent: int) -> int:
        self.tokens.append(token)
        self.parents.append(parent)
        self.children.append({})
        node = len(self.tokens) - 1
        self.children[parent].setdefault(token, node)
        return node

    def add_path(self, path: list[int]) -> None:
        """Insert a candidate continuation of x0, sharing existing trie prefixes.

        Call before `add_window`, so candidates never merge into window nodes.
        """
        if self.window:
            raise RuntimeError("add candidate paths before the lookahead window")
        node = 0
        for tok in path:
            nxt = self.children[node].get(tok)
            node = nxt if nxt is not None else self.add_node(tok, node)

    def add_window(self, levels: list[list[int]]) -> None:
        """levels: (N-1) lists of W guessed tokens (level 0 first)."""
        self.window = []
        for j, row in enumerate(levels):
            nodes = []
            for i, tok in enumerate(row):
                parent = (0 if i == 0 else nodes[i - 1]) if j == 0 else self.window[j - 1][i]
                nodes.append(self.add_node(tok, parent))
            self.window.append(nodes)

    def path_to(self, node: int) -> list[int]:
        """Nodes from depth 1 down to `node` (empty for the root)."""
        out = []
        while node > 0:
            out.append(node)
            node = self.parents[node]
        return out[::-1]

    def __len__(self) -> int:
        return len(self.tokens)
