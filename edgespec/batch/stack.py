"""A request's model stack, composed in one place and in one order, bottom up:

    the verifier (engine.model), which the mode was built with
      -> the request's batch row view (SeqModel: its row of the batch's joint passes)   [in a batch]
      -> logits processing (ProcessedModel: penalties, grammar, logprobs)              [when asked]

set once on the mode as `mode.model`. The drafter's side is composed when the mode is built:
the mode drafts with its own fork (drafters.base.request_drafter), whose prefix reuse the
batch binds (Batcher._drafter_reuse).
"""

from __future__ import annotations

from collections.abc import Callable

from edgespec.logits.processors import wrap_processors


def compose_request(mode, engine, options, prompt: list[int], view: Callable | None = None,
                    sampler=None) -> Callable:
    """Put the request's stack under `mode` (see the module docstring); `view(model)` makes the
    batch row view (None: outside a batch); `sampler`: the request's (for the exactness guard).
    Returns the wrapper for the mode's token stream."""
    model = getattr(mode, "model", None)  # a mode added by hand may expose no verifier
    stack = view(model) if view is not None and model is engine.model else model
    stack, follow = wrap_processors(stack, mode, engine, options, prompt, sampler)
    if stack is not model:
        mode.model = stack
    return follow
