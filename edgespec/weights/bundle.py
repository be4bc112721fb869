"""The bundle on disk: the one contract between converters and runtime.

    OUT/manifest.json          format version, source, vocab hash, files + sha256
    OUT/config.json            HF-style model config (+ "quantization")
    OUT/model.safetensors      MLX weights of the verifier
    OUT/tokenizer.json, tokenizer_config.json
    OUT/drafter/               optional drafter (same layout), drafter.mlpackage

`read_manifest` validates everything before any weight is touched. Hashing the weights
costs ~0.4 s per 500 MB, on every fresh process; so once a file's hash has been checked, its
identity on disk (size, mtime, ctime, inode, device: any write changes the ctime, which no
user call can set back) is recorded under $EDGESPEC_HOME/verified/, and while it is
unchanged the file is not hashed again. Sizes are always checked. As git does for "racily
clean" files, a file changed within RACY_S of its hashing is not recorded (file times are
coarser than the writes that could follow).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from edgespec.errors import ModelLoadError
from edgespec.paths import home
from edgespec.safe_write import clean_stale_temps, temp_prefix

MANIFEST = "manifest.json"
FORMAT_VERSION = 1


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


VERIFIED_FORMAT = "edgespec-verified-1"
RACY_S = 2.0


def _identity(st: os.stat_result) -> list[int]:
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]


def verified_record_path(folder: Path) -> Path:
    key = hashlib.sha256(str(folder.resolve()).encode()).hexdigest()[:20]
    return home() / "verified" / f"{key}.json"


def _read_verified(path: Path, folder: str) -> dict[str, list]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("format") != VERIFIED_FORMAT or data.get("folder") != str(folder):
        return {}
    files = data.get("files")
    return files if isinstance(files, dict) else {}


def _write_verified(path: Path, folder: str, files: dict[str, list]) -> None:
    """Best effort, atomic; never over a file that is not such a record (then nothing is written)."""
    tmp = None
    try:
        if os.path.lexists(path):
            try:
                ours = json.loads(path.read_text(encoding="utf-8")).get("format") == VERIFIED_FORMAT
            except (OSError, ValueError, AttributeError):
                ours = False
            if not ours:
                return
        path.parent.mkdir(parents=True, exist_ok=True)
        clean_stale_temps(path)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f"{temp_prefix(path)}{os.getpid()}-")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump({"format": VERIFIED_FORMAT, "folder": str(folder), "files": files}, f)
        os.replace(tmp, path)
        tmp = None
    except OSError:
        pass
    finally:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)


def file_entry(path: Path) -> dict[str, Any]:
    return {"size": path.stat().st_size, "sha256": sha256_file(path)}


def is_bundle(path: Path) -> bool:
    return path.is_dir() and (path / MANIFEST).is_file()


def unverified_note(path: str | Path | None) -> str | None:
    """The one-line note for a model folder loaded without a manifest (None otherwise).

    Such a folder is loaded, not refused: without manifest.json a bundle is exactly a
    Hugging Face folder (config.json, model.safetensors, tokenizer files), which edgespec
    loads directly; what is lost is the check of every file against its recorded size and
    SHA-256, and the user is told so."""
    if path is None:
        return None
    p = Path(path).expanduser()
    if not p.is_dir() or is_bundle(p) or not (p / "config.json").is_file():
        return None
    return (f"{p} has no {MANIFEST}: loaded as a Hugging Face folder, its files not verified against "
            "checksums (`edgespec convert` makes a verified bundle)")


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
    record_path = verified_record_path(folder) if verify_hashes else None
    record = _read_verified(record_path, str(folder.resolve())) if record_path else {}
    fresh = {}
    for name, entry in manifest.get("files", {}).items():
        p = folder / name
        if not p.is_file():
            raise ModelLoadError(f"{folder}: bundle file {name} is missing")
        st = p.stat()
        if st.st_size != entry["size"]:
            raise ModelLoadError(
                f"{p}: size {st.st_size} differs from the manifest's {entry['size']} (truncated or modified)"
            )
        if not verify_hashes:
            continue
        seen = _identity(st) + [entry["sha256"]]
        if record.get(name) == seen:  # hashed before, and not written to since
            fresh[name] = seen
            continue
        if sha256_file(p) != entry["sha256"]:
            raise ModelLoadError(f"{p}: checksum differs from the manifest (corrupt or modified)")
        if time.time_ns() - max(st.st_ctime_ns, st.st_mtime_ns) > RACY_S * 1e9:
            fresh[name] = seen
    if record_path is not None and fresh and fresh != record:
        _write_verified(record_path, str(folder.resolve()), fresh)
    return manifest
