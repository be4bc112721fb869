"""Mode "adaptive" (what "auto" resolves to): the best source each round, never slower than plain.

See edgespec.adaptive.decoder for the round and edgespec.adaptive.sources for
the sources. Costs are learnt, never measured up front: the engine's cost store
(edgespec.calibration) starts the verify-cost curve over 1..64 tokens and the
drafter's seconds per token from what an earlier process persisted for this
model on this machine, or from a conservative prior, and every pass and draft
run alone teaches it (plain steps T = 1, tree rounds their size). So the first
request decodes at once; what was learnt is written to
$EDGESPEC_HOME/calibration/ for the next process.
"""

from __future__ import annotations

from edgespec.adaptive.decoder import AdaptiveDecoder
from edgespec.adaptive.policy import policy_for
from edgespec.adaptive.sources import (
    RUNNER_UPS,
    SURE_FLOOR,
    ContextSource,
    CorpusSource,
    DrafterSource,
    ForcedSource,
    HistorySource,
    JacobiSource,
)
from edgespec.calibration import SIZES, cost_store
from edgespec.calibration import measure as measure_now
from edgespec.drafters.base import request_drafter
from edgespec.errors import DrafterRequiredError
from edgespec.modes.lookahead import default_options
from edgespec.modes.registry import register_mode
from edgespec.modes.schema import Option
from edgespec.modes.tree import MAX_TREE

SOURCES = ("forced", "context", "history", "corpus", "jacobi", "drafter")


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
           "candidate sources joined by '+': forced (the tokens a response_format's grammar forces), context (n-grams of this request), history (earlier requests), "
           "corpus (the verifier's own answers, when the model has a corpus file), jacobi (lookahead's Jacobi window and its n-gram pool), drafter; auto = every one available",
           check=_sources),
    Option("window", "int", None, "Jacobi window columns W when the jacobi source is on (device default: "
           "lookahead's)", 1, 16),
    Option("ngram", "int", None, "Jacobi n-gram size N (levels + 1)", 2, 8),
    Option("guesses", "int", 3, "candidates per cheap source and round", 1, 8),
    Option("span", "int", 16, "longest candidate continuation, in tokens", 1, 32),
    Option("max_tree", "int", 32, "most tokens one verifier pass may check", 2, 64),
    Option("runner_ups", "int", RUNNER_UPS, "a drafter that ranks its tokens (an MLX drafter): its next most "
           "likely tokens offered as one-token branches beside each drafted token (0: the chain alone; "
           "on a CPU they lose, see docs/adaptive.md)", 0, 4),
    Option("draft_floor", "float", SURE_FLOOR, "such a drafter stops its chain once the product of its own "
           "probabilities of the drafted tokens falls below this (0: it drafts what the planner asked; e.g. 0.4)", 0.0, 1.0),
    Option("pipeline", "bool", True, "let the planner draft the next round while this one is verified, "
           "when the drafter can (an MLX, Core ML or int8 drafter; priced each round from the measured "
           "slowdown each side causes the other; 0: always draft between passes)"),
    Option("batch_aware", "bool", True, "inside a batch of concurrent requests, verify a tree only when it "
           "raises the whole batch's tokens/s (0: price it as if alone, for measurements)"),
]


def drafter_usable(drafter) -> bool:
    """Can the adaptive decoder draft with it? (It must follow other sources' tokens.)"""
    return drafter is not None and drafter.caps.syncs and not drafter.caps.needs_features


# Every size up to 16 (a CPU BLAS can run 16 rows faster than 12, and the planner should
# know), then a coarser grid (edgespec.calibration.SIZES).
COST_SIZES = SIZES


def adaptive_costs(engine, measure: bool = False):
    """The engine's current verify-cost curve (a TreeCosts: sizes, verify_s), as the batcher
    prices steps with it: learnt and persisted (edgespec.calibration); nothing is measured
    unless `measure` (benchmarks: time every size now, `calibration.measure`)."""
    store = measure_now(engine) if measure else cost_store(engine)
    store.publish(engine)
    return engine.memory.tree_costs


def make_adaptive_mode(engine, options, use_drafter: bool = True) -> AdaptiveDecoder:
    o = options.mode_options
    wanted = o.get("sources", "auto")
    names = SOURCES if wanted == "auto" else tuple(wanted.split("+"))
    # Named at load, the engine's drafter; else the verifier in int8 where it runs (engine.auto_drafter)
    drafter = (engine.auto_drafter or engine.drafter) if use_drafter and "drafter" in names else None
    if drafter is not None and not drafter_usable(drafter):
        if wanted != "auto":
            raise DrafterRequiredError(
                f"adaptive source 'drafter' cannot use {drafter.name!r}: it must follow other sources' tokens "
                "(sync) and not read verifier features; use mode 'speculative' for it"
            )
        drafter = None
    if wanted != "auto" and "drafter" in names and drafter is None and engine.drafter is None:
        raise DrafterRequiredError("adaptive source 'drafter' needs a drafter: load one (--drafter), or drop the source")
    store = cost_store(engine)  # read once per engine; measures nothing
    store.publish(engine)
    # The request's own fork of the drafter (its state apart from the batch's other rows).
    dsrc = DrafterSource(request_drafter(drafter), store.draft(drafter), runner_ups=o.get("runner_ups", RUNNER_UPS),
                         floor=o.get("draft_floor", SURE_FLOOR)) if drafter is not None else None
    span = o.get("span", 16)
    sources = []
    if "forced" in names:  # proposes only when the request has a grammar (bound per request)
        sources.append(ForcedSource())
    if "context" in names:
        sources.append(ContextSource(span))
    history = getattr(engine, "history", None)
    if "history" in names and history is not None:
        sources.append(HistorySource(history))
    corpus = engine.corpus_table if "corpus" in names else None
    if corpus is not None:
        sources.append(CorpusSource(corpus))
    jacobi = None
    if "jacobi" in names:
        d = default_options()
        jacobi = JacobiSource(o.get("window", d["window"]), o.get("ngram", d["ngram"]))
    mode = AdaptiveDecoder(
        engine.model,
        sources,
        store.costs,
        drafter=dsrc,
        jacobi=jacobi,
        # What earlier requests measured (acceptance per source, costs, probe waits), per source set.
        memory=engine.memory.adaptive.setdefault(
            (names, id(drafter) if drafter is not None else None), {}
        ),
        guesses=o.get("guesses", 3),
        span=span,
        max_tree=min(o.get("max_tree", 32), MAX_TREE),
        batch_aware=o.get("batch_aware", True),
        pipeline=o.get("pipeline", True),
        after_request=lambda: _after_request(engine, store),
        policy=policy_for(engine),
    )
    mode.request_drafter = dsrc.drafter if dsrc is not None else None  # the batch binds its reuse
    return mode


def _after_request(engine, store) -> None:
    store.publish(engine)  # the batcher prices steps with the curve as learnt so far
    store.maybe_save()


@register_mode(
    "adaptive",
    "each round verifies what pays most: drafter chain, context n-grams, earlier requests' text, or a plain step",
    options=OPTIONS,
)
def make_adaptive(engine, options):
    return make_adaptive_mode(engine, options)
