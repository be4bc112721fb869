"""The `edgespec` command: one entry point, one subcommand per app.

Each app module exposes HELP, add_arguments(parser) and run(args) -> exit code,
and imports its heavy dependencies inside run(). main() adds the arguments of the
subcommand it runs only, so `edgespec --help` and a mistyped command cost no app's
argument set-up. A help text that costs something to build (the modes' options, which
load the mode registry and with it mlx) is given as a callable and built only when help
is printed (`HelpFormatter`), so a usage error in a subcommand's arguments loads no mlx.
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
    "doctor": "edgespec.apps.doctor",
}


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults shown; an argument whose help is a callable gets its text built when help is
    printed, not when the parser is set up."""

    def _format_action(self, action):
        self._build(action)
        return super()._format_action(action)

    def _get_help_string(self, action):  # (argparse versions that check help when it is added)
        self._build(action)
        return super()._get_help_string(action)

    @staticmethod
    def _build(action) -> None:
        if callable(action.help):
            action.help = action.help()


def build_parser(command: str | None = None, *, all_arguments: bool = True) -> argparse.ArgumentParser:
    """The `edgespec` parser: every subcommand with its arguments; with all_arguments=False
    only `command`'s arguments are added (the others are listed, with their help line)."""
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
            formatter_class=HelpFormatter,
        )
        if all_arguments or name == command:
            module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def _version() -> str:
    from edgespec.version import __version__  # deferred: CLI start-up

    return __version__


def _command(argv: list[str]) -> str | None:
    """The subcommand argv names: its first word that is not an option (the top-level
    options, --help and --version, take no value)."""
    return next((a for a in argv if not a.startswith("-")), None)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(_command(argv), all_arguments=False)
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
