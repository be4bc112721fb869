"""Arguments shared by the apps (model, decoding mode, sampling) and their translation."""

from __future__ import annotations

import argparse
import sys


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument(
        "--model",
        default=None,
        help="edgespec bundle, Hugging Face folder, GGUF file, or a hub name ORG/NAME[@REVISION][:QUANT] "
        "(fetched once into the hub cache, then run offline; a local path that exists wins; docs/hub.md) "
        "(default: SmolLM2-135M-Instruct, downloaded once into $EDGESPEC_HOME or ~/.cache/edgespec)",
    )
    g.add_argument(
        "--drafter",
        default=None,
        help="drafter for speculative decoding: a drafter folder or bundle, a hub name ORG/NAME, 'self' (skip-layer "
        "self-speculation), 'int8' (the verifier's own weights in int8, CPU device), 'prompt_lookup', or 'none'; "
        "default: the bundle's own drafter if any, else for a model run by name the drafter paired with it when "
        "it is in the cache; mode auto then drafts with the verifier in int8 where it runs "
        "(EDGESPEC_INT8_DRAFTER=off: with the default drafter)",
    )
    g.add_argument(
        "--memory-budget",
        default=None,
        help="memory the model may use, e.g. 800M or 2G (default: the free memory detected); "
        "when the drafter would not fit, mode auto drafts from weight-free sources only",
    )
    g.add_argument(
        "--history",
        default=None,
        choices=["memory", "disk", "off"],
        help="earlier prompts and replies as a draft source for mode auto: memory (default; this process "
        "only, at most 64 MB), disk (also kept in $EDGESPEC_HOME/history, reloaded next time) or off; "
        "default: $EDGESPEC_HISTORY, else memory. History only shapes drafts, never the output",
    )
    g.add_argument(
        "--numerics",
        default=None,
        choices=["native", "metal"],
        help="native: the device's own numerics (dense float32 on the CPU); metal: load and run the model "
        "as a Mac's GPU would on any device (4-bit weights kept quantized, float16 activations and KV "
        "caches, auto's drafter as on a Mac), to check the Mac's path here (docs/numerics.md); "
        "default: $EDGESPEC_NUMERICS, else native",
    )
    g.add_argument(
        "--bitwise-verify",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="bitwise verification: each position of a verifier pass over many tokens gets bitwise "
        "the logits a one-token pass gives, so speculative modes cannot flip a near-tie of plain "
        "decoding (costs some speed, docs/bitwise.md); default: $EDGESPEC_BITWISE, else off",
    )


def add_cache_arguments(p: argparse.ArgumentParser, prompt_cache_files: bool = True) -> None:
    g = p.add_argument_group("prompt and KV cache")
    g.add_argument(
        "--prompt-cache-bytes",
        default=None,
        metavar="SIZE",
        help="memory kept for earlier prompts' and replies' caches, so a request that starts the same "
        "way (the next chat turn, a shared system prompt) runs only what is new, e.g. 500M or 2G; "
        "0 turns reuse off (default: two full contexts of the model's KV cache, at most 1G and a fifth of "
        "what the memory budget leaves for caches; 'memory': that fifth alone)",
    )
    if prompt_cache_files:
        g.add_argument(
            "--prompt-cache",
            action="append",
            default=[],
            metavar="FILE",
            help="a prompt prefilled once by `edgespec cache-prompt` (repeatable): requests that start with "
            "it reuse its cache; kept in memory for the whole run",
        )
    g.add_argument(
        "--kv-bits",
        type=int,
        choices=[8, 4],
        default=None,
        help="store the KV cache quantized to this many bits (less memory for long conversations; "
        "changes the output slightly, see docs/prefix_cache.md; default: full precision)",
    )
    g.add_argument("--kv-group-size", type=int, choices=[32, 64, 128], default=64,
                   help="with --kv-bits: values quantized together (one scale and bias per group)")
    g.add_argument("--quantized-kv-start", type=int, default=0, metavar="N",
                   help="with --kv-bits: the first N positions stay in full precision")


def load_prompt_caches(engine, args) -> str | None:
    """Put the --prompt-cache files into the engine's prefix cache (pinned: never evicted).
    Returns the system prompt a cached one stands for (the apps' default --system), if any."""
    from edgespec.caches import sessions  # deferred: CLI start-up

    system = None
    for path in getattr(args, "prompt_cache", None) or []:
        tokens, extra, n = sessions.load(engine, path, pin=True)
        if extra.get("kind") != "prompt":
            raise sessions.SessionFileError(f"{path} is a saved chat session, not a prompt cache "
                                            "(load it with `edgespec chat --session` or /load)")
        print(f"[edgespec] prompt cache {path}: {n} of its {len(tokens)} tokens ready", file=sys.stderr)
        system = extra.get("system", system)
    return system


