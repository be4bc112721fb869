"""Mode "prompt_lookup": the speculative engine with the weight-free PromptLookupDrafter."""

from __future__ import annotations

from edgespec.drafters.prompt_lookup import PromptLookupDrafter
from edgespec.modes.registry import register_mode
from edgespec.modes.schema import PIPELINE, Option
from edgespec.modes.speculative import SpeculativeMode, bind_engine, engine_costs, engine_memory

OPTIONS = [
    Option("ngram_max", "int", 3, "longest context suffix looked up", 1, 16),
    Option("ngram_min", "int", 1, "shortest context suffix looked up", 1, 16),
    PIPELINE,
]


@register_mode(
    "prompt_lookup",
    "speculative decoding with n-grams copied from the context (no drafter weights)",
    options=OPTIONS,
)
def make_prompt_lookup(engine, options):
    opts = options.mode_options
    nmax = opts.get("ngram_max", 3)
    nmin = opts.get("ngram_min", 1)
    # One drafter per engine and settings, so the controller (kept per drafter) carries
    # what it learnt from request to request.
    cache = engine.memory.prompt_lookup_drafters
    drafter = cache.setdefault((nmax, nmin), PromptLookupDrafter(nmax, nmin))
    costs = engine_costs(engine, drafter) if options.draft_tokens == "auto" else None
    mode = SpeculativeMode(engine.model, drafter, options, stats_name="prompt_lookup", costs=costs,
                           memory=engine_memory(engine, drafter, "prompt_lookup"))
    bind_engine(mode, engine)
    return mode
