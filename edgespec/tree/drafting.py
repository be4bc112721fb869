"""Growing the drafter's branches of a candidate tree, one drafter pass per level.

`TreeDrafter` wraps an MLX-model drafter (distilled, self-speculative or a
plain MLX drafter) and keeps its own KV cache: the committed sequence, then,
during a pass, every node it has fed. A level feeds the nodes chosen for
expansion in one drafter call under a tree mask with tree positions (the
same `tree_mask` kernel the verifier uses), so siblings never see each other;
the top-k of each fed node's distribution become its children.

Two shapes (`TreePlan`):
- static: level d gives every node of the level its top `branching[d]` children;
  every drafted node is kept (a fixed tree per pass);
- dynamic (EAGLE-2 style): each level expands the `width` best new nodes by path
  score (product of the drafter's probabilities from the root), with `topk`
  children each; at the end the best `budget - 1` nodes by score form the tree.
  Where the drafter is sure, one child carries almost all the score and the
  tree runs deep and narrow; where it hesitates, siblings share the score and
  the tree widens at that point. Scores never grow along a path, so the best-n
  set is closed under ancestors (ties broken by depth).

After verification `commit(path)` moves the accepted nodes' drafter KV entries
into place with `commit_kv`, so a fully accepted branch costs no re-feed.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from edgespec.caches.kv import cache_arrays
from edgespec.drafters.base import common_prefix
from edgespec.generate import PREFILL_CHUNK
from edgespec.kernels import commit_kv, tree_mask
from edgespec.tree.candidates import SourceTree


@dataclass(frozen=True)
class TreePlan:
    shape: str = "dynamic"  # "static" | "dynamic"
    branching: tuple[int, ...] = (3, 2, 1, 1)  # static: children per node at each depth
    depth: int = 5  # dynamic: levels drafted
    width: int = 3  # dynamic: nodes expanded per level
    topk: int = 3  # dynamic: children per expanded node

    @property
    def levels(self) -> int:
        return len(self.branching) if self.shape == "static" else self.depth

    def max_nodes(self) -> int:
        """Tree tokens at most (root included)."""
        if self.shape == "static":
            n, width = 1, 1
            for b in self.branching:
                width *= b
                n += width
            return n
        return 1 + self.topk + (self.depth - 1) * self.width * self.topk


class TreeDrafter:
    def __init__(self, drafter):
        model = drafter.model if drafter.caps.mlx_model else None
        if model is None:
            raise ValueError(
                f"drafter {drafter.name!r} has no MLX model to grow a tree "
                "with; tree modes need an MLX drafter (distilled, 'self' or an MLX folder)"
            )
        if any(c.span_kind == "state" for c in model.make_cache()):
            raise ValueError(
                f"drafter {drafter.name!r} has recurrent layers: a tree drafter grows "
                "branches one level per pass, which a recurrent state cannot follow; use mode "
                "'speculative' or 'auto' (chain drafts), or tree sources=prompt_lookup+pool"
            )
        self.drafter = drafter
        self.name = drafter.name
        self.model = model
        self.layer_ids = drafter.layer_ids
        vmap = drafter.vocab_map
        # Reduced-vocabulary drafters: ids in via the map, slot 0 ("other") never proposed.
        self._to_reduced = mx.array(vmap.to_reduced) if vmap is not None else None
        self._ids = np.asarray(vmap.ids) if vmap is not None else None
        self.cache = []
        self.fed: list[int] = []  # committed tokens whose K/V are in the cache
        self._pass = None  # (prefix length, fed tree nodes in feed order)

    # ------------------------------------------------------------------ model
    def _logprobs(self, tokens: list[int], mask=None, positions=None) -> mx.array:
        """Feed tokens (appending to the cache) -> drafter log-probs (T, Vd)."""
        x = mx.array(tokens, dtype=mx.int32)[None]  # (1, T)
        if self._to_reduced is not None:
            x = self._to_reduced[x]
        logits = self.model(
            x, self.cache, mask=mask, positions=positions, layer_ids=self.layer_ids
        )[0]
        if self._to_reduced is not None:
            logits[:, 0] = -mx.inf  # "other" is not a token
        return logits - mx.logsumexp(logits, axis=-1, keepdims=True)

    def _top(self, lp: mx.array, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(rows, k) token ids (full vocabulary) and probabilities, best first."""
        k = min(k, lp.shape[-1])
        idx = mx.argpartition(-lp, k - 1, axis=-1)[:, :k]
        val = mx.take_along_axis(lp, idx, axis=-1)
        mx.eval(idx, val)
        idx, val = np.array(idx), np.exp(np.array(val, dtype=np.float64))
        order = np.argsort(-val, axis=-1, kind="stable")
        idx, val = np.take_along_axis(idx, order, -1), np.take_along_axis(val, order, -1)
        if self._ids is not None:
            idx = self._ids[idx]
        return idx, val

    def begin(self, prompt: list[int]) -> None:
        self.cache = self.model.make_cache()
        self.fed = []
        body = list(prompt[:-1])
        for s in range(0, len(body), PREFILL_CHUNK):
            piece = body[s : s + PREFILL_CHUNK]
            self._logprobs(piece)
            self.fed.extend(piece)
            mx.eval(cache_arrays(self.cache))

    # ------------------------------------------------------------------ growing
    def grow(self, seq: list[int], tree: SourceTree, plan: TreePlan, pick_budget=None) -> int:
        """Add drafter branches below the root of `tree` (x0 = seq[-1]); returns drafter passes.

        pick_budget(sorted scores) -> nodes to keep (dynamic shape); None keeps `plan`'s maximum.
        """
        keep = min(common_prefix(self.fed, seq), len(seq) - 1)
        for c in self.cache:
            c.trim(c.offset - keep)
        del self.fed[keep:]
        pending = seq[keep:]
        lp = self._logprobs(pending)[-1:]  # (1, Vd): the distribution after x0
        self.fed = list(seq)
        L = len(seq)  # x0 sits at cache slot L-1; fed node f (1-based) at slot L-1+f

        # Draft nodes: token, parent (draft id; 0 = root), score, feed index (0 = not fed).
        tok, par, score, feed = [seq[-1]], [-1], [1.0], [0]
        fed_par = [-1]  # parents in feed order (index 0 = root)
        frontier, passes = [0], 1
        for level in range(plan.levels):
            k = plan.branching[level] if plan.shape == "static" else plan.topk
            ids, probs = self._top(lp, k)
            new = []
            for row, d in enumerate(frontier):
                for t, q in zip(ids[row].tolist(), probs[row].tolist(), strict=True):
                    if q <= 0.0:
                        continue
                    tok.append(int(t))
                    par.append(d)
                    score.append(score[d] * q)
                    feed.append(0)
                    new.append(len(tok) - 1)
            if level + 1 == plan.levels or not new:
                break
            if plan.shape == "dynamic":
                new = sorted(new, key=lambda d: -score[d])[: plan.width]
            # Feed the nodes to expand: one pass, tree mask over cache + fed nodes.
            for d in new:
                fed_par.append(feed[par[d]])
                feed[d] = len(fed_par) - 1
            mask, pos = tree_mask(mx.array(fed_par, dtype=mx.int32), L - 1)
            n = len(new)
            lp = self._logprobs([tok[d] for d in new], mask[-n:], pos[-n:])
            passes += 1
            frontier = new

        chosen = list(range(1, len(tok)))
        if plan.shape == "dynamic":
            depth = [0] * len(tok)
            for d in chosen:
                depth[d] = depth[par[d]] + 1
            chosen.sort(key=lambda d: (-score[d], depth[d]))
            n = pick_budget([score[d] for d in chosen]) if pick_budget else len(chosen)
            chosen = sorted(chosen[:n])  # draft order: parents first
        node_of = {0: 0}
        fed_nodes = [None] * len(fed_par)  # feed index -> tree node
        for d in chosen:
            if par[d] not in node_of:
                continue  # parent pruned (a tie broken the other way): drop the subtree
            node_of[d] = tree.child(node_of[par[d]], tok[d], "drafter", score[d])
            if feed[d]:
                fed_nodes[feed[d]] = node_of[d]
        self._pass = (L, {n: f for f, n in enumerate(fed_nodes) if n is not None})
        return passes

    def commit(self, path: list[int], tree: SourceTree) -> None:
        """Keep the drafter KV of the accepted path's fed prefix; drop the rest of the pass."""
        if self._pass is None:
            return
        L, feed_of = self._pass
        self._pass = None
        keep = []
        for node in path:
            f = feed_of.get(node)
            if f is None:
                break
            keep.append(f - 1)  # slot L-1+f = L + (f-1)
        commit_kv(self.cache, L, keep)
        self.fed.extend(tree.tokens[n] for n in path[: len(keep)])

    def close(self) -> None:
        self.cache, self.fed, self._pass = [], [], None
