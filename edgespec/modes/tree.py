"""Tree speculation as a step generator: many candidate continuations, one verifier pass.

Per pass a `SourceTree` rooted at the last committed token x0 is built from
up to four sources, merged into one trie (shared prefixes fed once):
- "drafter": branches grown by an MLX drafter (static or dynamic shape, see
  edgespec.tree.drafting), one drafter pass per level;
- "prompt_lookup": the continuation of the longest earlier match of the context's suffix;
- "pool": the lookahead n-gram pool's candidates keyed by x0;
- a Jacobi window (option window > 0), whose trajectories feed the pool (as in lookahead).
The verifier scores every node in ONE pass under the tree mask with tree
positions (`tree_mask` kernel); greedy keeps the deepest node whose path the
verifier agrees with (`tree_accept` kernel), sampling walks the tree with
recursive rejection over point-mass candidates (lookahead.verify.sample_walk;
why this scheme: docs/tree.md). The accepted path's KV entries are packed into
place (`commit_kv` kernel) in the verifier's cache and the drafter's, the
rest dropped. A StepController runs the fastest of: full trees, trees from the
weight-free sources only, plain steps; a TreeBudget sizes dynamic trees from
the verify-cost curve the engine learns from real passes (edgespec.calibration:
persisted by an earlier process or a prior; each pass run alone teaches it; nothing
is measured before the first token).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterator

import mlx.core as mx

from edgespec.adaptive.estimate import Costs
from edgespec.calibration import SIZES, cost_store, prior_curve
from edgespec.drafters.prompt_lookup import PromptLookupDrafter
from edgespec.errors import DrafterRequiredError
from edgespec.generate import GenerationStats, Token, prefill, runs_alone
from edgespec.logits.sampling import Sampler
from edgespec.lookahead import JacobiWindow, NgramPool, StepController, verify_step
from edgespec.modes.registry import register_mode
from edgespec.modes.schema import PIPELINE, Option
from edgespec.modes.speculative import bind_engine
from edgespec.tree.candidates import SourceTree
from edgespec.tree.controller import TreeBudget
from edgespec.tree.drafting import TreeDrafter, TreePlan
from edgespec.tree.proposed import ProposedTreeDrafter

SOURCES = ("drafter", "prompt_lookup", "pool")
MAX_TREE = 64  # tree tokens per pass at most (the verify-cost curve reaches this far)

# Option name -> (help, default, validator). The CLI's --mode-option help lists these.
OPTION_HELP = {
    "shape": "static (fixed branching per depth) or dynamic (grown where the drafter is unsure)",
    "branching": "static: children per node at each depth, e.g. 3x2x1x1",
    "depth": "dynamic: drafter levels per pass (1..12)",
    "width": "dynamic: nodes expanded per level (1..16)",
    "topk": "dynamic: children per expanded node (1..8)",
    "budget": "dynamic: tree tokens per pass, 'auto' (from the measured verify cost) or 2..64",
    "sources": "candidate sources joined by '+': drafter, prompt_lookup, pool (default drafter)",
    "window": "Jacobi window columns feeding the pool (0 = none, up to 8)",
    "guesses": "pool candidates per pass (0..16)",
    "adaptive": "1: the controller may fall back to weight-free or plain steps; 0: always full trees",
}


def _budget(v):
    if v == "auto":
        return v
    try:
        n = int(v)
    except (TypeError, ValueError):
        n = None
    if n is None or isinstance(v, bool) or not 2 <= n <= MAX_TREE:
        raise ValueError(f"tree option 'budget' must be 'auto' or an integer in 2..{MAX_TREE}, got {v!r}")
    return n


OPTIONS = [
    Option("shape", "choice", "dynamic", OPTION_HELP["shape"], choices=("static", "dynamic")),
    Option("branching", "str", "3x2x1x1", OPTION_HELP["branching"], check=str),
    Option("depth", "int", 5, OPTION_HELP["depth"], 1, 12),
    Option("width", "int", 3, OPTION_HELP["width"], 1, 16),
    Option("topk", "int", 3, OPTION_HELP["topk"], 1, 8),
    Option("budget", "str", "auto", OPTION_HELP["budget"], check=_budget),
    Option("sources", "str", "drafter", OPTION_HELP["sources"], check=str),
    Option("window", "int", 0, OPTION_HELP["window"], 0, 8),
    Option("guesses", "int", 2, OPTION_HELP["guesses"], 0, 16),
    Option("adaptive", "bool", True, OPTION_HELP["adaptive"]),
    PIPELINE,
]


def _int(opts, key, default, lo, hi, what="tree"):
    v = opts.get(key)
    if v is None:
        return default
    if isinstance(v, str) and v.strip().isdigit():
        v = int(v)
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise ValueError(f"{what} option {key!r} must be an integer in {lo}..{hi}, got {v!r}")
    return v


def _bool(opts, key, default):
    v = opts.get(key)
    if v is None:
        return default
    if isinstance(v, str):
        if v.lower() not in ("0", "1", "true", "false", "yes", "no"):
            raise ValueError(f"tree option {key!r} must be 0/1 or true/false, got {v!r}")
        return v.lower() in ("1", "true", "yes")
    return bool(v)


def parse_options(opts: dict, shape: str | None = None, sources=None) -> dict:
    """Tree settings from GenerateOptions.mode_options, validated (defaults: dynamic, drafter)."""
    unknown = set(opts) - set(OPTION_HELP) - {"pipeline"}
    if unknown:
        raise ValueError(
            f"unknown tree option(s) {sorted(unknown)}; valid: {', '.join(OPTION_HELP)}"
        )
    shape = opts.get("shape", shape or "dynamic")
    if shape not in ("static", "dynamic"):
        raise ValueError(f"tree option 'shape' must be static or dynamic, got {shape!r}")
    br = opts.get("branching", "3x2x1x1")
    try:
        branching = tuple(int(b) for b in str(br).replace(",", "x").replace("-", "x").split("x"))
    except ValueError:
        branching = ()
    if not branching or len(branching) > 12 or not all(1 <= b <= 8 for b in branching):
        raise ValueError(
            f"tree option 'branching' must look like 3x2x1 (1..12 depths of 1..8), got {br!r}"
        )
    plan = TreePlan(
        shape=shape,
        branching=branching,
        depth=_int(opts, "depth", 5, 1, 12),
        width=_int(opts, "width", 3, 1, 16),
        topk=_int(opts, "topk", 3, 1, 8),
    )
    if shape == "static" and plan.max_nodes() > MAX_TREE:
        raise ValueError(
            f"branching {br!r} makes {plan.max_nodes()} tree tokens; at most {MAX_TREE}"
        )
    budget = opts.get("budget", "auto")
    budget = None if budget == "auto" else _int(opts, "budget", None, 2, MAX_TREE)
    src = opts.get("sources", sources or "drafter")
    src = tuple(s.strip() for s in (src.split("+") if isinstance(src, str) else src) if s.strip())
    src = tuple("prompt_lookup" if s == "lookup" else s for s in src)
    bad = [s for s in src if s not in SOURCES]
    if bad or not src:
        raise ValueError(
            f"tree option 'sources' takes {', '.join(SOURCES)} joined by '+', got {opts.get('sources')!r}"
        )
    return {
        "plan": plan,
        "budget": budget,
        "sources": src,
        "window": _int(opts, "window", 0, 0, 8),
        "guesses": _int(opts, "guesses", 2, 0, 16),
        "adaptive": _bool(opts, "adaptive", True),
    }


class TreeMode:
    def __init__(
        self,
        model,
        drafter=None,
        plan: TreePlan | None = None,
        budget: int | None = None,
        sources=("drafter",),
        window: int = 0,
        guesses: int = 2,
        adaptive: bool = True,
        costs=None,
        ngram: int = 3,
        span: int = 8,
        name: str = "tree",
    ):
        self.model = model
        self.plan = plan or TreePlan()
        self.sources = tuple(sources)
        if "drafter" in self.sources and drafter is None:
            raise DrafterRequiredError(
                "tree source 'drafter' needs a drafter: load one, or use sources=prompt_lookup+pool"
            )
        # a drafter that grows trees itself (DrafterCaps.trees: an EAGLE-3 head) proposes whole trees
        grower = ProposedTreeDrafter if drafter is not None and drafter.caps.trees else TreeDrafter
        self.drafter = grower(drafter) if "drafter" in self.sources else None
        self.W, self.N, self.G, self.span = window, ngram, guesses, span
        self.adaptive = adaptive
        self.name = name
        fixed = budget if self.plan.shape == "dynamic" else None
        if self.plan.shape == "dynamic" and fixed is None and costs is None:
            costs = Costs(list(SIZES), prior_curve(SIZES))  # a prior, learnt from this mode's passes
        self.costs = costs
        self.after_request = None  # called when a request's rounds end (the engine saves learnt costs)
        self.policy = None  # the engine's Policy: the step kinds and tree sizes (bind_engine sets it)
        self.budget = TreeBudget(
            costs, fixed=fixed or (None if costs else MAX_TREE), max_tokens=MAX_TREE
        )

    def _now(self) -> float:
        """The time rounds are priced by: the policy's clock (a cost profile's simulated one under
        `edgespec bench --profile`, edgespec.costs.clock; a paced one in tests), else the host's."""
        return self.policy.clock() if self.policy is not None else time.perf_counter()

    def _kinds(self) -> tuple[str, ...]:
        weight_free = [s for s in self.sources if s != "drafter"] or self.W
        kinds = ["full"] + (["lean"] if weight_free and self.drafter else []) + ["plain"]
        return tuple(kinds)

    def steps(self, prompt: list[int], sampler: Sampler, stats: GenerationStats) -> Iterator[Token]:
        try:
            yield from self._steps(prompt, sampler, stats)
        finally:
            if self.after_request is not None:
                self.after_request()

    def _steps(self, prompt: list[int], sampler: Sampler, stats: GenerationStats) -> Iterator[Token]:
        model, plan = self.model, self.plan
        cache = model.make_cache()
        t0 = self._now()
        lp = sampler.logprobs(prefill(model, cache, prompt))
        tok = sampler.sample(lp)
        mx.eval(tok, lp)
        x0 = int(tok.item())
        td = self.drafter
        if isinstance(td, ProposedTreeDrafter):
            td.bind_verifier_cache(cache)
        if td is not None:
            td.begin(prompt)
        stats.prefill_s += self._now() - t0
        yield Token(x0, float(lp[x0].item()), "verifier")

        seq = list(prompt) + [x0]
        lookup = PromptLookupDrafter(3, 1) if "prompt_lookup" in self.sources else None
        if lookup is not None:
            lookup.begin(seq)
        pool = NgramPool(self.span, self.N - 1) if ("pool" in self.sources or self.W) else None
        if pool is not None:
            pool.add_text(seq)
        window = JacobiWindow(self.W, self.N, prompt) if self.W else None
        ctl = StepController(adaptive=self.adaptive, kinds=self._kinds())
        fell_back_noted = False
        while True:
            kind = ctl.choose(self.policy)
            t_step = self._now()
            tree = SourceTree.rooted(x0)
            draft_s = 0.0
            if kind == "full" and td is not None:
                pick = functools.partial(self.budget.pick, policy=self.policy) if plan.shape == "dynamic" else None
                td.grow(seq, tree, plan, pick)
                draft_s = self._now() - t_step
                stats.draft_s += draft_s
            if kind != "plain":
                if lookup is not None:
                    lookup.sync(seq)
                    tree.add_path(lookup.lookup(self.span), "prompt_lookup")
                if pool is not None and "pool" in self.sources:
                    for cand in pool.candidates(seq, self.G):
                        tree.add_path(cand, "pool")
            if kind == "full" and self.W:
                tree.add_window(window.levels)
            if kind != "plain" and len(tree) == 1:
                kind = "plain" if kind == "lean" else kind
            T = len(tree)
            tv = self._now()
            want_pred = bool(kind == "full" and self.W)
            path, nxt, lps, pred_l = verify_step(model, cache, tree, sampler, want_pred)
            stats.verify_s += self._now() - tv
            if hasattr(self.costs, "observe") and not want_pred and runs_alone(model):
                self.costs.observe(T, self._now() - tv)  # the learnt curve (TreeCosts: fixed)
            if td is not None and kind == "full":
                td.commit(path, tree)
                if plan.shape == "dynamic":
                    self.budget.record(len(path), draft_s)
            new = [tree.tokens[n] for n in path] + [nxt]
            seq.extend(new)
            if pool is not None:
                pool.add_text(seq)
            if want_pred:
                window.advance(pool, [pred_l[n] for n in tree.window[-1]])
            x0 = nxt
            ctl.record(kind, len(new), self._now() - t_step)
            stats.verifier_passes += 1
            if T > 1:
                stats.record_draft(tree.depth(), len(path))
                stats.draft_tokens = T - 1
            for n in path:
                src = tree.sources[n]
                stats.accepted_by_source[src] = stats.accepted_by_source.get(src, 0) + 1
            if ctl.fell_back and not fell_back_noted:
                fell_back_noted = True
                stats.notes.append(
                    f"{self.name}: drafting trees did not pay here; mostly cheaper steps"
                )
            for n, lpv in zip(path, lps, strict=False):
                yield Token(tree.tokens[n], lpv, tree.sources[n])
            yield Token(nxt, lps[-1], "verifier")


