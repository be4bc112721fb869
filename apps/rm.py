"""`edgespec rm`: remove a model stored by hub name, touching nothing edgespec or the hub cache did not write."""

from __future__ import annotations

import sys

HELP = "remove a model stored by hub name (only the files edgespec and the hub cache stored for it)"


def add_arguments(p) -> None:
    p.add_argument("name", help="the name as `edgespec list` shows it")
    p.add_argument("--yes", "-y", action="store_true", help="remove without asking")


def run(args) -> int:
    from edgespec.hub.fetch import human  # deferred: CLI start-up
    from edgespec.hub.manage import find, plan_removal, remove  # deferred: CLI start-up

    stored = find(args.name)
    if stored is None:
        raise ValueError(f"{args.name} is not stored by name (see `edgespec list`); nothing removed")
    plan = plan_removal(stored)
    what = f"{stored.name}: {len(plan.pointers)} files, {human(plan.size)}"
    if not args.yes:
        if not sys.stdin.isatty():
            raise ValueError(f"remove {what}? add --yes to confirm (no terminal to ask on)")
        answer = input(f"remove {what}? [y/N] ").strip().lower()
        if answer not in ("y", "yes"):
            print("nothing removed", file=sys.stderr)
            return 1
    remove(plan)
    d = stored.record.get("drafter") or {}
    kept = f"; its drafter {d['name']} stays (`edgespec rm {d['name']}`)" if d.get("name") else ""
    print(f"removed {what}{kept}")
    return 0
