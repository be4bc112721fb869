"""`edgespec pull`: fetch a model by its hub name (and the drafter paired with it) for offline runs."""

from __future__ import annotations

import sys

HELP = "fetch a model by its hub name ORG/NAME[:QUANT], with its paired drafter, for offline use"
DESCRIPTION = (
    "Fetch ORG/NAME[@REVISION][:QUANT] into the Hugging Face hub cache (shared with transformers and mlx-lm: "
    "what is there is not fetched again), only the files edgespec runs: config, tokenizer, one weights "
    "format, the chosen GGUF file (:QUANT; without one Q4_K_M, else Q8_0, else Q4_0), a shipped drafter. "
    "The drafter paired with the model (edgespec/data/hub_drafters.json) is fetched too and its tokenizer "
    "checked. HF_TOKEN or a saved login opens gated models; HF_ENDPOINT, HF_HOME and HF_HUB_OFFLINE are "
    "honoured. Later runs by name make no hub call. See docs/hub.md."
)


def add_arguments(p) -> None:
    p.add_argument("name", help="hub name: ORG/NAME, ORG/NAME@REVISION, ORG/NAME:QUANT (a GGUF file of a GGUF "
                   "repository, e.g. :Q4_K_M or :Q8_0, or the file's own name without .gguf when two carry one tag)")
    p.add_argument("--no-drafter", action="store_true", help="do not fetch the drafter paired with the model")
    p.add_argument("--quiet", action="store_true", help="no progress bar and no messages but errors")


def run(args) -> int:
    from edgespec.hub.fetch import human, pull  # deferred: CLI start-up
    from edgespec.hub.names import parse  # deferred: CLI start-up

    name = parse(args.name)
    if name is None:
        raise ValueError(f"{args.name!r} is not a hub name: ORG/NAME[@REVISION][:QUANT]")
    say = (lambda m: None) if args.quiet else (lambda m: print(f"edgespec: {m}", file=sys.stderr, flush=True))
    local = pull(name, progress=not args.quiet, report=say, drafter=not args.no_drafter)
    for note in local.notes:
        print(f"edgespec: {note}", file=sys.stderr)
    if not args.quiet:
        got = f"fetched {human(local.fetched)}" if local.fetched else "nothing fetched: all in the cache"
        print(f"{name}: {local.kind}, {local.path} ({got})")
    return 0