def engine_tree_costs(engine):
    """The verify-cost curve this engine has learnt (edgespec.calibration), shared with `auto`:
    measured by real passes, never before the first token."""
    return cost_store(engine).costs


def make_tree_mode(engine, options, shape=None, sources=None, name="tree"):
    o = parse_options(options.mode_options, shape, sources)
    drafter = engine.drafter if "drafter" in o["sources"] else None
    caps = drafter.caps if drafter is not None else None
    if caps is not None and caps.reads_verifier and not caps.trees:
        raise DrafterRequiredError(
            f"mode {name!r} cannot draft with {drafter.name!r}: it drafts from the verifier's cache of the "
            "committed tokens, not along tree branches; use mode 'speculative' or 'auto', or sources=prompt_lookup+pool")
    if "drafter" in o["sources"] and (drafter is None or drafter.model is None):
        raise DrafterRequiredError(
            f"mode {name!r} with source 'drafter' needs an MLX drafter: load with drafter='self' "
            "(skip layers of the verifier) or a drafter folder/bundle, or set "
            "--mode-option sources=prompt_lookup+pool"
        )
    if caps is not None and caps.needs_features:
        raise DrafterRequiredError(
            f"mode {name!r} cannot draft with {drafter.name!r}: a feature drafter reads the verifier's hidden "
            "states and drafts in mode 'speculative' only; use that mode, or drafter='self' for trees"
        )
    costs = (
        engine_tree_costs(engine) if o["plan"].shape == "dynamic" and o["budget"] is None else None
    )

    mode = TreeMode(engine.model, drafter, costs=costs, name=name, **o)
    bind_engine(mode, engine)
    return mode


@register_mode(
    "tree",
    "tree speculation: drafter branches (static/dynamic), prompt-lookup and pool candidates in one verifier pass",
    options=OPTIONS,
)
def make_tree(engine, options):
    return make_tree_mode(engine, options)
