"""The bundle on disk: the one contract between converters and runtime.

    OUT/manifest.json          format version, source, vocab hash, files + sha256
    OUT/config.json            HF-style model config (+ "quantization")
    OUT/model.safetensors      MLX weights of the verifier
    OUT/tokenizer.json, tokenizer_config.json
    OUT/drafter/               optional drafter (same layout), drafter.mlpackage

`read_manifest` validates everything before any weight is touched.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from edgespec.errors import ModelLoadError

MANIFEST = "manifest.json"
FORMAT_VERSION = 1


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def file_entry(path: Path) -> dict[str, Any]:
    return {"size": path.stat().st_size, "sha256": sha256_file(path)}


def is_bundle(path: Path) -> bool:
    return path.is_dir() and (path / MANIFEST).is_file()


def _check_manifest_shape(path: Path, manifest) -> None:
    """The fields `read_manifest` relies on, with the types it relies on (a clear error, not a traceback)."""
    def bad(what: str):
        raise ModelLoadError(f"{path}: malformed manifest: {what}; re-run `edgespec convert`")

    if not isinstance(manifest, dict):
        bad(f"expected a JSON object, got {type(manifest).__name__}")
    files = manifest.get("files", {})
    if not isinstance(files, dict):
        bad('"files" must be an object of file name -> {"size", "sha256"}')
    for name, entry in files.items():
        parts = Path(name).parts
        if not name or Path(name).is_absolute() or ".." in parts:
            bad(f"file name {name!r} must be a relative path inside the bundle")
        if not isinstance(entry, dict):
            bad(f'"files"[{name!r}] must be an object with "size" and "sha256"')
        size, digest = entry.get("size"), entry.get("sha256")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            bad(f'"files"[{name!r}].size must be a non-negative integer, got {size!r}')
        if not isinstance(digest, str):
            bad(f'"files"[{name!r}].sha256 must be a string, got {digest!r}')


def read_manifest(folder: str | Path, verify_hashes: bool = True) -> dict[str, Any]:
    folder = Path(folder)
    path = folder / MANIFEST
    if not path.is_file():
        raise ModelLoadError(f"{folder}: no {MANIFEST} (not an edgespec bundle; run `edgespec convert`)")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{path}: invalid JSON ({e}); re-run `edgespec convert`") from None
    _check_manifest_shape(path, manifest)
    if manifest.get("format") != "edgespec-bundle":
        raise ModelLoadError(f"{path}: not an edgespec bundle manifest")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ModelLoadError(
            f"{path}: bundle format {manifest.get('format_version')} is not supported by this "
            f"edgespec (expects {FORMAT_VERSION}); re-run `edgespec convert`"
        )
    for name, entry in manifest.get("files", {}).items():
        p = folder / name
        if not p.is_file():
            raise ModelLoadError(f"{folder}: bundle file {name} is missing")
        size = p.stat().st_size
        if size != entry["size"]:
            raise ModelLoadError(
                f"{p}: size {size} differs from the manifest's {entry['size']} (truncated or modified)"
            )
        if verify_hashes and sha256_file(p) != entry["sha256"]:
            raise ModelLoadError(f"{p}: checksum differs from the manifest (corrupt or modified)")
    return manifest