def _options_help() -> str:
    from edgespec.modes import SCHEMAS  # deferred: CLI start-up

    return " ".join(f"{name}: {schema.help()}." for name, schema in SCHEMAS.items() if schema.options)


def add_decoding_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("decoding")
    g.add_argument(
        "--mode",
        default="auto",
        help="decoding mode: auto (= adaptive: each round verifies what pays most of the drafter, "
        "n-grams of the context, earlier replies and a Jacobi window, or steps plainly), plain, "
        "speculative, lookahead, prompt_lookup, tree (many drafted/looked-up continuations verified in "
        "one pass), cascade (tiny drafter -> verifier's own layers -> verifier); all give the "
        "verifier's own output",
    )
    g.add_argument(
        "--draft-tokens",
        default="auto",
        help="tokens drafted per verifier pass in speculative modes: 'auto' (controller picks K "
        "from measured costs and acceptance) or an integer 1..16",
    )
    g.add_argument(
        "--mode-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        # built when help is printed (edgespec.cli.HelpFormatter): it loads the modes, and mlx
        help=lambda: "setting of the decoding mode (repeatable), checked before the model loads. "
        + _options_help(),
    )
    g.add_argument("--max-tokens", type=int, default=256, help="maximum tokens in a reply")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    s = p.add_argument_group("sampling")
    s.add_argument("--temperature", "--temp", type=float, default=0.0, help="0 = greedy; >0 samples")
    s.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    s.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (1 = off)")
    s.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p x the top probability (0 = off)")
    s.add_argument("--seed", type=int, default=None, help="random seed for reproducible sampling")


def options_from_args(args, **settings):
    """make_options from the decoding arguments; `settings`: more make_options keywords
    (e.g. response_format)."""
    from edgespec.engine import make_options  # deferred: CLI start-up

    dt = args.draft_tokens
    if dt != "auto":
        try:
            dt = int(dt)
        except ValueError:
            raise ValueError(f"--draft-tokens must be 'auto' or an integer, got {dt!r}") from None
    extra = {}
    for item in getattr(args, "mode_option", None) or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--mode-option wants KEY=VALUE, got {item!r}")
        key, v = key.strip(), value.strip()
        if key in ("max_tokens", "stop", "temperature", "top_k", "top_p", "min_p", "seed", "mode", "draft_tokens"):
            raise ValueError(f"--mode-option {key}: use the --{key.replace('_', '-')} option instead")
        extra[key] = int(v) if v.lstrip("-").isdigit() else v
    return make_options(
        max_tokens=args.max_tokens,
        stop=args.stop,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        seed=args.seed,
        mode=args.mode,
        draft_tokens=dt,
        **extra,
        **settings,
    )


def load_engine(args, progress: bool = True):
    import edgespec  # deferred: CLI start-up
    from edgespec.lookahead.memory import parse_size  # deferred: CLI start-up

    budget = parse_size(getattr(args, "memory_budget", None))  # a bad size fails before the model loads
    cache_bytes = getattr(args, "prompt_cache_bytes", None)
    if cache_bytes is not None and cache_bytes != "memory":  # "memory": the share of memory (edgespec.load)
        cache_bytes = parse_size(cache_bytes, allow_zero=True, what="--prompt-cache-bytes")
    engine = edgespec.load(
        args.model, drafter=getattr(args, "drafter", None), progress=progress, history=getattr(args, "history", None),
        prompt_cache_bytes=cache_bytes, kv_bits=getattr(args, "kv_bits", None),
        kv_group_size=getattr(args, "kv_group_size", 64), quantized_kv_start=getattr(args, "quantized_kv_start", 0),
        bitwise=getattr(args, "bitwise_verify", None), numerics=getattr(args, "numerics", None),
    )
    if budget:
        engine.limit_memory(budget)
    for note in engine.load_notes:
        print(f"[edgespec] {note}", file=sys.stderr)
    from edgespec.weights.bundle import unverified_note  # deferred: CLI start-up

    note = unverified_note(args.model)  # e.g. a bundle whose manifest.json was deleted
    if note:
        print(f"[edgespec] note: {note}", file=sys.stderr)
    return engine


def resolve_model_arg(spec, progress: bool = True):
    """A model argument as a local path: a hub name (ORG/NAME...) is fetched once into the hub cache,
    a path is kept as it is (one that exists wins over a name)."""
    from edgespec.hub.names import as_hub_name  # deferred: CLI start-up

    if as_hub_name(spec) is None:
        return spec
    from edgespec.hub.fetch import resolve_path  # deferred: CLI start-up

    report = (lambda m: print(f"edgespec: {m}", file=sys.stderr, flush=True)) if progress else None
    return resolve_path(spec, progress=progress, report=report)


def print_notes(engine, stats) -> None:
    for note in stats.notes:
        if engine.note_once(note):
            print(f"[edgespec] {note}", file=sys.stderr)
