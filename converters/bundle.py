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


@contextmanager
def atomic_folder(out: str | Path, force: bool = False):
    """Yield a temp folder beside `out`; on success it becomes `out`, on any error it is removed.

    Interrupting (Ctrl-C) leaves `out` as it was: either absent or the old bundle.
    """
    out = Path(out)
    if out.exists() and not force:
        raise FileExistsError(f"{out} already exists (pass --force to replace it)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        yield tmp
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
        if p.is_file() and p.name != MANIFEST:
            name = str(p.relative_to(folder))
            if known and name in known:
                files[name] = known[name]
                continue
            if progress:
                progress(name)
            files[name] = file_entry(p)
    manifest = {"format": "edgespec-bundle", "format_version": FORMAT_VERSION, **manifest, "files": files}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=2))
