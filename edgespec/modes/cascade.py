"""Mode "cascade": tiny drafter -> mid drafter -> verifier, exact end to end.

The tiny level is the engine's drafter (e.g. the shipped distilled one, or
prompt lookup); the mid level is self-speculation on the verifier's own kept
layers (`mid_layers` to choose them, else the searched skip set). The mid level
verifies the tiny drafts (edgespec.tree.cascade) and the ordinary speculative
mode verifies the mid level's drafts, with its controller choosing K or plain
decoding from measured costs.
"""

from __future__ import annotations

from edgespec.drafters.base import request_drafter
from edgespec.drafters.self_spec import SelfSpecDrafter, self_drafter
from edgespec.errors import DrafterRequiredError
from edgespec.modes.registry import register_mode
from edgespec.modes.schema import PIPELINE, Option
from edgespec.modes.speculative import SpeculativeMode, bind_engine, engine_costs, engine_memory
from edgespec.tree.cascade import CascadeDrafter

OPTION_HELP = {
    "mid_layers": "verifier layers the mid level keeps, e.g. 0-5+8+10 (default: the searched self-speculation set)",
    "inner_k": "tokens the tiny drafter proposes per mid-level check (1..8, default 3)",
    "adaptive": "1: use the tiny level only while it makes drafting faster; 0: always",
}


def _layers(text, n: int) -> list[int]:
    out = []
    for part in str(text).replace(",", "+").split("+"):
        a, dash, b = part.strip().partition("-")
        if not a.strip().isdigit() or (dash and not b.strip().isdigit()):
            raise ValueError(
                f"cascade option 'mid_layers' wants layer numbers like 0-5+8, got {text!r}"
            )
        out += list(range(int(a), int(b) + 1)) if dash else [int(a)]
    if not out or any(not 0 <= i < n for i in out):
        raise ValueError(
            f"cascade option 'mid_layers' must name layers in 0..{n - 1}, got {text!r}"
        )
    return sorted(set(out))


def cascade_drafter(engine, opts: dict) -> CascadeDrafter:
    unknown = set(opts) - set(OPTION_HELP) - {"pipeline"}
    if unknown:
        raise ValueError(
            f"unknown cascade option(s) {sorted(unknown)}; valid: {', '.join(OPTION_HELP)}"
        )
    tiny = engine.drafter
    if tiny is None or not tiny.caps.syncs:
        raise DrafterRequiredError(
            "mode 'cascade' needs a tiny drafter that can roll back (a distilled/MLX drafter folder "
            "or 'prompt_lookup'); the mid level is built from the verifier's own layers"
        )
    if "cascade" not in tiny.caps.modes:
        # Refused by name (its declared modes), before the mid level is searched or anything is loaded
        # in its place: a drafter the user chose is never swapped for another without a word.
        raise DrafterRequiredError(
            f"mode 'cascade' cannot use the {tiny.name!r} drafter as its tiny level: "
            + ("a feature drafter reads the verifier's hidden states and drafts in mode 'speculative' only"
               if tiny.caps.reads == "features" else
               f"it drafts from the verifier's cache, in modes {' and '.join(repr(m) for m in sorted(tiny.caps.modes))}"
               " only")
            + "; load a distilled or MLX drafter (--drafter FOLDER, or 'prompt_lookup') or use mode 'speculative'"
        )
    inner_k = opts.get("inner_k", 3)
    if isinstance(inner_k, str) and inner_k.isdigit():
        inner_k = int(inner_k)
    if not isinstance(inner_k, int) or isinstance(inner_k, bool) or not 1 <= inner_k <= 8:
        raise ValueError(f"cascade option 'inner_k' must be an integer in 1..8, got {inner_k!r}")
    adaptive = bool(opts.get("adaptive", True))
    layers = opts.get("mid_layers")
    key = (id(tiny), str(layers), inner_k, adaptive)
    store = engine.memory.cascade_drafters
    if key not in store:
        if layers is None:
            mid = self_drafter(engine)
        else:
            mid = SelfSpecDrafter(engine.model, _layers(layers, len(engine.model.layers)))
        store[key] = CascadeDrafter(mid, tiny, inner_k=inner_k, adaptive=adaptive)
    return store[key]


OPTIONS = [
    Option("mid_layers", "str", None, OPTION_HELP["mid_layers"], check=str),
    Option("inner_k", "int", 3, OPTION_HELP["inner_k"], 1, 8),
    Option("adaptive", "bool", True, OPTION_HELP["adaptive"]),
    PIPELINE,
]


@register_mode(
    "cascade",
    "tiny drafter -> self-speculative mid level -> verifier, lossless (controller decides)",
    options=OPTIONS,
)
def make_cascade(engine, options):
    drafter = cascade_drafter(engine, options.mode_options)
    costs = engine_costs(engine, drafter) if options.draft_tokens == "auto" else None
    # Drafted with a fork: concurrent requests of a batch each keep a state of their own.
    mode = SpeculativeMode(engine.model, request_drafter(drafter), options, stats_name="cascade", costs=costs,
                           memory=engine_memory(engine, drafter, "cascade"))
    bind_engine(mode, engine)
    return mode
