"""Will a drafter fit? Memory estimates for choosing lookahead (no extra weights) instead.

A drafter costs its weights plus its own KV cache at the context length; a
drafter that reuses the verifier's weights (self-speculation) costs only its
cache, and prompt lookup costs nothing worth counting. The budget is the
user's `--memory-budget`, else what the machine has free now plus what the
loaded models already hold.
"""

from __future__ import annotations

import re

from mlx.utils import tree_flatten

from edgespec.caches.kv import kv_bytes  # noqa: F401  (re-exported: the memory accounting's unit)
from edgespec.host_memory import available_memory  # api and batch.memory take it from here

_UNITS = {"": 1, "B": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def parse_size(text: str | int | None, allow_zero: bool = False, what: str = "memory budget") -> int | None:
    """'1.5G', '800M', '512MB', '1073741824' -> bytes; None / '' -> None. `allow_zero`: 0 is
    a size too (a cache turned off)."""
    if text is None or text == "":
        return None
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0 or (text == 0 and not allow_zero):
            raise ValueError(f"{what} must be {'>= 0' if allow_zero else 'positive'}, got {text}")
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)(I?B)?\s*", str(text).upper())
    if not m or (float(m.group(1)) <= 0 and not allow_zero):
        raise ValueError(f"{what} {text!r}: use a {'' if allow_zero else 'positive '}size like 800M, 1.5G or 2GB"
                         + (" (0 = off)" if allow_zero else ""))
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def tree_bytes(module) -> int:
    return sum(v.nbytes for _, v in tree_flatten(module.parameters()))


def drafter_bytes(drafter, verifier, context: int) -> tuple[int, int]:
    """(weights, KV cache at `context`) the drafter adds to the verifier's own."""
    model = drafter.model
    if model is None or not hasattr(model, "parameters"):
        # weight-free (prompt lookup), host weights (the int8 drafter's), or not an MLX model
        return int(drafter.host_bytes), 0
    n_layers = len((drafter.layer_ids if drafter.caps.mlx_model else None) or model.layers)
    own = 0 if model is verifier else tree_bytes(model)
    return own, kv_bytes(model.args, context) * n_layers // max(model.args.num_hidden_layers, 1)


def drafter_fits(engine, budget: int | None = None, drafter=None) -> bool:
    """True if verifier + drafter, weights and KV caches at the full context, fit the budget.

    Without a budget, the caches (not allocated yet) must fit in the free memory
    detected now; the weights are already loaded and out of it.
    """
    drafter = engine.drafter if drafter is None else drafter
    if drafter is None:
        return True
    model, context = engine.model, engine.context_length
    d_weights, d_kv = drafter_bytes(drafter, model, context)
    weights = tree_bytes(model) + d_weights
    caches = kv_bytes(model.args, context) + d_kv
    if budget is None:
        free = available_memory()
        return free is None or caches <= free
    return weights + caches <= budget
