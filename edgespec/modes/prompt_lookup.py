"""Mode "prompt_lookup": the speculative engine with the weight-free PromptLookupDrafter."""

from __future__ import annotations

from edgespec.drafters.prompt_lookup import PromptLookupDrafter
from edgespec.modes import register_mode

_ATTR = "_prompt_lookup_drafter"


def _int_option(opts: dict, key: str, default: int) -> int:
    v = opts.get(key, default)
    if isinstance(v, str) and v.strip().isdigit():
        v = int(v)
    if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= 16:
        raise ValueError(f"prompt_lookup option {key!r} must be an integer in 1..16, got {v!r}")
    return v


@register_mode(
    "prompt_lookup",
    "speculative decoding with n-grams copied from the context (no drafter weights)",
)
def make_prompt_lookup(engine, options):
    from edgespec.modes.speculative import SpeculativeMode, engine_costs

    opts = options.mode_options
    nmax = _int_option(opts, "ngram_max", 3)
    nmin = _int_option(opts, "ngram_min", 1)
    # One drafter per engine and settings, so the controller's cost calibration
    # (keyed by drafter) is measured once, not per request.
    cache = engine.__dict__.setdefault(_ATTR, {})
    drafter = cache.setdefault((nmax, nmin), PromptLookupDrafter(nmax, nmin))
    costs = engine_costs(engine, drafter) if options.draft_tokens == "auto" else None
    return SpeculativeMode(engine.model, drafter, options, stats_name="prompt_lookup", costs=costs)
