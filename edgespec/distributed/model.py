"""The sharded verifier as rank 0 sees it (the model contract), and the followers' loop.

Rank 0 drives. Every forward call on ShardedModel sends its inputs (and the cache
operations made since the last call) to the followers, which run the same call on their
shard (edgespec.distributed.stage); the modes and the engine use it like any model.

KV caches: `make_cache()` returns one MirroredCache per layer. Each records the
operations a mode makes on it (trim, keep after a tree step, offset set by commit_kv);
they ride along with the next forward command, so every rank's caches stay identical
in length and content for the layers it holds. A cache set that rank 0 drops is freed on
the followers too.

Each call is evaluated before it returns: two calls whose sends and receives were still
pending could run in another order than the followers run them. One lock serialises
callers (a drafter thread using the verifier's own layers).
"""

from __future__ import annotations

import itertools
import threading
import weakref

import mlx.core as mx

from edgespec.batch.forward import _GatherCache
from edgespec.caches.kv import LayerCache
from edgespec.distributed.comm import DistributedError, Group
from edgespec.distributed.stage import Stage, dtype_name


class MirroredCache(LayerCache):
    """One layer's cache on rank 0: local KV (if this rank computes the layer) + op log."""

    forwards_ops = True  # commit_kv uses keep() (forwarded) instead of writing keys directly

    def __init__(self, owner: ShardedModel, cid: int, layer: int, kv, local: bool):
        self._owner, self.cid, self.layer, self._kv, self._local = owner, cid, layer, kv, local
        self._offset = 0  # layers other ranks compute: rank 0 tracks the length only

    @property
    def offset(self) -> int:
        return self._kv.offset if self._local else self._offset

    @offset.setter
    def offset(self, value: int) -> None:
        if self._local:
            self._kv.offset = value
        else:
            self._offset = value
        self._owner._record("off", self.cid, self.layer, int(value))

    def update_and_fetch(self, k, v):
        return self._kv.update_and_fetch(k, v)

    def trim(self, n: int) -> int:
        n = min(max(int(n), 0), self.offset)
        if self._local:
            self._kv.trim(n)
        else:
            self._offset -= n
        self._owner._record("trim", self.cid, self.layer, n)
        return n

    def keep(self, start: int, indices) -> None:
        indices = [int(i) for i in indices]
        if self._local:
            self._kv.keep(start, indices)
            self._kv.offset = start + len(indices)
        else:
            self._offset = start + len(indices)
        self._owner._record("keep", self.cid, self.layer, int(start), indices)

    @property
    def keys(self):
        return self._kv.keys if self._local else None

    @property
    def values(self):
        return self._kv.values if self._local else None

    @property
    def state(self):
        return self._kv.state if self._local else None

    @property
    def nbytes(self) -> int:
        return self._kv.nbytes if self._local else 0


class CacheSet(list):
    """The list make_cache() returns; dropping it frees the followers' copy."""

    def __init__(self, owner: ShardedModel, cid: int, local: list, items: list):
        super().__init__(items)
        self.cid = cid
        self.local = local
        weakref.finalize(self, owner._record, "free", cid, None)


def apply_ops(ops: list, sets: dict, stage: Stage) -> None:
    """A follower replays rank 0's cache operations, in order."""
    for op in ops:
        kind, cid = op[0], op[1]
        if kind == "free":
            sets.pop(cid, None)
            continue
        caches = sets.setdefault(cid, stage.model.make_cache())
        first, last, args = op[2], op[3], op[4:]
        for c in caches[first : last + 1]:
            if kind == "trim":
                c.trim(args[0])
            elif kind == "off":
                c.offset = args[0]
            elif kind == "keep":
                if c.keys is not None:
                    c.keep(args[0], args[1])
                c.offset = args[0] + len(args[1])


def gather_views(gather: dict, sets: dict, stage: Stage) -> list:
    """A follower's per-layer views of a batched pass over its copies of the rows' cache sets."""
    rows = [sets.setdefault(cid, stage.model.make_cache()) for cid in gather["cids"]]
    return [_GatherCache([r[i] for r in rows], gather["lengths"], gather["s_max"])
            for i in range(stage.plan.num_layers)]


class LayerProxy:
    """model.layers[i] on rank 0: layer(h, mask, cache, positions) run wherever layer i lives."""

    def __init__(self, owner: ShardedModel, index: int):
        self._owner, self.index = owner, index

    def __call__(self, h, mask, cache, positions):
        cid = cache.cid if cache is not None else None
        return self._owner._forward("hidden", h, cid, mask, positions, [self.index], "raw")


