"""Write an edgespec bundle atomically: build in a temp folder, then rename into place."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import mlx.core as mx

from edgespec.bundle import FORMAT_VERSION, MANIFEST, file_entry

PID_MARKER = ".edgespec-writer-pid"


def check_destination(src: str | Path, out: str | Path, force: bool) -> None:
    """Refuse, before any work, an OUT that exists (without force) or overlaps SRC.

    Replacing OUT deletes it, so OUT equal to SRC, containing it or inside it would
    destroy the checkpoint being converted.
    """
    src, out = Path(src).expanduser().resolve(), Path(out).expanduser().resolve()
    if out == src or out in src.parents or src in out.parents:
        raise ValueError(
            f"OUT {out} overlaps SRC {src} (equal, containing it or inside it); writing there would "
            "destroy the source: choose an OUT outside SRC"
        )
    if out.exists() and not force:
        raise FileExistsError(f"{out} already exists (pass --force to replace it)")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process: alive
    return True


def clean_stale_temps(out: Path) -> list[Path]:
    """Remove temp folders of earlier writes of `out` whose writer is gone (killed, crashed).

    A temp folder carries its writer's pid; one whose writer still runs is left alone,
    and so is one without a marker that is younger than an hour (a writer from before
    markers, or one just starting).
    """
    import time

    removed = []
    if not out.parent.is_dir():
        return removed
    for d in out.parent.glob(f".{out.name}.tmp-*"):
        if not d.is_dir():
            continue
        marker = d / PID_MARKER
        try:
            pid = int(marker.read_text().strip())
            stale = not _alive(pid)
        except (OSError, ValueError):
            stale = time.time() - d.stat().st_mtime > 3600
        if stale:
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d)
    return removed


@contextmanager
def atomic_folder(out: str | Path, force: bool = False):
    """Yield a temp folder beside `out`; on success it becomes `out`, on any error it is removed.

    Interrupting (Ctrl-C) leaves `out` as it was: either absent or the old bundle. A run
    killed outright (SIGKILL) leaves its temp folder; the next write of `out` removes it.
    """
    out = Path(out)
    if out.exists() and not force:
        raise FileExistsError(f"{out} already exists (pass --force to replace it)")
    out.parent.mkdir(parents=True, exist_ok=True)
    clean_stale_temps(out)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    (tmp / PID_MARKER).write_text(str(os.getpid()))
    try:
        yield tmp
        (tmp / PID_MARKER).unlink(missing_ok=True)
        if out.exists():
            trash = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            os.replace(out, trash / out.name)
            os.replace(tmp, out)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


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
