"""What edgespec stored by hub name: listed (name, format, size on disk, drafter, last used) and
removed, touching only the files edgespec's record names and the hub cache wrote for them."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edgespec.hub import store
from edgespec.hub.names import HubName, parse


@dataclass
class Stored:
    name: str
    kind: str
    size: int  # bytes on disk of the files the name uses
    complete: bool  # every file the record names is in the cache
    drafter: str  # "mtp", "shipped", a hub name, or "" (none paired)
    last_used: float | None
    record: dict[str, Any]
    problem: str | None = None  # why the record cannot be trusted (store.check_record): nothing of it is used
    record_file: Path | None = None  # the record's own file under $EDGESPEC_HOME/hub


def stored_models() -> list[Stored]:
    out = []
    cache = store.settings().cache_dir
    for path, r in store.all_records():
        problem = store.check_record(r, cache)
        name = r.get("name") if isinstance(r.get("name"), str) else r.get("repo_id")
        name = name if isinstance(name, str) else path.stem
        d = r.get("drafter") if isinstance(r.get("drafter"), dict) else {}
        drafter = str(d.get("name") or d.get("kind") or "")
        if d.get("kind") == "model" and not d.get("verified"):
            drafter = f"{drafter} (refused: tokenizers differ)"
        kind = r.get("kind") if isinstance(r.get("kind"), str) else "?"
        last = r.get("last_used") if isinstance(r.get("last_used"), (int, float)) else None
        if problem is not None:
            out.append(Stored(name, kind, 0, False, drafter, last, r, f"the record {path} is damaged: {problem}",
                              path))
            continue
        folder = store.snapshot(r["repo_id"], r["commit"], cache)
        files = list(r.get("files") or [])
        out.append(Stored(name, kind, store.files_size(folder, files),
                          all((folder / f).is_file() for f in files), drafter, last, r, None, path))
    return sorted(out, key=lambda s: s.name.lower())


def find(name: str) -> Stored | None:
    """The stored model `name` (as written in `edgespec list`; ORG/NAME alone matches its only entry)."""
    rows = stored_models()
    exact = [s for s in rows if s.name == name]
    if exact:
        return exact[0]
    same_repo = [s for s in rows if s.record.get("repo_id") == name]
    return same_repo[0] if len(same_repo) == 1 else None


@dataclass
class Removal:
    """What `rm` deletes: the record, the snapshot entries (links) of the record's files, and the
    blobs no other snapshot entry of that repository still points to."""

    record: Path
    pointers: list[Path]
    blobs: list[Path]
    size: int
    snapshot: Path | None = None


class UnsafeRecordError(ValueError):
    """A record names a path outside its snapshot (edited, or written from a hostile hub's answer)."""


def plan_removal(stored: Stored) -> Removal:
    """What removing `stored` deletes, every path checked first (UnsafeRecordError, nothing
    deleted, when the record names one outside its snapshot or a link leading out of the cache)."""
    r = stored.record
    problem = stored.problem or store.check_record(r)
    if problem is not None:
        raise UnsafeRecordError(f"{stored.name}: {problem}; nothing removed (remove that record yourself if "
                                "it is not wanted)")
    name = parse(r["name"]) or HubName(r["repo_id"])
    repo = store.repo_folder(r["repo_id"])
    folder = repo / "snapshots" / r["commit"]
    blobs_dir = (repo / "blobs").resolve()
    other_records = [
        d for _p, d in store.all_records()
        if d.get("repo_id") == r["repo_id"] and d.get("name") != r.get("name")
    ]
    kept = {(d["commit"], f) for d in other_records if isinstance(d.get("commit"), str)
            and isinstance(d.get("files"), list) for f in d["files"] if isinstance(f, str)}
    pointers, blobs = [], []
    for f in r.get("files") or []:
        if (r["commit"], f) in kept:
            continue  # another stored name (e.g. another :QUANT) uses this file
        p = folder / f
        if not os.path.lexists(p):
            continue
        if p.is_symlink():
            target = p.resolve()
            if target.parent != blobs_dir:
                continue  # not a link the hub cache made: left alone
            pointers.append(p)
            blobs.append(target)
        # a plain file in a snapshot is a copy the hub cache made where links are unavailable
        elif p.is_file():
            pointers.append(p)
    # a blob another snapshot entry still points to stays
    removing = set(pointers)
    still_used = set()
    if (repo / "snapshots").is_dir():
        for p in (repo / "snapshots").rglob("*"):
            if p.is_symlink() and p not in removing:
                still_used.add(p.resolve())
    blobs = sorted({b for b in blobs if b not in still_used and b.is_file()})
    size = sum(b.stat().st_size for b in blobs) + sum(p.stat().st_size for p in pointers if not p.is_symlink())
    return Removal(stored.record_file or store.record_path(name), pointers, blobs, size, folder)


def remove(plan: Removal) -> None:
    """Delete what `plan` names, then the folders that emptied (never one still holding anything)."""
    for p in plan.pointers:
        p.unlink(missing_ok=True)
    for b in plan.blobs:
        b.unlink(missing_ok=True)
    plan.record.unlink(missing_ok=True)
    for p in plan.pointers:
        _prune(p.parent, stop=p.parents[len(p.parents) - 1])
    if plan.pointers and plan.snapshot is not None:
        _drop_empty_repo(plan.snapshot)


def _drop_empty_repo(snap: Path) -> None:
    """Once a snapshot is gone, the refs naming it go, then the repository's folders if empty."""
    if snap.exists():
        return
    repo = snap.parent.parent
    refs = repo / "refs"
    if refs.is_dir():
        for ref in refs.rglob("*"):
            try:
                if ref.is_file() and store.inside(ref, repo) and ref.read_text().strip() == snap.name:
                    ref.unlink()
            except OSError:
                pass
    for folder in sorted((d for d in (refs, repo / "blobs", repo / "snapshots") if d.is_dir()),
                         key=lambda d: -len(d.parts)):
        for sub in sorted((x for x in folder.rglob("*") if x.is_dir()), key=lambda d: -len(d.parts)):
            try:
                sub.rmdir()
            except OSError:
                pass
        try:
            folder.rmdir()
        except OSError:
            pass
    try:
        repo.rmdir()
    except OSError:
        pass


def _prune(folder: Path, stop: Path) -> None:
    """Remove `folder` and its parents up to the repository's snapshots/ while they are empty."""
    while folder.name and folder != stop:
        if folder.name == "snapshots":
            break
        try:
            folder.rmdir()  # only succeeds when empty
        except OSError:
            return
        folder = folder.parent
