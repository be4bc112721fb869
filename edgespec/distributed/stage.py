"""One rank's part of a forward call, the same code on every rank.

A call is described by a command (built on rank 0, mirrored by the followers):

    {"op": "fwd", "cache": id | None, "input": "ids" | "hidden", "layers": [i, ...] | None,
     "out": "raw" | "logits" | "last" | "both" | "project", "mask": "causal" | None | "array",
     "shape": [B, T], "dtype": hidden dtype, "ops": [cache operations to apply first]}

with the token ids / hidden states / mask / positions as arrays. Outputs exist on rank 0
only: "raw" the hidden states after the layers, "logits" the head's output ("last": of the
last position only), "both"
(logits, final-norm hidden), "project" the output projection of given normed states.

Pipeline: the hidden states walk rank 0 -> the ranks owning the listed layers, in
order -> rank 0 (send/recv); rank 0 applies the head. Tensor: every rank runs every
listed layer on its heads / MLP columns, partial outputs summed by all_sum inside the
wrapped o_proj / down_proj; embedding and head are split by vocabulary rows.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from edgespec.caches.kv import cache_arrays
from edgespec.distributed.shard import COL_SPLIT, Plan


class AllSum(nn.Module):
    """A row-split projection whose partial output is summed over the group (tensor parallel)."""

    def __init__(self, inner: nn.Module, group):
        super().__init__()
        self.inner = inner
        self._group = group

    def __call__(self, x):
        return mx.distributed.all_sum(self.inner(x), group=self._group)


def wrap_all_sum(model: nn.Module, group) -> None:
    """Wrap every o_proj / down_proj of the (already loaded) tensor shard in AllSum."""
    for _, module in list(model.named_modules()):
        for name, child in list(module.children().items()):
            if name in COL_SPLIT and isinstance(child, nn.Module):
                setattr(module, name, AllSum(child, group))


def final_norm(model):
    """The final norm module (the contract's head = project(norm(h)))."""
    # model.norm may be the norm *class* (models.base); the instance lives on the body
    for owner in (getattr(model, "model", None), model):
        norm = getattr(owner, "norm", None) if owner is not None else None
        if isinstance(norm, nn.Module):
            return norm
    raise TypeError(f"{type(model).__name__} exposes no final norm (model.model.norm / model.norm)")


def dtype_name(dtype) -> str:
    return str(dtype).removeprefix("mlx.core.")


class Stage:
    """This rank's model shard and the compute of one command."""

    def __init__(self, model, plan: Plan, group):
        self.model, self.plan, self.group = model, plan, group
        self.rank, self.size = plan.rank, plan.size
        if plan.mode == "tensor":
            wrap_all_sum(model, group)

    # ---- pipeline -------------------------------------------------------------------
    def route(self, layers: list[int]) -> list[int]:
        """Ranks the hidden states visit, in order: rank 0 alone when it owns every listed
        layer, else every rank in ring order and back to rank 0. The ring backend only sends between
        neighbours (r -> r+1, last -> 0), so a rank without listed layers relays."""
        owners = [next(r for r in range(self.size) if self.plan.owns(i, r)) for i in layers]
        if owners != sorted(owners):
            raise ValueError(f"layer ids must be increasing (got {layers})")
        last = max(owners, default=0)
        return list(range(self.size)) if last else [0]

    def run(self, cmd: dict, arrays: dict, caches):
        layers = list(range(self.plan.num_layers)) if cmd["layers"] is None else cmd["layers"]
        mask = cmd["mask"] if cmd["mask"] != "array" else arrays["mask"]
        positions = arrays.get("positions")
        if self.plan.mode == "pipeline":
            return self._pipeline(cmd, arrays, layers, mask, positions, caches)
        return self._tensor(cmd, arrays, layers, mask, positions, caches)

    def _pipeline(self, cmd, arrays, layers, mask, positions, caches):
        B, T = cmd["shape"]
        E = self.model.args.hidden_size
        dtype = getattr(mx, cmd["dtype"])
        g = self.group
        route = self.route(layers)
        h = None
        if self.rank == 0:
            if cmd["out"] == "project":
                return self.model.project(arrays["hidden"])
            h = self.model.embed(arrays["ids"]) if cmd["input"] == "ids" else arrays["hidden"]
        if self.rank not in route:
            return None
        at = route.index(self.rank)
        if at > 0:
            h = mx.distributed.recv((B, T, E), dtype, route[at - 1], group=g)
        for i in layers:
            if self.plan.owns(i):
                h = self.model.layers[i](h, mask, caches[i] if caches is not None else None, positions)
        if len(route) > 1:
            if at + 1 < len(route):
                mx.eval(mx.distributed.send(h.astype(dtype), route[at + 1], group=g))
            elif self.rank != 0:
                mx.eval(mx.distributed.send(h.astype(dtype), 0, group=g))
            if self.rank != 0:
                # keep this rank's cache writes evaluated (they are not part of the send's graph
                # when the hidden states do not depend on them)
                if caches is not None:
                    mx.eval(cache_arrays(caches))
                return None
            h = mx.distributed.recv((B, T, E), dtype, route[-1], group=g)
        return self._finish(cmd, h)

    def _finish(self, cmd, h):
        out = cmd["out"]
        if out == "raw":
            return h
        if out == "logits":
            return self.model.head(h)
        if out == "last":
            return self.model.head(h[:, -1:])
        hn = final_norm(self.model)(h)
        return self.model.project(hn), hn

    # ---- tensor ---------------------------------------------------------------------
    def _tensor(self, cmd, arrays, layers, mask, positions, caches):
        g = self.group
        plan = self.plan
        if cmd["out"] == "project":
            return self._gather_logits(self.model.project(self._hidden(cmd, arrays, "hidden")), cmd)
        if cmd["input"] == "ids":
            ids = self._ids(cmd, arrays)
            local = ids - plan.rank * plan.vocab_per_rank
            inside = (local >= 0) & (local < plan.vocab_per_rank)
            e = self.model.embed(mx.where(inside, local, 0)) * inside[..., None].astype(mx.float32)
            h = mx.distributed.all_sum(e.astype(getattr(mx, cmd["dtype"])), group=g)
        else:
            h = self._hidden(cmd, arrays, "hidden")
        for i in layers:
            h = self.model.layers[i](h, mask, caches[i] if caches is not None else None, positions)
        if cmd["out"] == "raw":
            if self.rank != 0:
                mx.eval(h)
            return h if self.rank == 0 else None
        hn = final_norm(self.model)(h)
        logits = self._gather_logits(self.model.project(hn[:, -1:] if cmd["out"] == "last" else hn), cmd)
        if cmd["out"] == "both":
            return (logits, hn) if self.rank == 0 else None
        return logits

    def _ids(self, cmd, arrays):
        return arrays["ids"]

    def _hidden(self, cmd, arrays, name):
        return arrays[name]

    def _gather_logits(self, part: mx.array, cmd):
        """Vocabulary slices (B, T, V/N) of every rank -> the full logits (B, T, V) on rank 0."""
        B, T, Vr = part.shape
        full = mx.distributed.all_gather(part, group=self.group)  # (N*B, T, Vr), rank-major
        if self.rank != 0:
            mx.eval(full)
            return None
        full = full.reshape(self.size, B, T, Vr).transpose(1, 2, 0, 3).reshape(B, T, self.size * Vr)
        return full[..., : self.plan.vocab_size]
