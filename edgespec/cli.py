"""The `edgespec` command: one entry point, one subcommand per app.

Each app module exposes HELP, add_arguments(parser) and run(args) -> exit code,
and imports its heavy dependencies inside run().
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys

from edgespec.errors import EdgespecError

SUBCOMMANDS = {
    "chat": "edgespec.apps.chat",
    "generate": "edgespec.apps.generate",
    "convert": "edgespec.apps.convert",
    "serve": "edgespec.apps.serve",
    "bench": "edgespec.apps.bench",
    "distill": "edgespec.apps.distill",
    "cache-prompt": "edgespec.apps.cache_prompt",
    "pull": "edgespec.apps.pull",
    "list": "edgespec.apps.models",
    "rm": "edgespec.apps.rm",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="edgespec",
        description="On-device LLM inference with lossless speculative and lookahead decoding.",
    )
    parser.add_argument("--version", action="version", version=f"edgespec {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module_name in SUBCOMMANDS.items():
        if importlib.util.find_spec(module_name) is None:
            continue
        module = importlib.import_module(module_name)
        p = sub.add_parser(
            name,
            help=module.HELP,
            description=getattr(module, "DESCRIPTION", module.HELP),
            formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        )
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def _version() -> str:
    from edgespec.version import __version__  # deferred: CLI start-up

    return __version__


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    try:
        return int(args._run(args) or 0)
    except (EdgespecError, ValueError, FileExistsError, FileNotFoundError) as e:
        print(f"edgespec {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
