"""Model names on the Hugging Face hub: ORG/NAME[@REVISION][:QUANT], told apart from local paths."""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path

# A model argument (a hub name or a path) longer than this, or with a path part longer than a file
# name can be, is refused before it touches the file system (which would answer ENAMETOOLONG).
MAX_SPEC = 4096  # PATH_MAX
MAX_PART = 255
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


class BadNameError(ValueError):
    """A model name or path that no file system or hub could hold: too long, or a control character."""

# ORG and NAME as the hub allows them (letters, digits, '-', '_', '.'; no leading '.' or '-');
# a revision is a branch, tag or commit (no ':' so a quant tag can follow it); a quant is a tag
# (Q4_K_M) or a GGUF file's name without .gguf.
_NAME = re.compile(
    r"^(?P<org>[A-Za-z0-9][A-Za-z0-9_.-]{0,95})/(?P<name>[A-Za-z0-9][A-Za-z0-9_.-]{0,95})"
    r"(?:@(?P<rev>[A-Za-z0-9][A-Za-z0-9_./-]{0,199}))?(?::(?P<quant>[A-Za-z0-9][A-Za-z0-9_.-]{0,99}))?$"
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
        key = str(self).replace("/", "--")
        if len(key) > 200:  # a file name has at most 255 bytes: a long one ends in a digest of the whole
            key = key[:150] + "~" + hashlib.sha256(key.encode()).hexdigest()[:20]
        return key


def parse(text: str) -> HubName | None:
    """HubName when `text` has the shape ORG/NAME[@REVISION][:QUANT], else None."""
    m = _NAME.match(str(text))
    if m is None or ".." in m.group("org") + m.group("name"):
        return None
    return HubName(f"{m.group('org')}/{m.group('name')}", m.group("rev"), m.group("quant"))


def check_spec(spec, what: str = "model") -> str:
    """`spec` (a hub name or a local path) as text, checked before it touches the file system or the
    hub: BadNameError, one line, when it is too long or holds a control character."""
    text = os.fspath(spec) if isinstance(spec, Path) else spec
    if not isinstance(text, str):
        raise BadNameError(f"{what} must be a hub name or a path, got {type(spec).__name__}")
    shown = repr(text[:40]) + ("..." if len(text) > 40 else "")
    if len(text) > MAX_SPEC:
        raise BadNameError(f"{what} name {shown} is {len(text)} characters long; a hub name or path has at most "
                           f"{MAX_SPEC}")
    long_part = next((p for p in text.split("/") if len(p.encode("utf-8", "surrogatepass")) > MAX_PART), None)
    if long_part is not None:
        raise BadNameError(f"{what} name {shown} has a part of {len(long_part)} characters; a file or folder name "
                           f"has at most {MAX_PART} bytes")
    if _CONTROL.search(text):
        raise BadNameError(f"{what} name {shown} holds a control character; a hub name or path cannot")
    return text


def _local_looking(text: str) -> bool:
    """A path by its look: starts with '.', '/' or '~', exists, or its first folder exists here."""
    if text.startswith((".", "/", "~")):
        return True
    try:
        return Path(text).expanduser().exists() or ("/" in text and Path(text.split("/", 1)[0]).is_dir())
    except (OSError, ValueError):
        return True


def as_hub_name(spec, what: str = "model") -> HubName | None:
    """The hub name `spec` stands for, or None when it is a local path: a path that exists wins, and
    anything starting with '.', '/' or '~', or whose first folder exists here, is a path (a mistyped
    path is an error about the path, never a hub request). BadNameError for a name no file system
    could hold (check_spec)."""
    if spec is None or not isinstance(spec, (str, Path)):
        return None
    text = check_spec(spec, what)
    if _local_looking(text):
        return None
    return parse(text)


def local_path_error(spec) -> str | None:
    """For a path that looks local (as_hub_name) but is not there: one line saying so; else None."""
    if spec is None or not isinstance(spec, (str, Path)):
        return None
    text = check_spec(spec)
    if not _local_looking(text):
        return None
    try:
        if Path(text).expanduser().exists():
            return None
    except (OSError, ValueError):
        pass
    return f"{text}: no such file or folder (a path, not a hub name: it starts with '.', '/' or '~', or its " \
           "first folder exists here)"
