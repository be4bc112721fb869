"""Where edgespec keeps what it writes for a user: one folder (models, verified records, learnt
costs, history, native kernels), below every module that writes there."""

from __future__ import annotations

import os
from pathlib import Path


def home() -> Path:
    """Per-user cache folder: $EDGESPEC_HOME, else $XDG_CACHE_HOME/edgespec, else ~/.cache/edgespec."""
    env = os.environ.get("EDGESPEC_HOME")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "edgespec"


def held(path: Path, timeout: float = 3600.0):
    """An inter-process lock beside `path` (`path` + ".lock", in edgespec's folder): one process
    at a time writes a shared file or folder that is made once (the default model's download
    and its converted bundle); another process that wanted it waits, then finds it made.
    A context manager (filelock; released when the process dies)."""
    from filelock import FileLock

    path.parent.mkdir(parents=True, exist_ok=True)
    return FileLock(str(path) + ".lock", timeout=timeout)
