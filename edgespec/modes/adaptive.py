"""Mode "adaptive" (what "auto" resolves to): the best source each round, never slower than plain.

See edgespec.adaptive.decoder for the round and edgespec.adaptive.sources for
the sources. Costs come from the engine's one-time measurements: the verify
cost of tree passes of 1..64 tokens (`calibrate_tree`) and, with a drafter,
its seconds per drafted token (`controller.calibrate`).
"""

from __future__ import annotations

from edgespec.adaptive.decoder import AdaptiveDecoder
from edgespec.adaptive.estimate import Costs
from edgespec.adaptive.sources import ContextSource, DrafterSource, HistorySource, JacobiSource
from edgespec.errors import DrafterRequiredError
from edgespec.modes import register_mode
from edgespec.modes.schema import Option

SOURCES = ("context", "history", "jacobi", "drafter")


def _sources(value) -> str:
    text = str(value).strip()
    if text == "auto":
        return text
    parts = [p.strip() for p in text.split("+") if p.strip()]
    bad = [p for p in parts if p not in SOURCES]
    if bad or not parts:
        raise ValueError(
            f"adaptive option 'sources' takes 'auto' or {', '.join(SOURCES)} joined by '+', got {value!r}"
        )
    return "+".join(dict.fromkeys(parts))


OPTIONS = [
    Option("sources", "str", "auto",
           "candidate sources joined by '+': context (n-grams of this request), history (earlier requests), "
           "jacobi (lookahead's Jacobi window and its n-gram pool), drafter; auto = every one available",
           check=_sources),
    Option("window", "int", None, "Jacobi window columns W when the jacobi source is on (device default: "
           "lookahead's)", 1, 16),
    Option("ngram", "int", None, "Jacobi n-gram size N (levels + 1)", 2, 8),
    Option("guesses", "int", 3, "candidates per cheap source and round", 1, 8),
    Option("span", "int", 16, "longest candidate continuation, in tokens", 1, 32),
    Option("max_tree", "int", 32, "most tokens one verifier pass may check", 2, 64),
    Option("batch_aware", "bool", True, "inside a batch of concurrent requests, verify a tree only when it "
           "raises the whole batch's tokens/s (0: price it as if alone, for measurements)"),
]


def drafter_usable(drafter) -> bool:
    """Can the adaptive decoder draft with it? (It must follow other sources' tokens.)"""
    return drafter is not None and hasattr(drafter, "sync") and not getattr(drafter, "needs_features", False)


# Every size up to 16 (a CPU BLAS can run 16 rows faster than 12, and the planner should
# know), then a coarser grid; measured once per engine (a few seconds for SmolLM2-135M on 2 cores).
COST_SIZES = tuple(range(1, 17)) + (20, 24, 32, 48, 64)


def adaptive_costs(engine):
    from edgespec.tree.controller import calibrate_tree

    if "_adaptive_tree_costs" not in engine.__dict__:
        engine.__dict__["_adaptive_tree_costs"] = calibrate_tree(
            engine.model, 64, context=128, reps=1, sizes=COST_SIZES, monotone=False
        )
    return engine.__dict__["_adaptive_tree_costs"]


def make_adaptive_mode(engine, options, use_drafter: bool = True) -> AdaptiveDecoder:
    from edgespec.modes.speculative import engine_costs
    from edgespec.modes.tree import MAX_TREE

    o = options.mode_options
    wanted = o.get("sources", "auto")
    names = SOURCES if wanted == "auto" else tuple(wanted.split("+"))
    drafter = engine.drafter if use_drafter and "drafter" in names else None
    if drafter is not None and not drafter_usable(drafter):
        if wanted != "auto":
            raise DrafterRequiredError(
                f"adaptive source 'drafter' cannot use {drafter.name!r}: it must follow other sources' tokens "
                "(sync) and not read verifier features; use mode 'speculative' for it"
            )
        drafter = None
    if wanted != "auto" and "drafter" in names and engine.drafter is None:
        raise DrafterRequiredError("adaptive source 'drafter' needs a drafter: load one (--drafter), or drop the source")
    tree = adaptive_costs(engine)
    dsrc = None
    if drafter is not None:
        dsrc = DrafterSource(drafter, engine_costs(engine, drafter).draft_s)
    costs = Costs(list(tree.sizes), list(tree.verify_s), dsrc.caps.cost_per_token if dsrc else 0.0)
    span = o.get("span", 16)
    sources = []
    if "context" in names:
        sources.append(ContextSource(span))
    history = getattr(engine, "history", None)
    if "history" in names and history is not None:
        sources.append(HistorySource(history))
    jacobi = None
    if "jacobi" in names:
        from edgespec.modes.lookahead import default_options

        d = default_options()
        jacobi = JacobiSource(o.get("window", d["window"]), o.get("ngram", d["ngram"]))
    return AdaptiveDecoder(
        engine.model,
        sources,
        costs,
        drafter=dsrc,
        jacobi=jacobi,
        # What earlier requests measured (acceptance per source, costs, probe waits), per source set.
        memory=engine.__dict__.setdefault("_adaptive_memory", {}).setdefault(
            (names, id(drafter) if drafter is not None else None), {}
        ),
        guesses=o.get("guesses", 3),
        span=span,
        max_tree=min(o.get("max_tree", 32), MAX_TREE),
        batch_aware=o.get("batch_aware", True),
    )


@register_mode(
    "adaptive",
    "each round verifies what pays most: drafter chain, context n-grams, earlier requests' text, or a plain step",
    options=OPTIONS,
)
def make_adaptive(engine, options):
    return make_adaptive_mode(engine, options)
