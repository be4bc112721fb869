"""KV memory per sequence, accounted against the memory budget (--memory-budget).

A sequence's caches grow in steps of KVCache.step positions up to its prompt plus
max_tokens (plus room for one verified tree), never past the context window:

    reserve(P, max_tokens) = kv_per_token * roundup(min(P + max_tokens + TREE, context), step)

A short request's verifier K/V lives in a row of the batch's KV arena instead, and
every row of an arena is as long as its longest (and the arena keeps its rows until the
batch empties), so the batcher accounts those as the arena they make:

    arena = max(rows held, short requests live) * max(positions held, their longest) * K/V per position

plus each short request's drafter cache of its own.

The budget for caches is --memory-budget minus the weights already loaded (the
verifier's and a drafter's); without a budget, a share of the memory free when the
batcher started. A request waits while the running ones hold too much, and is
refused at once when even an empty engine could not hold it.
"""

from __future__ import annotations

from edgespec.caches.kv import KVCache
from edgespec.errors import EdgespecError
from edgespec.lookahead.memory import available_memory, drafter_bytes, kv_bytes, tree_bytes

TREE = 64  # a verified tree's tokens sit in the cache until the round commits
FREE_SHARE = 0.75  # without --memory-budget: this share of the free memory goes to caches
TYPICAL_TOKENS = 2048  # the request size the default --max-batch is sized for
MAX_BATCH_CAP = 8  # the default never goes past this (measured: CPU, a pass of 8 rows ~1.4x one; a guess for Metal)


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


def verifier_kv_per_token(engine) -> int:
    """Bytes of the verifier's K/V (every layer) per position."""
    return kv_bytes(engine.model.args, 1, _itemsize(engine.model))


def drafter_kv_per_token(engine) -> int:
    """Bytes of a drafter's own cache per position (0 without a drafter)."""
    return 0 if engine.drafter is None else drafter_bytes(engine.drafter, engine.model, 1)[1]


def kv_per_token(engine) -> int:
    """Bytes one more position costs a sequence: the verifier's K/V of every layer, plus a
    drafter's own cache when one runs."""
    return verifier_kv_per_token(engine) + drafter_kv_per_token(engine)


def positions(engine, prompt_tokens: int, max_tokens: int, step: int = KVCache.step) -> int:
    """Cache positions a request may fill, rounded up to the cache's growth step."""
    n = min(prompt_tokens + max_tokens + TREE, engine.context_length + TREE)
    return -(-n // step) * step


def reserve_bytes(engine, prompt_tokens: int, max_tokens: int) -> int:
    return kv_per_token(engine) * positions(engine, prompt_tokens, max_tokens)


def arena_bytes(engine, rows: int, positions: int) -> int:
    """Bytes of a KV arena (edgespec.batch.arena) of `rows` rows of `positions` positions:
    verifier K/V only (a drafter keeps caches of its own)."""
    return rows * positions * verifier_kv_per_token(engine)


def cache_budget(engine, free_at_start: int | None) -> float:
    """Bytes the sequences' caches may hold together (inf when nothing is known)."""
    if engine.memory_budget is not None:
        weights = tree_bytes(engine.model)
        for d in {id(d): d for d in (engine.drafter, engine.auto_drafter) if d is not None}.values():
            weights += drafter_bytes(d, engine.model, 0)[0]
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
