"""Model names on the Hugging Face hub: ORG/NAME[@REVISION][:QUANT], told apart from local paths."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

# ORG and NAME as the hub allows them (letters, digits, '-', '_', '.'; no leading '.' or '-');
# a revision is a branch, tag or commit (no ':' so a quant tag can follow it).
_NAME = re.compile(
    r"^(?P<org>[A-Za-z0-9][A-Za-z0-9_.-]{0,95})/(?P<name>[A-Za-z0-9][A-Za-z0-9_.-]{0,95})"
    r"(?:@(?P<rev>[A-Za-z0-9][A-Za-z0-9_./-]{0,199}))?(?::(?P<quant>[A-Za-z0-9][A-Za-z0-9_.-]{0,39}))?$"
)


@dataclass(frozen=True)
class HubName:
    """A parsed name. `revision` None = the default branch; `quant` None = no tag given."""

    repo_id: str
    revision: str | None = None
    quant: str | None = None

    def __str__(self) -> str:
        return self.repo_id + (f"@{self.revision}" if self.revision else "") + (f":{self.quant}" if self.quant else "")

    @property
    def key(self) -> str:
        """File-name-safe key of this name in edgespec's records (ORG--NAME[@REV][:QUANT])."""
        return str(self).replace("/", "--")


def parse(text: str) -> HubName | None:
    """HubName when `text` has the shape ORG/NAME[@REVISION][:QUANT], else None."""
    m = _NAME.match(str(text))
    if m is None or ".." in m.group("org") + m.group("name"):
        return None
    return HubName(f"{m.group('org')}/{m.group('name')}", m.group("rev"), m.group("quant"))


def as_hub_name(spec) -> HubName | None:
    """The hub name `spec` stands for, or None when it is a local path (a path that exists wins,
    and anything starting with '.', '/' or '~' is a path)."""
    if spec is None or not isinstance(spec, (str, Path)):
        return None
    text = str(spec)
    if text.startswith((".", "/", "~")) or Path(text).expanduser().exists():
        return None
    return parse(text)
