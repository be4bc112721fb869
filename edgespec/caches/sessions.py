"""Saved caches on disk: a chat session (`/save`, `/load`, `--session`) or a prompt prefilled
once (`edgespec cache-prompt`, `--prompt-cache`).

One file, safetensors: the verifier's per-layer cache parts of a token path of the prefix
cache (edgespec.caches.prefix), with a header naming what they belong to: the model (its
configuration and a fingerprint of its weights), the tokenizer (vocabulary hash), the
cache layout (block size, layer kinds) and the tokens. Loading refuses a file whose model,
tokenizer or layout differ from the engine's, with the difference named: restoring another
model's keys and values would silently change the output.

The header carries a SHA-256 of the tensor data (every tensor's name, shape, dtype and
bytes) and a SHA-256 of itself (every other field: tokens, messages, system text, counts):
a file whose values or header were changed is refused on load, naming the file, and left as
it is. The counts a header gives (blocks, positions, messages) are also bounded by what its
tensors and tokens hold, so even a header forged with a matching checksum cannot make a
load or the next turn run away. Files of format 2 (no header checksum) are refused by
version: save them again.

Writes are atomic (a temp file beside the destination, then a rename): a save killed
midway leaves the previous file whole. A file edgespec did not write is never replaced;
a destination is checked before the work that fills it (check_destination: a writable
folder, a symlink written through to its target), and a save that still fails at the end
can go to a new file beside it or under $EDGESPEC_HOME/sessions (save_somewhere).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
import tempfile
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from edgespec.paths import home
from edgespec.safe_write import (
    check_protected,
    check_writable,
    clean_stale_temps,
    fix_modes,
    temp_prefix,
)

FORMAT = "edgespec-cache"
VERSION = 3  # 2: the header carries the tensor data's checksum; 3: and its own
SUFFIX = ".safetensors"


class SessionFileError(ValueError):
    """A saved cache that cannot be used: not one, damaged, or another model's."""


def model_fingerprint(engine) -> str:
    """The verifier's identity: configuration, dtype and a sample of every weight tensor's values
    (cheap; two checkpoints of one architecture differ in it)."""
    fp = engine.memory.fingerprint
    if fp is not None:
        return fp
    h = hashlib.sha256()
    h.update(json.dumps(engine.model.args.to_dict(), sort_keys=True, default=str).encode())
    for name, p in sorted(tree_flatten(engine.model.parameters()), key=lambda kv: kv[0]):
        flat = p.reshape(-1)
        h.update(f"{name}:{p.shape}:{p.dtype}".encode())
        h.update(np.array(flat[:16].astype(mx.float32)).tobytes())
        h.update(np.array(flat[-16:].astype(mx.float32)).tobytes())
    fp = engine.memory.fingerprint = h.hexdigest()[:24]
    return fp


def identity(engine) -> dict[str, Any]:
    pc = engine.prefix_cache
    return {"model": model_fingerprint(engine), "tokenizer": engine.tokenizer.vocab_hash(), "block": pc.block,
            "kv": engine.kv_settings()}


