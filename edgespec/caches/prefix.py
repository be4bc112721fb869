"""Prefix reuse: the verifier's caches of earlier prompts and replies, kept for later requests.

A chat app resends its whole conversation every turn and an agent resends the same long
system prompt every request; prefilling all of it again each time makes the first token
wait on the conversation's length. The engine keeps the verifier's per-layer cache state
of what it has seen in a token trie of fixed-size blocks (a radix tree whose edges are
`block` tokens): a new request restores the longest cached prefix of its prompt into its
fresh caches and prefills only the rest.

What a node stores per layer is whatever that layer's cache exports (the state protocol of
edgespec.caches.kv): for attention ("positions" layers) the keys and values of the block's
positions; for recurrent or convolution layers ("state") the state after the block, where
one was taken (edgespec.generate.prefill pauses at the last block boundary for such
models). A prefix is restored at the deepest node every layer can start from.

What is stored is exact: the prompt's positions right after its prefill, and at the end of
a request the positions of its reply that every decoding mode has committed by then (all
but the last token handed out: a mode's cache holds the verified tokens in order up to
there, whatever drafts it rejected; tests/test_prefix_cache.py checks this for every mode
against a fresh prefill).

Bounded by bytes (`max_bytes`; 0 turns reuse off), least recently used leaves evicted first
(a node is used whenever a request walks through it, so a parent is never older than its
children), pinned nodes (a loaded prompt cache or session) never evicted. Thread-safe: the
trie changes under one lock; arrays are immutable once stored.

About 520 lines: the trie, its byte bound and eviction, and a request's use of it (`Reuse`,
which the drafter's store subclasses) share the lock and the block layout.
"""

from __future__ import annotations

import itertools
import numbers
import threading
from dataclasses import dataclass

import mlx.core as mx
from mlx.utils import tree_flatten

from edgespec.caches.kv import kv_bytes
from edgespec.host_memory import total_memory as _total_memory

BLOCK = 32  # tokens per trie edge
# The default bound: this many full contexts of the verifier's KV cache, at most CAP and
# at most MEMORY_SHARE of what the memory budget leaves for caches. Enough to keep a few
# long conversations or system prompts; a 135M model's server no longer grows by gigabytes
# (the memory share alone let it reach 4.3 GB on a 24 GB machine: docs/prefix_cache.md).
DEFAULT_CONTEXTS = 2
DEFAULT_CAP = 1 << 30
MEMORY_SHARE = 0.2
MEMORY = "memory"  # prompt_cache_bytes="memory": the share of memory alone (the bound before #43)


def check_limit(value) -> None:
    """A prompt_cache_bytes setting, checked before the model loads: None (the default),
    "memory", or whole bytes >= 0 and no more than this machine's memory."""
    if value is None or value == MEMORY:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise ValueError(f"prompt_cache_bytes must be a whole number of bytes >= 0 (0 turns prefix reuse off) "
                         f"or {MEMORY!r}, got {value!r}")
    total = _total_memory()
    if total is not None and value > total:
        raise ValueError(f"prompt_cache_bytes {value} is more than this machine's memory ({total >> 20} MiB); "
                         "give a size it can hold, e.g. 512M")


def default_limit(engine, memory_share: float) -> int:
    """The default bound in bytes: DEFAULT_CONTEXTS full contexts of the verifier's KV cache
    (at the engine's KV precision), capped by DEFAULT_CAP and `memory_share` (MEMORY_SHARE of
    the memory left for caches)."""
    args = engine.model.args
    per_context = kv_bytes(args, engine.context_length, _itemsize(engine))
    if engine.kv_bits is not None:  # bits per value plus a float scale and bias per group
        per_context = per_context * (engine.kv_bits + 64 / engine.kv_group_size) // (8 * _itemsize(engine))
    return int(max(min(DEFAULT_CONTEXTS * per_context, DEFAULT_CAP, memory_share), 0))


