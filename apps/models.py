"""`edgespec list`: the models stored by hub name (edgespec rm removes one)."""

from __future__ import annotations

import sys
import time

HELP = "list the models stored by hub name: name, format, size on disk, paired drafter, last used"


def add_arguments(p) -> None:
    p.add_argument("--json", action="store_true", help="one JSON object per model instead of a table")


def run(args) -> int:
    import json  # deferred: CLI start-up

    from edgespec.hub.fetch import human  # deferred: CLI start-up
    from edgespec.hub.manage import stored_models  # deferred: CLI start-up

    rows = stored_models()
    if args.json:
        for s in rows:
            print(json.dumps({"name": s.name, "format": s.kind, "size": s.size, "complete": s.complete,
                              "drafter": s.drafter or None, "last_used": s.last_used}))
        return 0
    if not rows:
        print("no models stored by name yet: `edgespec pull ORG/NAME` fetches one", file=sys.stderr)
        return 0
    table = [("NAME", "FORMAT", "SIZE", "DRAFTER", "LAST USED")]
    for s in rows:
        used = time.strftime("%Y-%m-%d %H:%M", time.localtime(s.last_used)) if s.last_used else "never"
        table.append((s.name, s.kind, human(s.size) + ("" if s.complete else " (incomplete)"), s.drafter or "-",
                      used))
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    for r in table:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    return 0
