"""Drafters paired with hub models by name, from the catalog edgespec/data/hub_drafters.json."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from edgespec.paths import home

CATALOG = Path(__file__).resolve().parent.parent / "data" / "hub_drafters.json"


@dataclass(frozen=True)
class Pairing:
    """`drafter`: 'mtp' (the model's own head, nothing to fetch) or a hub ORG/NAME."""

    family: str
    drafter: str

    @property
    def fetches(self) -> bool:
        return self.drafter != "mtp"


@lru_cache(maxsize=4)
def _rules(path: str = str(CATALOG)) -> list[tuple[str, re.Pattern, str]]:
    data = json.loads(Path(path).read_text())
    if data.get("format") != "edgespec-drafter-pairs":
        raise ValueError(f"{path}: not an edgespec drafter catalog")
    return [(r["family"], re.compile(r["match"], re.IGNORECASE), r["drafter"]) for r in data["pairs"]]


def catalogs() -> list[Path]:
    """The catalogs read, first match wins: $EDGESPEC_HOME/hub_drafters.json (yours, when present),
    then the one shipped with edgespec."""
    own = home() / "hub_drafters.json"
    return ([own] if own.is_file() else []) + [CATALOG]


def paired_drafter(repo_id: str) -> Pairing | None:
    """The catalog's drafter for `repo_id` (ORG/NAME), or None when it pairs none."""
    rules = [r for c in catalogs() for r in _rules(str(c))]
    for family, pattern, template in rules:
        m = pattern.fullmatch(repo_id)
        if m is None:
            continue
        groups = {k: v or "" for k, v in m.groupdict().items()}
        drafter = template.format(**groups)
        if drafter.lower() == repo_id.lower():
            return None
        return Pairing(family, drafter)
    return None


@lru_cache(maxsize=4)
def _eagle3_rules(path: str = str(CATALOG)) -> list[tuple[re.Pattern, tuple[str, ...]]]:
    data = json.loads(Path(path).read_text())
    return [(re.compile(r["match"], re.IGNORECASE), tuple(r["heads"])) for r in data.get("eagle3", [])]


def eagle3_heads(repo_id: str) -> list[str]:
    """The published EAGLE-3 heads the catalogs name for `repo_id` (ORG/NAME), first match per
    catalog, yours first; [] when none. Names only: nothing is fetched."""
    out: list[str] = []
    for c in catalogs():
        for pattern, heads in _eagle3_rules(str(c)):
            if pattern.fullmatch(repo_id):
                out.extend(h for h in heads if h not in out)
                break
    return out