def _itemsize(engine) -> int:
    for _, p in tree_flatten(engine.model.parameters()):
        if mx.issubdtype(p.dtype, mx.floating):
            return p.dtype.size
    return 4


class _Node:
    __slots__ = ("key", "parent", "children", "parts", "nbytes", "used", "pinned")

    def __init__(self, key: tuple[int, ...], parent: _Node | None):
        self.key, self.parent = key, parent
        self.children: dict[tuple[int, ...], _Node] = {}
        self.parts: list | None = None  # per layer: what its cache exported for this block, or None
        self.nbytes = 0
        self.used = 0
        self.pinned = False


@dataclass
class PrefixStats:
    blocks: int
    bytes: int
    max_bytes: int
    lookups: int
    hits: int
    reused_tokens: int
    evicted_blocks: int

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def _nbytes(parts) -> int:
    return sum(a.nbytes for p in parts if p is not None for a in p)


def layer_kinds(caches) -> list[str] | None:
    """Each layer's span kind, or None when some cache does not implement the state protocol."""
    kinds = []
    for c in caches:
        kind = c.span_kind
        if kind not in ("positions", "state"):
            return None
        form = c.span_form  # what else the exported arrays depend on (kv_quant)
        kinds.append(f"{kind}:{form}" if form else kind)
    return kinds


def _positions(kind: str) -> bool:
    return kind.split(":")[0] == "positions"


