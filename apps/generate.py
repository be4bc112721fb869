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
    from edgespec.distributed.launch import add_distributed_arguments  # deferred: CLI start-up

    add_model_arguments(p)
    add_distributed_arguments(p)
    add_decoding_arguments(p)
    add_cache_arguments(p)
    p.add_argument("--prompt", required=True, help="the prompt text ('-' reads stdin)")
    p.add_argument("--raw", action="store_true", help="do not apply the chat template; continue the text as is")
    p.add_argument("--system", default=None, help="system prompt (chat template only)")
    p.add_argument("--stats", choices=["text", "json", "none"], default="text", help="print decoding stats to stderr")
    f = p.add_argument_group("structured output (one of; the reply is constrained to match, token by token)")
    shape = f.add_mutually_exclusive_group()
    shape.add_argument("--json-schema", metavar="FILE",
                       help="a JSON Schema file (.json): the reply is one JSON value that validates against it")
    shape.add_argument("--json", action="store_true", help="the reply is any one JSON object (no schema)")
    shape.add_argument("--regex", metavar="R", help="a regular expression the whole reply matches, e.g. '[0-9]{3}-[0-9]{4}'")
    shape.add_argument("--grammar", metavar="FILE",
                       help="a context-free grammar file the reply follows: Lark (.lark) or GBNF (.gbnf, "
                            "llama.cpp's format); other extensions: say which with --grammar-syntax")
    f.add_argument("--grammar-syntax", choices=["lark", "gbnf"], default=None,
                   help="the --grammar file's syntax (default: from its extension)")


def response_format_from_args(args) -> dict | None:
    """The response_format the structured-output arguments ask for (None: free text).
    A file that cannot be read or parsed is a ValueError naming the option."""
    from pathlib import Path  # deferred: CLI start-up

    if getattr(args, "json", False):
        return {"type": "json_object"}
    if getattr(args, "regex", None) is not None:
        if not args.regex:
            raise ValueError("--regex is empty")
        return {"type": "regex", "pattern": args.regex}
    if getattr(args, "json_schema", None):
        path = Path(args.json_schema)
        try:
            schema = json.loads(path.read_text(encoding="utf-8"))
        except OSError as e:
            raise ValueError(f"--json-schema {path}: cannot read it ({e.strerror})") from None
        except UnicodeDecodeError as e:
            raise ValueError(f"--json-schema {path}: not UTF-8 text (byte {e.start})") from None
        except RecursionError:
            raise ValueError(f"--json-schema {path}: nested too deeply to read") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"--json-schema {path}: not valid JSON ({e})") from None
        if not isinstance(schema, dict):
            raise ValueError(f"--json-schema {path}: a JSON Schema is an object, got {type(schema).__name__}")
        return {"type": "json_schema", "json_schema": {"name": path.stem or "schema", "schema": schema, "strict": True}}
    if getattr(args, "grammar", None):
        path = Path(args.grammar)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as e:
            raise ValueError(f"--grammar {path}: cannot read it ({e.strerror})") from None
        except UnicodeDecodeError as e:
            raise ValueError(f"--grammar {path}: not UTF-8 text (byte {e.start})") from None
        syntax = args.grammar_syntax or {".lark": "lark", ".gbnf": "gbnf"}.get(path.suffix.lower())
        if syntax is None:
            raise ValueError(f"--grammar {path}: say its syntax with --grammar-syntax lark|gbnf "
                             "(or name it .lark / .gbnf)")
        return {"type": "grammar", "grammar": text, "syntax": syntax}
    if getattr(args, "grammar_syntax", None):
        raise ValueError("--grammar-syntax needs --grammar FILE")
    return None


def _option(args) -> str:
    """The structured-output option given, as typed (for error messages)."""
    for opt, attr in (("--json-schema", "json_schema"), ("--grammar", "grammar"), ("--regex", "regex")):
        v = getattr(args, attr, None)
        if v is not None:
            return f"{opt} {v}"
    return "--json"


def run(args) -> int:
    from edgespec.apps.common import load_engine  # deferred: CLI start-up

    rf = response_format_from_args(args)
    try:  # compiled now (bounded, in a worker process): a bad grammar fails before the model loads
        options = options_from_args(args, **({"response_format": rf} if rf is not None else {}))
    except ValueError as e:
        if rf is None or not str(e).startswith("response_format"):
            raise
        raise ValueError(f"{_option(args)}: {str(e).removeprefix('response_format: ')}") from None
    engine = None
    if args.distributed:  # start the ranks (mlx.launch), or join as one; rank 0 goes on below
        from edgespec.converters.default_model import default_bundle_path  # deferred: CLI start-up

        from edgespec.distributed.launch import join_or_launch  # deferred: CLI start-up

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
    from edgespec.logits.structured import GrammarError  # deferred: CLI start-up

    try:
        for chunk in stream:
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
    except KeyboardInterrupt:
        sys.stderr.write("\n[stopped]\n")
    except GrammarError as e:  # the matcher gave up mid-reply (one of llguidance's per-step limits)
        from edgespec.logits.structured._worker import short  # deferred: CLI start-up

        sys.stdout.write("\n")
        raise ValueError(f"{_option(args)}: the grammar could not be followed further: {short(e)}") from None
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