def header_checksum(info: dict[str, Any]) -> str:
    """SHA-256 of a header's fields (all but "header", the field that holds it), canonical JSON."""
    rest = {k: v for k, v in info.items() if k != "header"}
    return hashlib.sha256(json.dumps(rest, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


_TENSOR = re.compile(r"^b(\d{1,9})\.l(\d{1,6})\.(\d{1,3})$")


def _bounds_problem(info: dict[str, Any], tensors: list[str]) -> str | None:
    """Why the header's counts cannot be what the file holds, or None."""
    blocks, positions, tokens, kinds = info.get("blocks"), info.get("positions"), info.get("tokens"), info.get("kinds")
    extra = info.get("extra")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and 0 <= t < 1 << 31 for t in tokens):
        return "its tokens are not a list of token ids"
    if not isinstance(kinds, list) or not isinstance(extra, dict):
        return "its layer kinds or extra fields are malformed"
    if not isinstance(blocks, int) or not 0 <= blocks <= len(tensors):
        return f"it claims {blocks!r} blocks and holds {len(tensors)} tensors"
    if not isinstance(positions, int) or not 0 <= positions <= len(tokens):
        return f"it claims {positions!r} cached positions of {len(tokens)} tokens"
    if isinstance(info.get("block"), int) and positions > blocks * info["block"]:
        return f"it claims {positions} cached positions in {blocks} blocks of {info['block']}"
    for name in tensors:
        m = _TENSOR.match(name)
        if m is None or int(m.group(1)) >= blocks or int(m.group(2)) >= len(kinds):
            return f"it holds a tensor {name[:40]!r} outside its {blocks} blocks and {len(kinds)} layers"
    messages = extra.get("messages")
    if messages is not None and (not isinstance(messages, list) or len(messages) > len(tokens)):
        return (f"it lists {len(messages)} messages in {len(tokens)} tokens" if isinstance(messages, list)
                else "its messages are not a list")
    return None


def read_header(path: str | Path, verify: bool = True) -> dict[str, Any]:
    """The file's edgespec header; SessionFileError when it is not a whole edgespec cache file, or
    (`verify`) when the header does not match its own checksum or claims more than the file holds."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise SessionFileError(f"{path} is not an edgespec saved cache (empty or truncated)")
            (n,) = struct.unpack("<Q", raw)
            if n > min(size - 8, 64 << 20):
                raise SessionFileError(f"{path} is not an edgespec saved cache (no safetensors header)")
            head = json.loads(f.read(n))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        if isinstance(e, FileNotFoundError):
            raise SessionFileError(f"{path} does not exist") from None
        if isinstance(e, OSError):
            raise SessionFileError(f"cannot read {path}: {e.strerror or e}") from None
        raise SessionFileError(f"{path} is not an edgespec saved cache (unreadable header)") from None
    meta = head.get("__metadata__") if isinstance(head, dict) else None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise SessionFileError(f"{path} is not an edgespec saved cache")
    try:
        end = max((max(int(o) for o in t["data_offsets"]) for k, t in head.items() if k != "__metadata__"),
                  default=0)
    except (KeyError, TypeError, ValueError):
        raise SessionFileError(f"{path} is damaged (its tensor table does not read)") from None
    if 8 + n + end != size:
        raise SessionFileError(f"{path} is damaged (its tensors need {8 + n + end} bytes, the file has {size}): "
                               "it was cut short; save it again")
    try:
        info = json.loads(meta["info"])
    except (KeyError, TypeError, json.JSONDecodeError):
        raise SessionFileError(f"{path} is damaged (its edgespec header does not read)") from None
    if not isinstance(info, dict):
        raise SessionFileError(f"{path} is damaged (its edgespec header does not read)")
    if info.get("version") != VERSION:
        raise SessionFileError(f"{path} was written by another edgespec version (format {info.get('version')}, "
                               f"this one reads {VERSION}); save it again with this one")
    if verify:
        if info.get("header") != header_checksum(info):
            raise SessionFileError(f"{path} is damaged: its header does not match the checksum it was saved with "
                                   "(changed on disk since); it is left as it is: save it again")
        problem = _bounds_problem(info, [k for k in head if k != "__metadata__"])
        if problem is not None:
            raise SessionFileError(f"{path} is damaged: {problem}; it is left as it is: save it again")
    return info


def is_cache_file(path: str | Path) -> bool:
    """A file edgespec saved (damaged or not: saving again may replace it)."""
    try:
        read_header(path, verify=False)
        return True
    except SessionFileError:
        return False


def data_checksum(arrays: dict[str, mx.array]) -> str:
    """SHA-256 of the tensors (name, shape, dtype and bytes, in name order)."""
    h = hashlib.sha256()
    for name in sorted(arrays):
        a = arrays[name]
        h.update(f"{name}:{tuple(a.shape)}:{a.dtype}|".encode())
        h.update(memoryview(np.array(a.reshape(-1).view(mx.uint8))))
    return h.hexdigest()


def check_destination(path: str | Path) -> Path:
    """The file a save will write (a symlink's target: written through), checked now, before
    the work that fills it: ValueError/WriteError unless it is absent or a cache file
    edgespec wrote, in a folder this process can write."""
    path = Path(path).expanduser()
    if path.is_symlink():  # write through the link: the file it names is the destination
        path = Path(os.path.realpath(path))
    check_protected(path, "FILE")
    if path.exists() and not path.is_file():
        raise ValueError(f"{path} is not a file; refusing to replace it: choose another file")
    if path.exists() and not is_cache_file(path):
        raise ValueError(f"{path} exists and is not a cache edgespec saved; refusing to replace it: "
                         "choose another file or remove it yourself")
    check_writable(path, "FILE")
    return path


def check_destination_path(path: str | Path) -> Path:
    """The file a save to `path` writes (a symlink's target), unchecked."""
    path = Path(path).expanduser()
    return Path(os.path.realpath(path)) if path.is_symlink() else path


def save_somewhere(engine, path: str | Path, tokens: list[int], extra: dict | None = None) -> tuple[Path, int]:
    """save() to `path`, or when that fails (the folder became read-only, the disk is full,
    the file was replaced by a foreign one), to a new file beside it, else under
    $EDGESPEC_HOME/sessions: (where it went, positions saved). Raises only when all fail."""
    path = check_destination_path(path)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    stem = path.name[: -len(SUFFIX)] if path.name.endswith(SUFFIX) else path.name
    tries = [path, path.with_name(f"{stem}-{stamp}{SUFFIX}"), home() / "sessions" / f"{stem}-{stamp}{SUFFIX}"]
    first: Exception | None = None
    for i, p in enumerate(tries):
        if i and os.path.lexists(p):
            continue
        try:
            return p, save(engine, p, tokens, extra)
        except (OSError, ValueError) as e:
            first = first or e
    assert first is not None
    raise first


def save(engine, path: str | Path, tokens: list[int], extra: dict | None = None) -> int:
    """Write the cached path along `tokens` (what the prefix cache holds of it) and `extra`
    (JSON: a chat's messages, the prompt text) to `path`; returns the positions saved."""
    path = check_destination(path)
    positions, nodes, kinds = engine.prefix_cache.export_prefix(list(tokens))
    arrays: dict[str, mx.array] = {}
    for i, parts in enumerate(nodes):
        for j, layer in enumerate(parts):
            if layer is None:
                continue
            for k, a in enumerate(layer):
                arrays[f"b{i}.l{j}.{k}"] = a
    info = {"version": VERSION, **identity(engine), "kinds": kinds, "blocks": len(nodes),
            "positions": positions, "tokens": [int(t) for t in tokens], "extra": extra or {},
            "checksum": data_checksum(arrays)}
    info["header"] = header_checksum(info)
    path.parent.mkdir(parents=True, exist_ok=True)
    clean_stale_temps(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f"{temp_prefix(path)}{os.getpid()}-", suffix=SUFFIX)
    os.close(fd)
    try:
        mx.save_safetensors(tmp, arrays, metadata={"format": FORMAT, "info": json.dumps(info)})
        fix_modes(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return positions


def load(engine, path: str | Path, pin: bool = False) -> tuple[list[int], dict, int]:
    """Put a saved cache into the engine's prefix cache: (its tokens, its extra, positions now
    cached). SessionFileError, naming the difference, when it is not this model's."""
    path = Path(path).expanduser()
    info = read_header(path)
    mine = identity(engine)
    for key, what in (("model", "model (weights or configuration)"), ("tokenizer", "tokenizer"),
                      ("block", "prefix cache block size"), ("kv", "KV cache settings")):
        if info.get(key) != mine[key]:
            raise SessionFileError(f"{path} was saved with another {what} ({info.get(key)!r}, this engine has "
                                   f"{mine[key]!r}); it cannot be used here")
    try:
        arrays = mx.load(str(path), format="safetensors")
        # read now, on this thread: a lazy load evaluated later on the batch worker's thread
        # would run on a stream that thread does not have
        mx.eval(list(arrays.values()))
    except Exception as e:
        raise SessionFileError(f"{path} is damaged ({e})") from None
    if info.get("checksum") != data_checksum(arrays):
        raise SessionFileError(f"{path} is damaged: its cached keys and values do not match the checksum it was "
                               "saved with (changed on disk since); it is left as it is: save the session again")
    kinds = info["kinds"]
    nodes = []
    try:
        for i in range(int(info["blocks"])):
            parts = []
            for j in range(len(kinds)):
                layer = []
                k = 0
                while f"b{i}.l{j}.{k}" in arrays:
                    layer.append(arrays[f"b{i}.l{j}.{k}"])
                    k += 1
                parts.append(tuple(layer) if layer else None)
            nodes.append(parts)
        tokens = [int(t) for t in info["tokens"]]
    except (KeyError, TypeError, ValueError) as e:
        raise SessionFileError(f"{path} is damaged ({e})") from None
    if engine.prefix_cache.enabled:
        positions = engine.prefix_cache.import_prefix(tokens, nodes, kinds, pin=pin)
    else:
        positions = 0
    return tokens, info.get("extra") or {}, positions
