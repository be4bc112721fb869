"""`edgespec generate`: one-shot generation from a prompt."""

from __future__ import annotations

import json
import sys

from edgespec.apps.common import (
    add_cache_arguments,
    add_decoding_arguments,
    add_model_arguments,
    load_prompt_caches,
    options_from_args,
    print_notes,
)

HELP = "generate a reply to one prompt and exit"


def add_arguments(p) -> None:
    from edgespec.distributed.launch import add_distributed_arguments

    add_model_arguments(p)
    add_distributed_arguments(p)
    add_decoding_arguments(p)
    add_cache_arguments(p)
    p.add_argument("--prompt", required=True, help="the prompt text ('-' reads stdin)")
    p.add_argument("--raw", action="store_true", help="do not apply the chat template; continue the text as is")
    p.add_argument("--system", default=None, help="system prompt (chat template only)")
    p.add_argument("--stats", choices=["text", "json", "none"], default="text", help="print decoding stats to stderr")


def run(args) -> int:
    from edgespec.apps.common import load_engine

    options = options_from_args(args)
    engine = None
    if args.distributed:  # start the ranks (mlx.launch), or join as one; rank 0 goes on below
        from edgespec.converters.default_model import default_bundle_path

        from edgespec.distributed.launch import join_or_launch

        code, engine = join_or_launch(args, default_bundle=default_bundle_path)
        if engine is None:
            return code
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    engine = engine or load_engine(args)
    system = load_prompt_caches(engine, args)
    if args.raw:
        stream = engine.stream(prompt, options=options)
    else:
        system = args.system if args.system is not None else system
        msgs = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": prompt}
        ]
        stream = engine.stream(messages=msgs, options=options)
    try:
        for chunk in stream:
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
    except KeyboardInterrupt:
        sys.stderr.write("\n[stopped]\n")
    finally:
        stream.close()
    sys.stdout.write("\n")
    stats = engine.last_stats
    print_notes(engine, stats)
    if args.stats == "text":
        sys.stderr.write(stats.summary() + "\n")
    elif args.stats == "json":
        sys.stderr.write(json.dumps(stats.as_dict()) + "\n")
    return 0