class PrefixCache:
    """A trie of cached blocks. `joins`: another PrefixCache whose byte bound, lock, clock and
    eviction this one shares (the drafter's store joins the verifier's: one bound, one least
    recently used order over both, see `_evict`); its `block` is taken from it."""

    def __init__(self, max_bytes: int = 0, block: int = BLOCK, joins: PrefixCache | None = None):
        if joins is not None:
            self._group = joins._group
            self._lock, self._clock, self.block = joins._lock, joins._clock, joins.block
        else:
            if max_bytes < 0:
                raise ValueError(f"prompt cache bytes must be >= 0, got {max_bytes}")
            if block < 1:
                raise ValueError(f"block must be >= 1 token, got {block}")
            self._group: list[PrefixCache] = [self]
            self._max = int(max_bytes)
            self.block = int(block)
            self._lock = threading.Lock()
            self._clock = itertools.count(1)
        self._root = _Node((), None)
        self._kinds: list[str] | None = None  # the layer layout every stored node follows
        self.bytes = 0
        self.blocks = 0
        self.lookups = self.hits = self.reused_tokens = self.evicted_blocks = 0
        if joins is not None:
            with self._lock:
                self._group.append(self)

    @property
    def max_bytes(self) -> int:
        """The bound on the bytes of every store of the group together."""
        return self._group[0]._max

    @max_bytes.setter
    def max_bytes(self, value: int) -> None:
        self._group[0]._max = int(value)

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    @property
    def group_bytes(self) -> int:
        """Bytes held by this store and the stores joined with it (what the bound applies to)."""
        return sum(s.bytes for s in self._group)

    def leave(self) -> None:
        """Take this store out of its group (a drafter replaced: its blocks go with it)."""
        with self._lock:
            if self._group[0] is not self and self in self._group:
                self._group.remove(self)

    # ------------------------------------------------------------------ reading
    def _walk(self, tokens: list[int], limit: int) -> list[_Node]:
        """The stored nodes along `tokens`' full blocks, up to `limit` positions (lock held)."""
        path, node, B = [], self._root, self.block
        for s in range(0, limit - B + 1, B):
            node = node.children.get(tuple(tokens[s : s + B]))
            if node is None or node.parts is None:
                break
            path.append(node)
        return path

    def _usable(self, path: list[_Node], kinds: list[str]) -> int:
        """How many nodes of `path` a fresh set of caches can be restored to: every
        positions layer needs every block's span, every state layer the last node's state."""
        depth = 0
        for d, node in enumerate(path, 1):
            if any(p is None for p, k in zip(node.parts, kinds, strict=True) if _positions(k)):
                break
            if all(p is not None for p, k in zip(node.parts, kinds, strict=True) if not _positions(k)):
                depth = d
        return depth

    def match(self, tokens: list[int], caches=None) -> int:
        """Positions of `tokens` a request could restore now (at most len(tokens) - 1: the
        last prompt token is always run, for its logits)."""
        kinds = layer_kinds(caches) if caches is not None else self._kinds
        if not self.enabled or kinds is None or kinds != self._kinds:
            return 0
        with self._lock:
            return self._usable(self._walk(tokens, len(tokens) - 1), kinds) * self.block

    def restore(self, tokens: list[int], caches) -> int:
        """Fill empty `caches` with the longest cached prefix of `tokens` (at most
        len(tokens) - 1 positions); returns the positions restored."""
        kinds = layer_kinds(caches)
        if not self.enabled or kinds is None or any(c.offset for c in caches):
            return 0
        with self._lock:
            self.lookups += 1
            if kinds != self._kinds:
                return 0
            path = self._walk(tokens, len(tokens) - 1)
            path = path[: self._usable(path, kinds)]
            if not path:
                return 0
            now = next(self._clock)
            for node in path:
                node.used = now
            self.hits += 1
            self.reused_tokens += len(path) * self.block
            layers = [[n.parts[i] for n in path] for i in range(len(kinds))]
        for cache, kind, parts in zip(caches, kinds, layers, strict=True):
            if _positions(kind):
                # runs of spans of one form joined (a quantized cache exports two forms)
                runs: list[list] = []
                for p in parts:
                    if runs and len(runs[-1][0]) == len(p):
                        runs[-1].append(p)
                    else:
                        runs.append([p])
                for run in runs:
                    cache.import_span(run[0] if len(run) == 1 else tuple(
                        mx.concatenate([p[j] for p in run], axis=-2) for j in range(len(run[0]))))
            else:
                cache.import_span(parts[-1])
        return len(path) * self.block

    # ------------------------------------------------------------------ writing
    def store(self, tokens: list[int], caches, upto: int, pin: bool = False) -> int:
        """Keep the full blocks of `tokens[:upto]` whose state `caches` hold (positions
        beyond their offset are not). Returns the positions now cached along `tokens`."""
        kinds = layer_kinds(caches)
        if not self.enabled or kinds is None:
            return 0
        B = self.block
        upto = min(upto, len(tokens), min(c.offset for c in caches))
        with self._lock:
            if self._kinds is None or not self._root.children:
                self._kinds = kinds
            elif kinds != self._kinds:
                return 0  # another layout (a different model's caches): not mixed in
            node, now, s = self._root, next(self._clock), 0
            new: list[_Node] = []
            while s + B <= upto:
                key = tuple(tokens[s : s + B])
                child = node.children.get(key)
                if child is None:
                    child = node.children[key] = _Node(key, node)
                    self.blocks += 1
                if child.parts is None or (not all(map(_positions, kinds)) and s + B == upto
                                           and any(p is None for p in child.parts)):
                    new.append(child)
                child.used = now
                child.pinned = child.pinned or pin
                node, s = child, s + B
        # Exported outside the lock (copies out of the caches' buffers); attached under it.
        exports = []
        for child in new:
            end = _depth(child) * B
            parts = [c.export_span(end - B, end) for c in caches]
            exports.append((child, parts))
        with self._lock:
            broken = False
            for child, parts in exports:
                if not _attached(child, self._root):
                    continue  # evicted meanwhile
                if broken or any(p is None for p, k in zip(parts, kinds, strict=True) if _positions(k)):
                    # a block some layer cannot give (a quantized cache's full-precision split
                    # inside it): it and the blocks after it could never be restored
                    broken = True
                    if child.parts is None:
                        gone = [child, *_below(child)]
                        self.bytes -= sum(g.nbytes for g in gone)
                        self.blocks -= len(gone)
                        del child.parent.children[child.key]
                    continue
                if child.parts is not None:
                    parts = [p if p is not None else q for p, q in zip(parts, child.parts, strict=True)]
                    self.bytes -= child.nbytes
                child.parts, child.nbytes = parts, _nbytes(parts)
                self.bytes += child.nbytes
            self._prune_empty()
            self._evict()
            return len(self._walk(tokens, upto)) * B

    def _prune_empty(self) -> None:
        """Drop nodes that never got their parts (a failed export) and have no children (lock held)."""
        stack = [self._root]
        while stack:
            n = stack.pop()
            for k, c in list(n.children.items()):
                if c.parts is None and not c.children:
                    del n.children[k]
                    self.blocks -= 1
                else:
                    stack.append(c)

    def shrink_to(self, nbytes: int) -> None:
        """Evict (least recently used first, over the whole group) until at most `nbytes` are
        held in all: running requests come first (the batch calls this before admitting one)."""
        with self._lock:
            self._evict(max(nbytes, 0))

    def _evict(self, bound: int | None = None) -> None:
        """Least recently used unpinned leaves of every store of the group go until the
        group's bytes fit (lock held). The stores share one clock, so a verifier block and
        a drafter block of the same turn are equally old."""
        bound = self.max_bytes if bound is None else min(bound, self.max_bytes)
        total = self.group_bytes
        if total <= bound:
            return
        leaves = [(n, s) for s in self._group for n in s._nodes() if not n.children and not n.pinned]
        leaves.sort(key=lambda ns: ns[0].used)
        while total > bound and leaves:
            n, owner = leaves.pop(0)
            parent = n.parent
            del parent.children[n.key]
            owner.bytes -= n.nbytes
            total -= n.nbytes
            owner.blocks -= 1
            owner.evicted_blocks += 1
            if parent is not owner._root and not parent.children and not parent.pinned:
                # the parent became a leaf: it takes its place in the order
                i = 0
                while i < len(leaves) and leaves[i][0].used <= parent.used:
                    i += 1
                leaves.insert(i, (parent, owner))

    def _nodes(self):
        stack = list(self._root.children.values())
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    def clear(self, keep_pinned: bool = False) -> None:
        """Forget what is cached (`keep_pinned`: all but the loaded prompt caches and their
        paths), in this store and the stores joined with it."""
        with self._lock:
            for s in self._group:
                s._clear(keep_pinned)

    def _clear(self, keep_pinned: bool) -> None:
        """(lock held)"""
        if not keep_pinned:
            self._root = _Node((), None)
            self.bytes = self.blocks = 0
            self._kinds = None
            return
        stack = [self._root]
        while stack:
            n = stack.pop()
            for k, c in list(n.children.items()):
                if c.pinned:
                    stack.append(c)
                else:
                    gone = [c, *_below(c)]
                    self.bytes -= sum(g.nbytes for g in gone)
                    self.blocks -= len(gone)
                    del n.children[k]

    def unpin(self) -> None:
        with self._lock:
            for n in self._nodes():
                n.pinned = False
            self._evict()

    def stats(self) -> PrefixStats:
        with self._lock:
            return PrefixStats(self.blocks, self.bytes, self.max_bytes, self.lookups, self.hits,
                               self.reused_tokens, self.evicted_blocks)

    def lru_order(self) -> list[tuple[int, ...]]:
        """Leaves' first tokens in eviction order (for tests and /health)."""
        with self._lock:
            leaves = [n for n in self._nodes() if not n.children and not n.pinned]
            return [n.key for n in sorted(leaves, key=lambda n: n.used)]

    # ------------------------------------------------------------------ persistence
    def export_prefix(self, tokens: list[int]) -> tuple[int, list[list]]:
        """(positions, per node per layer parts) of the cached path along `tokens` (all of
        it, up to len(tokens)); what edgespec.caches.sessions writes to disk."""
        with self._lock:
            path = self._walk(tokens, len(tokens))
            kinds = self._kinds or []
            path = path[: self._usable(path, kinds)] if kinds else []
            return len(path) * self.block, [list(n.parts) for n in path], list(kinds)

    def import_prefix(self, tokens: list[int], nodes: list[list], kinds: list[str], pin: bool = False) -> int:
        """Put a saved path back (edgespec.caches.sessions); returns the positions now cached."""
        B = self.block
        if len(nodes) * B > len(tokens):
            raise ValueError(f"{len(nodes)} blocks of {B} need {len(nodes) * B} tokens, got {len(tokens)}")
        with self._lock:
            if self._kinds is None or not self._root.children:
                self._kinds = list(kinds)
            elif list(kinds) != self._kinds:
                raise ValueError("the saved cache's layer layout is not this model's")
            node, now = self._root, next(self._clock)
            for i, parts in enumerate(nodes):
                key = tuple(tokens[i * B : (i + 1) * B])
                child = node.children.get(key)
                if child is None:
                    child = node.children[key] = _Node(key, node)
                    self.blocks += 1
                if child.parts is None:
                    child.parts, child.nbytes = list(parts), _nbytes(parts)
                    self.bytes += child.nbytes
                child.used, child.pinned = now, child.pinned or pin
                node = child
            self._evict()
            return len(self._walk(tokens, len(tokens))) * B


