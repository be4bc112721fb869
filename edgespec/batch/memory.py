"""KV memory per sequence, accounted against the memory budget (--memory-budget).

A sequence's caches grow in steps of KVCache.step positions up to its prompt plus
max_tokens (plus room for one verified tree), never past the context window:

    reserve(P, max_tokens) = kv_per_token * roundup(min(P + max_tokens + TREE, context), step)

The budget for caches is --memory-budget minus the weights already loaded (the
verifier's and a drafter's); without a budget, a share of the memory free when the
batcher started. A request waits while the running ones hold too much, and is
refused at once when even an empty engine could not hold it.
"""

from __future__ import annotations

from edgespec.cache import KVCache
from edgespec.errors import EdgespecError
from edgespec.lookahead.memory import available_memory, drafter_bytes, kv_bytes, tree_bytes

TREE = 64  # a verified tree's tokens sit in the cache until the round commits
FREE_SHARE = 0.75  # without --memory-budget: this share of the free memory goes to caches
TYPICAL_TOKENS = 2048  # the request size the default --max-batch is sized for
MAX_BATCH_CAP = 8  # the default never goes past this (a CPU pass of 8 rows already costs ~1.4x one)


class MemoryBudgetError(EdgespecError):
    """A request whose KV cache can never fit the memory budget."""


def _itemsize(model) -> int:
    """Bytes per K/V element: the dtype activations run in (the first floating weight's).
    Called for every request: walks the parameter tree only up to that first weight."""

    def arrays(tree):
        if isinstance(tree, dict):
            for v in tree.values():
                yield from arrays(v)
        elif isinstance(tree, (list, tuple)):
            for v in tree:
                yield from arrays(v)
        else:
            yield tree

    for v in arrays(model.parameters()):
        if "float" in str(getattr(v, "dtype", "")):
            return v.dtype.size
    return 2


def kv_per_token(engine) -> int:
    """Bytes one more position costs a sequence: the verifier's K/V of every layer, plus a
    drafter's own cache when one runs."""
    model = engine.model
    per = kv_bytes(model.args, 1, _itemsize(model))
    if engine.drafter is not None:
        per += drafter_bytes(engine.drafter, model, 1)[1]
    return per


def reserve_bytes(engine, prompt_tokens: int, max_tokens: int) -> int:
    n = min(prompt_tokens + max_tokens + TREE, engine.context_length + TREE)
    n = -(-n // KVCache.step) * KVCache.step
    return kv_per_token(engine) * n


def cache_budget(engine, free_at_start: int | None) -> float:
    """Bytes the sequences' caches may hold together (inf when nothing is known)."""
    if engine.memory_budget is not None:
        weights = tree_bytes(engine.model)
        if engine.drafter is not None:
            weights += drafter_bytes(engine.drafter, engine.model, 0)[0]
        return float(engine.memory_budget - weights)
    if free_at_start is None:
        return float("inf")
    return free_at_start * FREE_SHARE


def default_max_batch(engine, budget: float) -> int:
    """How many typical requests the budget holds at once, 1..MAX_BATCH_CAP."""
    typical = reserve_bytes(engine, min(TYPICAL_TOKENS, engine.context_length) // 2,
                            min(TYPICAL_TOKENS, engine.context_length) // 2)
    if budget == float("inf"):
        return MAX_BATCH_CAP
    return int(max(1, min(MAX_BATCH_CAP, budget // max(typical, 1))))


def check_fits(need: int, budget: float) -> None:
    if need > budget:
        mib = 2**20
        have = f"{budget / mib:.0f} MiB" if budget > 0 else "nothing (the weights alone exceed it)"
        raise MemoryBudgetError(
            f"this request needs {need / mib:.0f} MiB of KV cache (prompt + max_tokens) and the memory budget "
            f"leaves {have} for caches: lower max_tokens, shorten the prompt or raise --memory-budget"
        )


def free_memory_now() -> int | None:
    return available_memory()
