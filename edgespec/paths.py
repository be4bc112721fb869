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
