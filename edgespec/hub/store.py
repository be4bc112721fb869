"""Where hub models live on disk: the hub's own cache (shared with transformers and mlx-lm) for the
files, and edgespec's records ($EDGESPEC_HOME/hub/*.json) of what each name resolved to."""

from __future__ import annotations

import json
import os
import re
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edgespec.hub.names import HubName, parse
from edgespec.paths import home

RECORD_FORMAT = "edgespec-hub-record"
_COMMIT = re.compile(r"^[0-9a-f]{40}$")


@dataclass(frozen=True)
class HubSettings:
    """Read from the environment at each call (not at import), as the hub client documents them."""

    cache_dir: Path
    endpoint: str | None
    offline: bool


def settings() -> HubSettings:
    env = os.environ
    if env.get("HF_HUB_CACHE"):
        cache = Path(env["HF_HUB_CACHE"])
    else:
        base = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache"),
                                                   "huggingface")
        cache = Path(base) / "hub"
    offline = (env.get("HF_HUB_OFFLINE") or env.get("TRANSFORMERS_OFFLINE") or "").strip().lower() in (
        "1", "true", "yes", "on")
    return HubSettings(cache.expanduser(), (env.get("HF_ENDPOINT") or "").rstrip("/") or None, offline)


def repo_folder(repo_id: str, cache_dir: Path | None = None) -> Path:
    """The hub cache's folder of a model repository (models--ORG--NAME)."""
    return (cache_dir or settings().cache_dir) / ("models--" + repo_id.replace("/", "--"))


def cached_commit(repo_id: str, revision: str | None, cache_dir: Path | None = None) -> str | None:
    """The commit `revision` (None = main) pointed to when last fetched, read from the cache only."""
    rev = revision or "main"
    if _COMMIT.match(rev):
        return rev
    ref = repo_folder(repo_id, cache_dir) / "refs" / rev
    try:
        commit = ref.read_text().strip()
    except OSError:
        return None
    return commit if _COMMIT.match(commit) else None


def snapshot(repo_id: str, commit: str, cache_dir: Path | None = None) -> Path:
    return repo_folder(repo_id, cache_dir) / "snapshots" / commit


def is_commit(commit) -> bool:
    """40 lower-case hex digits: the only commit edgespec puts into a path."""
    return isinstance(commit, str) and _COMMIT.fullmatch(commit) is not None


def is_repo_path(path) -> bool:
    """A file path inside a repository as the hub names them: relative, '/'-separated, no '.', '..' or
    empty parts, no backslash or control character."""
    if not isinstance(path, str) or not path or len(path) > 4096 or path.startswith("/"):
        return False
    if "\\" in path or any(ord(c) < 32 or ord(c) == 127 for c in path):
        return False
    return all(part not in ("", ".", "..") and len(part.encode("utf-8", "surrogatepass")) <= 255
               for part in path.split("/"))


def inside(path: Path, folder: Path) -> bool:
    """`path`, every link followed, lies inside `folder` (links followed too)."""
    try:
        real, root = Path(os.path.realpath(path)), Path(os.path.realpath(folder))
    except (OSError, ValueError):
        return False
    return real == root or root in real.parents


def check_files(repo_id: str, commit, files, cache_dir: Path | None = None) -> str | None:
    """Why the snapshot files `files` of `commit` cannot be used (a commit that is not 40 hex
    digits, a path that leaves the snapshot, a link that leads out of the repository's cache folder),
    or None when every one stays inside. Checked before anything is read or deleted."""
    if not is_commit(commit):
        return f"its commit {str(commit)[:60]!r} is not 40 hex digits"
    if not isinstance(files, list):
        return "its file list is not a list"
    repo = repo_folder(repo_id, cache_dir)
    folder = repo / "snapshots" / commit
    if os.path.lexists(folder) and not inside(folder, repo):
        return f"its snapshot folder {folder} leads outside {repo}"
    for f in files:
        if not is_repo_path(f):
            return f"it names a file outside its snapshot ({str(f)[:80]!r})"
        p = folder / f
        if os.path.lexists(p.parent) and not inside(p.parent, folder):
            return f"{f} lies in a folder that leads outside its snapshot ({os.path.realpath(p.parent)})"
        if os.path.lexists(p) and not inside(p, repo):
            return f"{f} in its snapshot leads outside {repo} (to {os.path.realpath(p)})"
    return None


def check_record(record: dict[str, Any], cache_dir: Path | None = None) -> str | None:
    """Why a record cannot be trusted (check_files, or fields of the wrong shape), or None."""
    repo_id, name = record.get("repo_id"), record.get("name")
    if not isinstance(repo_id, str) or parse(repo_id) is None or parse(repo_id).repo_id != repo_id:
        return f"its repository {str(repo_id)[:80]!r} is not ORG/NAME"
    if name is not None and (not isinstance(name, str) or parse(name) is None):
        return f"its name {str(name)[:80]!r} is not a hub name"
    return check_files(repo_id, record.get("commit"), record.get("files") or [], cache_dir)


def local_files(folder: Path) -> list[str]:
    """Relative paths of the complete files in a snapshot folder (links to blobs that exist)."""
    if not folder.is_dir():
        return []
    out = []
    repo = folder.parent.parent
    for p in folder.rglob("*"):
        if p.is_file() and inside(p, repo):  # follows the link: a pointer whose blob is gone is not a file
            out.append(p.relative_to(folder).as_posix())
    return sorted(out)


def records_dir() -> Path:
    return home() / "hub"


def record_path(name: HubName) -> Path:
    return records_dir() / f"{name.key}.json"


def read_record(name: HubName) -> dict[str, Any] | None:
    return _read(record_path(name))


def _read(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("format") != RECORD_FORMAT:
        return None
    return data


def all_records() -> list[tuple[Path, dict[str, Any]]]:
    """Every record edgespec wrote (files of another shape in the folder are left alone)."""
    folder = records_dir()
    if not folder.is_dir():
        return []
    out = []
    for p in sorted(folder.glob("*.json")):
        data = _read(p)
        if data is not None:
            out.append((p, data))
    return out


def write_record(name: HubName, data: dict[str, Any]) -> Path:
    """Atomically (temp file + rename): a record is either the old one or the new one, whole."""
    path = record_path(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"format": RECORD_FORMAT, **data}
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def touch_last_used(name: HubName, record: dict[str, Any]) -> None:
    """Note when a name was last run; a read-only home only loses the note."""
    try:
        write_record(name, {**record, "last_used": time.time()})
    except OSError:
        pass


def files_size(folder: Path, files: list[str]) -> int:
    total = 0
    for f in files:
        try:
            total += (folder / f).stat().st_size
        except OSError:
            pass
    return total