class ShardedModel:
    """The model contract over a group of ranks (rank 0's object)."""

    def __init__(self, stage: Stage, group: Group, args):
        if group.rank != 0:
            raise DistributedError("ShardedModel lives on rank 0; the other ranks run follow()")
        self.stage, self.group, self.args = stage, group, args
        self.plan = stage.plan
        self._ids = itertools.count()
        self._ops: list = []
        self._ops_lock = threading.Lock()
        self._lock = threading.RLock()
        self._dtype = dtype_name(stage.model.embed(mx.zeros((1, 1), dtype=mx.int32)).dtype)
        self.layers = [LayerProxy(self, i) for i in range(self.plan.num_layers)]
        self.calls = 0  # forward calls that involved the followers (round trips)
        self._sets = weakref.WeakValueDictionary()  # cache-set id -> CacheSet

    # ---- contract ----
    def make_cache(self) -> CacheSet:
        cid = next(self._ids)
        local = self.stage.model.make_cache()
        items = [MirroredCache(self, cid, i, local[i], self.plan.owns(i)) for i in range(self.plan.num_layers)]
        self._sets[cid] = s = CacheSet(self, cid, local, items)
        return s

    def __call__(self, inputs, cache=None, mask=None, positions=None, layer_ids=None, return_hidden=False,
                 last_only=False):
        if mask is None and inputs.shape[1] > 1:
            mask = "causal"
        if return_hidden and last_only:  # the features of every position are wanted anyway
            logits, h = self(inputs, cache, mask, positions, layer_ids, return_hidden=True)
            return logits[:, -1:], h
        out = "both" if return_hidden else ("last" if last_only else "logits")
        if cache is not None and len(cache) and hasattr(cache[0], "lengths"):
            return self._batched(inputs, cache, mask, positions, layer_ids, out)
        cid = cache[0].cid if cache is not None and len(cache) else None
        return self._forward("ids", inputs, cid, mask, positions, layer_ids, out)

    def _batched(self, inputs, views, mask, positions, layer_ids, out):
        """A batched pass (edgespec.batch): per layer, a view that writes each row's new K/V into
        that row's own cache set. The followers build the same views over their copies."""
        first = views[0]
        gather = {"cids": [c.cid for c in first.caches], "lengths": [int(t) for t in first.lengths],
                  "s_max": int(first.s_max)}
        mine = [type(v)([c._kv for c in v.caches], v.lengths, v.s_max) for v in views]
        result = self._forward("ids", inputs, None, mask, positions, layer_ids, out, gather=gather, views=mine)
        if self.plan.mode == "pipeline":  # layers other ranks computed: rank 0 tracks the lengths
            for v in views:
                for c, t in zip(v.caches, v.lengths, strict=True):
                    if not c._local:
                        c._offset += int(t)
        return result

    def embed(self, inputs):
        if self.plan.mode == "pipeline":
            return self.stage.model.embed(inputs)
        return self._forward("ids", inputs, None, None, None, [], "raw")

    def head(self, h):
        if self.plan.mode == "pipeline":
            return self.stage.model.head(h)
        return self._forward("hidden", h, None, None, None, [], "logits")

    def project(self, h):
        if self.plan.mode == "pipeline":
            return self.stage.model.project(h)
        return self._forward("hidden", h, None, None, None, [], "project")

    def parameters(self):
        """This rank's weights (the shard), for memory accounting."""
        return self.stage.model.parameters()

    def close(self) -> None:
        self.group.close()

    # ---- the call ----
    def _record(self, kind: str, cid: int, layer, *args) -> None:
        """Log one cache operation; consecutive layers with the same operation merge."""
        with self._ops_lock:
            if kind == "free":
                self._ops.append(["free", cid])
                return
            if self._ops:
                last = self._ops[-1]
                if last[0] == kind and last[1] == cid and last[3] == layer - 1 and last[4:] == list(args):
                    last[3] = layer
                    return
            self._ops.append([kind, cid, layer, layer, *args])

    def _take_ops(self) -> list:
        with self._ops_lock:
            ops, self._ops = self._ops, []
        return ops

    def _forward(self, kind, x, cid, mask, positions, layer_ids, out, gather=None, views=None):
        with self._lock:
            B, T = x.shape[0], x.shape[1]
            layers = list(range(self.plan.num_layers)) if layer_ids is None else [int(i) for i in layer_ids]
            cmd = {
                "op": "fwd", "cache": cid, "input": kind, "layers": layers, "out": out,
                "mask": mask if mask is None or isinstance(mask, str) else "array",
                "shape": [int(B), int(T)], "dtype": self._dtype if kind == "ids" else dtype_name(x.dtype),
            }
            local = {"ids" if kind == "ids" else "hidden": x}
            if cmd["mask"] == "array":
                local["mask"] = mask
            if positions is not None:
                local["positions"] = positions
            caches = self._local_caches(cid) if views is None else views
            if gather is not None:
                cmd["gather"] = gather
            remote = self.plan.mode == "tensor" or self.stage.route(layers) != [0]
            try:
                if remote:
                    cmd["ops"] = self._take_ops()
                    # pipeline followers get the hidden states over the ring, never the ids
                    send = local if self.plan.mode == "tensor" else {
                        k: v for k, v in local.items() if k in ("mask", "positions")}
                    self.group.broadcast(cmd, send)
                    self.calls += 1
                result = self.stage.run(cmd, local, caches)
                mx.eval(result)
            except RuntimeError as e:  # the ring lost a peer mid-call
                self.group.lost(-1, f"failed during a forward pass ({e})")
                raise DistributedError(f"distributed forward failed: {e}") from None
            if cid is not None and self.plan.mode == "pipeline":
                for i in layers:
                    m = self._sets[cid][i]
                    if not m._local:
                        m._offset += T
            return result

    def _local_caches(self, cid):
        return None if cid is None else self._sets[cid].local


def follow(stage: Stage, group: Group) -> None:
    """Follower ranks: mirror rank 0's calls until it says stop (or a peer is lost)."""
    sets: dict = {}
    while True:
        cmd, arrays = group.next_command()
        if cmd["op"] == "stop":
            break
        apply_ops(cmd.get("ops", []), sets, stage)
        cid = cmd["cache"]
        caches = sets.setdefault(cid, stage.model.make_cache()) if cid is not None else None
        if cmd.get("gather"):
            caches = gather_views(cmd["gather"], sets, stage)
        try:
            stage.run(cmd, arrays, caches)
        except Exception as e:  # a lost peer (RuntimeError from the ring) or a bad command
            group.lost(-1, f"failed during a forward pass ({type(e).__name__}: {e})")
            raise DistributedError(f"distributed forward failed: {e}") from None
    group.close()