def _below(node: _Node) -> list[_Node]:
    out, stack = [], list(node.children.values())
    while stack:
        n = stack.pop()
        out.append(n)
        stack.extend(n.children.values())
    return out


def _depth(node: _Node) -> int:
    d = 0
    while node.parent is not None:
        d, node = d + 1, node.parent
    return d


def _attached(node: _Node, root: _Node) -> bool:
    while node.parent is not None:
        if node.parent.children.get(node.key) is not node:
            return False
        node = node.parent
    return node is root


class Reuse:
    """One request's use of a prefix store: restore at its prefill, store its prompt after
    it, and at its end the reply positions its mode has committed. The verifier's
    (edgespec.generate.prefill) is this class; the drafter's (edgespec.drafters.base.
    DrafterReuse) is a subclass that reads its drafter's caches and fed tokens."""

    stats_field = "cached_tokens"  # the GenerationStats field the restored count goes to

    def __init__(self, store: PrefixCache, stats=None):
        self.store, self.stats = store, stats
        self.caches = None
        self.restored = 0

    def restore(self, tokens: list[int], caches) -> int:
        self.caches = caches
        self.restored = self.store.restore(tokens, caches)
        if self.stats is not None:
            setattr(self.stats, self.stats_field, self.restored)
        return self.restored

    def needs_boundary(self, caches=None) -> bool:
        """Whether prefill must pause at the last block boundary (state layers only export there)."""
        kinds = layer_kinds(self.caches if caches is None else caches)
        return kinds is not None and not all(map(_positions, kinds))

    def pause(self, restorable: int, done: int, end: int, caches=None) -> int | None:
        """Where a prefill that has `done` positions restored and runs to `end` pauses to store
        its prompt, so that state layers export at the last block boundary a later identical
        prompt can restore (`restorable`: the positions such a restore may cover); None
        when no pause is needed."""
        if not self.needs_boundary(caches):
            return None
        at = restorable // self.store.block * self.store.block
        return at if done < at < end else None

    def store_prompt(self, tokens: list[int], upto: int) -> None:
        if self.caches is not None:
            self.store.store(tokens, self.caches, upto)

    def commit(self, tokens: list[int]) -> None:
        """At the request's end: `tokens` = prompt + the reply handed out. All but the last
        are in the mode's cache in order (see the module docstring)."""
        if self.caches is not None and len(tokens) > 1:
            self.store.store(tokens, self.caches, len(tokens) - 1)
        self.caches = None
