"""Write an edgespec bundle atomically: build in a temp folder, then rename into place.

What an existing OUT may be replaced by (and the temp-folder handling) is edgespec.safe_write's
one rule, shared with distill, the Core ML export and the history store.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx

from edgespec.safe_write import (  # noqa: F401  (atomic_folder, clean_stale_temps: this module's API too)
    PID_MARKER,
    atomic_folder,
    check_protected,
    check_replaceable,
    check_writable,
    clean_stale_temps,
)
from edgespec.weights.bundle import FORMAT_VERSION, MANIFEST, file_entry


def check_overlap(src: str | Path, out: str | Path, label: str = "OUT") -> None:
    """Refuse an OUT equal to SRC, containing it or inside it: replacing OUT would destroy the source."""
    src, out = Path(src).expanduser().resolve(), Path(out).expanduser().resolve()
    if out == src or out in src.parents or src in out.parents:
        raise ValueError(
            f"{label} {out} overlaps SRC {src} (equal, containing it or inside it); writing there would "
            f"destroy the source: choose an {label} outside SRC"
        )


def check_destination(src: str | Path, out: str | Path, force: bool, label: str = "OUT") -> None:
    """Refuse, before any work, an OUT that is never replaced (the root, home or working folder),
    overlaps SRC, exists and may not be replaced, or could not be written.

    What may be replaced is edgespec.safe_write's rule: without force nothing; with force only an
    edgespec bundle, a drafter folder or Core ML package edgespec wrote, or an empty folder.
    """
    check_protected(out, label)
    check_overlap(src, out, label)
    check_replaceable(out, force, label)
    check_writable(out, label)


def link_or_copy(src: Path, dst: Path) -> None:
    """Hard-link `src` to `dst` (no copy of big weights; same file system), else copy it."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def write_model_files(
    folder: Path,
    config: dict[str, Any],
    weights: dict[str, mx.array],
    quantization: dict[str, Any] | None,
) -> dict[str, Any]:
    """config.json + model.safetensors into `folder`; returns the manifest's model entry."""
    folder.mkdir(parents=True, exist_ok=True)
    cfg = dict(config)
    if quantization:
        cfg["quantization"] = quantization
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "mlx"})
    return {"config": "config.json", "weights": "model.safetensors", "quantization": quantization or None}


def finish_manifest(
    folder: Path,
    manifest: dict[str, Any],
    progress: Callable[[str], None] | None = None,
    known: dict[str, dict[str, Any]] | None = None,
) -> None:
    """Record every file's size and sha256, then write manifest.json last.

    known: entries already computed for files carried over unchanged (hard links
    of an existing bundle's files); they are reused instead of hashed again.
    """
    files = {}
    for p in sorted(folder.rglob("*")):
        if p.is_file() and p.name not in (MANIFEST, PID_MARKER):
            name = str(p.relative_to(folder))
            if known and name in known:
                files[name] = known[name]
                continue
            if progress:
                progress(name)
            files[name] = file_entry(p)
    manifest = {"format": "edgespec-bundle", "format_version": FORMAT_VERSION, **manifest, "files": files}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=2))
