"""Fetching a hub model with huggingface_hub (its cache, its resumable transfers, its token), and
resolving a name to files on disk with no hub call when they are already there.

huggingface_hub is imported here only, lazily: runs of local models never load it.
"""

from __future__ import annotations

import importlib
import json
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from huggingface_hub import HfApi, constants, hf_hub_download
from huggingface_hub import errors as he

from edgespec.drafters.compat import check_tokenizers
from edgespec.errors import EdgespecError, ModelLoadError
from edgespec.hub import store
from edgespec.hub.names import HubName, as_hub_name, parse
from edgespec.hub.pairing import paired_drafter
from edgespec.hub.select import NothingRunnableError, Selection, select
from edgespec.models import DRAFTER_ONLY, get_architecture
from edgespec.progress import progress_bar
from edgespec.tokenizer import Tokenizer
from edgespec.weights.formats.gguf import _open
from edgespec.weights.formats.gguf_tokenizer import build_tokenizer
from edgespec.weights.formats.hf import read_config

Report = Callable[[str], None]


class HubError(EdgespecError):
    """A hub name could not be fetched or found; the message says what to do."""


class NotStoredError(HubError):
    """The name is not on disk and fetching was not allowed (offline, or a server without --allow-pull)."""


class DiskSpaceError(HubError, OSError):
    """The files would not fit in the free space left where the hub cache lives."""


@dataclass
class Local:
    """A name resolved to disk. `path`: what edgespec.weights.loader.load opens (a snapshot folder or a GGUF
    file); `fetched`: bytes transferred by this call (0 when everything was cached)."""

    name: HubName
    path: Path
    kind: str
    commit: str
    files: list[str]
    record: dict[str, Any] = field(default_factory=dict)
    fetched: int = 0
    notes: list[str] = field(default_factory=list)


def human(n: int | float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n} B"


def free_bytes(folder: Path) -> int:
    """Free space of the file system holding `folder` (its nearest existing parent)."""
    p = Path(folder)
    while not p.exists() and p != p.parent:
        p = p.parent
    return shutil.disk_usage(p).free


# ------------------------------------------------------------------ offline lookup
def locate(name: HubName) -> Local | None:
    """The name's files when all are in the cache, found with no hub call: edgespec's record of
    the last pull first, else the snapshot the cache's ref points to (fetched by any tool)."""
    cfg = store.settings()
    record = store.read_record(name)
    if record and record.get("repo_id") == name.repo_id and store.check_record(record, cfg.cache_dir) is None \
            and record.get("kind") in ("bundle", "safetensors", "gguf"):
        folder = store.snapshot(name.repo_id, record["commit"], cfg.cache_dir)
        files = list(record.get("files") or [])
        if files and all((folder / f).is_file() for f in files):
            return _local(name, folder, record["kind"], record["commit"], files, record)
    commit = store.cached_commit(name.repo_id, name.revision, cfg.cache_dir)
    if commit is None:
        return None
    folder = store.snapshot(name.repo_id, commit, cfg.cache_dir)
    present = store.local_files(folder)
    if not present:
        return None
    try:
        sel = select(present, name.quant, name.repo_id)
    except NothingRunnableError:
        return None
    if _missing_shards(folder, sel):
        return None
    return _local(name, folder, sel.kind, commit, sel.files, {})


def _local(name, folder: Path, kind: str, commit: str, files: list[str], record: dict) -> Local:
    path = folder / files[0] if kind == "gguf" else folder
    return Local(name, path, kind, commit, files, record)


def _missing_shards(folder: Path, sel: Selection) -> list[str]:
    """Shards a safetensors index names that are not in the folder."""
    missing = []
    for f in sel.files:
        if f.endswith(".safetensors.index.json"):
            try:
                shards = set(json.loads((folder / f).read_text()).get("weight_map", {}).values())
            except (OSError, ValueError, AttributeError, TypeError):
                return [f]
            # a shard named outside the snapshot (absolute, '..', a link leading out) counts as missing
            missing += [str(s)[:80] for s in sorted(shards, key=str) if not store.is_repo_path(s)
                        or not (folder / s).is_file() or not store.inside(folder / s, folder.parent.parent)]
    return missing


def cached_description(name: HubName) -> str:
    """'a cached copy exists' / 'no cached copy', for messages about the network."""
    return "a cached copy exists" if locate(name) else "no cached copy of it is on this machine"


# ------------------------------------------------------------------ the hub
def _hub_error(e: BaseException, name: HubName, endpoint: str | None) -> EdgespecError:
    """One actionable line for what huggingface_hub raised."""
    httpx2 = _http_client()

    where = f"{endpoint or _default_endpoint()}/{name.repo_id}"
    token = "give a token (HF_TOKEN, or `hf auth login`)"
    if isinstance(e, he.GatedRepoError):
        return HubError(f"{name.repo_id} is gated: accept its license on its page ({where}) and {token}")
    if isinstance(e, he.RevisionNotFoundError):
        return HubError(f"{name.repo_id} has no revision {name.revision!r}")
    if isinstance(e, he.RepositoryNotFoundError):
        status = getattr(getattr(e, "response", None), "status_code", None)
        if status in (401, 403):
            return HubError(f"{name.repo_id} is private or gated ({status}): accept its license or ask for access on "
                            f"its page ({where}) and {token}")
        return HubError(f"no model named {name.repo_id} on the hub (404; check the spelling; a private repository "
                        f"needs a token: HF_TOKEN or `hf auth login`), and no local file or folder {name} either")
    if isinstance(e, he.HfHubHTTPError):
        status = getattr(getattr(e, "response", None), "status_code", None)
        if status in (401, 403):
            return HubError(f"{name.repo_id}: access refused ({status}): accept its license on its page ({where}) "
                            f"and {token}")
        return HubError(f"the hub answered {status} for {name.repo_id}; try again later ({cached_description(name)})")
    if isinstance(e, (he.OfflineModeIsEnabled,)):
        return NotStoredError(f"HF_HUB_OFFLINE is set and {name} is not in the cache")
    if isinstance(e, (httpx2.RemoteProtocolError, httpx2.ReadError)):
        return HubError(f"the download of {name} was cut off ({type(e).__name__}) after its retries; nothing partial "
                        f"is kept as complete: `edgespec pull {name}` again fetches only what is missing")
    if isinstance(e, (httpx2.TransportError, ConnectionError, TimeoutError)):
        return HubError(f"cannot reach the hub for {name} (network: {type(e).__name__}); {cached_description(name)}"
                        "; what was fetched is kept and `edgespec pull` resumes from there")
    if isinstance(e, OSError) and "Consistency check failed" in str(e):
        return HubError(f"the download of {name} was cut off; nothing partial is kept as complete: run "
                        f"`edgespec pull {name}` again")
    if isinstance(e, OSError):
        return HubError(f"could not store {name} in {store.settings().cache_dir}: {e.strerror or e}")
    raise e


def _http_client():
    """The HTTP client module huggingface_hub uses (httpx2 in its 2.x releases, httpx before)."""
    try:
        return importlib.import_module("httpx2")
    except ImportError:
        return importlib.import_module("httpx")


def _default_endpoint() -> str:
    return constants.ENDPOINT


def _listing(name: HubName, cfg: store.HubSettings) -> tuple[str, dict[str, int]]:
    """(commit, {path: size}) of the repository at the name's revision: one hub call."""
    info = HfApi(endpoint=cfg.endpoint).model_info(name.repo_id, revision=name.revision, files_metadata=True)
    sizes = {s.rfilename: int(s.size or 0) for s in (info.siblings or [])}
    return str(info.sha), sizes


class _Bytes:
    """Counts the bytes huggingface_hub transfers and feeds one bar (or none) for the whole pull.
    Stands in for its tqdm class: it calls the class once per file with total/initial, then update()."""

    bar = None
    fetched = 0

    def __init__(self, *args, **kwargs):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def close(self):
        pass

    def update(self, n=1):
        type(self).fetched += int(n or 0)
        if type(self).bar is not None:
            type(self).bar.update(n)

    def update_transfer(self, n=1):
        pass

    def set_postfix_str(self, *a, **k):
        pass

    set_transfer_postfix_str = set_postfix_str
    refresh = close


def _download(name: HubName, commit: str, files: list[str], sizes: dict[str, int], cfg, progress: bool) -> int:
    """Fetch `files` (the missing ones) into the hub cache, one after the other in this thread so
    that Ctrl-C lands here and huggingface_hub drops the temp file it was writing. -> bytes fetched."""
    counter = type("_Count", (_Bytes,), {"fetched": 0, "bar": None})
    total = sum(sizes.get(f, 0) for f in files)
    show = progress and sys.stderr.isatty()
    with progress_bar(total=total, desc=name.repo_id, unit="B", enable=show, unit_scale=True) as bar:
        counter.bar = bar if show else None
        for f in files:
            hf_hub_download(name.repo_id, f, revision=commit, cache_dir=str(cfg.cache_dir), endpoint=cfg.endpoint,
                            tqdm_class=counter)
    return counter.fetched


def _cached(folder: Path, files: list[str]) -> set[str]:
    return {f for f in files if (folder / f).is_file()}


def _check_architecture(name: HubName, folder: Path) -> None:
    """An unsupported model_type is refused before the weights are fetched."""
    model_type = read_config(folder).get("model_type")
    if model_type in DRAFTER_ONLY:
        return  # a drafter (Gemma 4's assistant): fetched to draft, which the loader checks when attached
    try:
        get_architecture(model_type)
    except ModelLoadError as e:
        raise NothingRunnableError(f"{name.repo_id}: {e}") from None


def pull(name: HubName | str, progress: bool = True, report: Report | None = None, drafter: bool = True) -> Local:
    """Fetch what `name` needs into the hub cache (what is there already is not fetched again),
    record it, and with `drafter` also the catalog's paired drafter. Errors are HubError lines."""
    name = parse(name) if isinstance(name, str) else name
    if name is None:
        raise HubError("a hub name has the form ORG/NAME[@REVISION][:QUANT]")
    say = report or (lambda _m: None)
    cfg = store.settings()
    if cfg.offline:
        local = locate(name)
        if local is None:
            raise NotStoredError(f"HF_HUB_OFFLINE is set and {name} is not in the cache ({_what_is_missing(name)}); "
                                 "unset HF_HUB_OFFLINE to fetch it")
        say(f"{name}: in the cache (offline)")
        local.notes += _pair(local, progress, say, fetch=False) if drafter else []
        return local
    try:
        commit, sizes = _listing(name, cfg)
    except Exception as e:  # noqa: BLE001 - every hub/network failure becomes one line
        raise _hub_error(e, name, cfg.endpoint) from None
    if not store.is_commit(commit):  # it becomes a folder name: ../ would lead out of the cache
        raise HubError(f"the hub answered {name.repo_id}'s commit as {commit[:60]!r}, not 40 hex digits; "
                       "refusing it (nothing fetched or recorded)")
    sizes = {f: n for f, n in sizes.items() if store.is_repo_path(f)}  # never a path out of the snapshot
    sel = select(sorted(sizes), name.quant, name.repo_id)
    folder = store.snapshot(name.repo_id, commit, cfg.cache_dir)
    unsafe = store.check_files(name.repo_id, commit, sel.files, cfg.cache_dir)
    if unsafe is not None:
        raise HubError(f"{name} in the cache: {unsafe}; refusing to use it (remove that entry of "
                       f"{store.repo_folder(name.repo_id, cfg.cache_dir)} and pull again)")
    fetched = 0
    try:
        missing = [f for f in sel.files if f not in _cached(folder, sel.files)]
        need = sum(sizes.get(f, 0) for f in missing)
        free = free_bytes(cfg.cache_dir)
        if need > free:
            raise DiskSpaceError(f"{name} needs {human(need)} ({len(missing)} files) and {cfg.cache_dir} has "
                                 f"{human(free)} free: free some space or point HF_HOME at a larger disk")
        if missing:
            say(f"fetching {name}: {len(missing)} file{'s' if len(missing) != 1 else ''}, {human(need)} "
                f"({', '.join(missing[:4])}{', ...' if len(missing) > 4 else ''}) into {cfg.cache_dir}")
        else:
            say(f"{name}: already in the cache ({human(sel.size(sizes))})")
        if sel.kind == "safetensors" and "config.json" in missing:  # small: read before the weights
            fetched += _download(name, commit, ["config.json"], sizes, cfg, False)
            missing.remove("config.json")
        if sel.kind == "safetensors":
            _check_architecture(name, folder)
        if missing:
            fetched += _download(name, commit, missing, sizes, cfg, progress)
    except (EdgespecError, KeyboardInterrupt):
        raise
    except Exception as e:  # noqa: BLE001
        raise _hub_error(e, name, cfg.endpoint) from None
    if _missing_shards(folder, sel):
        raise HubError(f"{name}: its index names weights that are not in the repository: "
                       f"{', '.join(_missing_shards(folder, sel)[:3])}")
    record = store.read_record(name) or {}
    if store.check_record(record) is not None:
        record = {}  # an edited or damaged record: replaced whole
    record = {**record, "name": str(name), "repo_id": name.repo_id, "revision": name.revision, "quant": name.quant,
              "commit": commit, "kind": sel.kind, "files": sel.files, "pulled": time.time(),
              "size": sel.size(sizes)}
    if any(f.startswith(("drafter/", "drafter.mlpackage/")) for f in sel.files):
        record["drafter"] = {"kind": "shipped"}
    store.write_record(name, record)
    local = _local(name, folder, sel.kind, commit, sel.files, record)
    local.fetched = fetched
    if drafter:
        local.notes += _pair(local, progress, say, fetch=True)
    return local


def _what_is_missing(name: HubName) -> str:
    record = store.read_record(name)
    if record and store.check_record(record) is None:
        folder = store.snapshot(name.repo_id, record["commit"])
        gone = [f for f in record.get("files") or [] if not (folder / f).is_file()]
        return "missing: " + ", ".join(gone[:4]) if gone else "its files were removed"
    return "never fetched"


def _pair(local: Local, progress: bool, say: Report, fetch: bool) -> list[str]:
    """Fetch (with `fetch`) and check the catalog's drafter for `local`; record the pairing."""
    pairing = paired_drafter(local.name.repo_id)
    if pairing is None or _drafter_info(local.record).get("kind") == "shipped":
        return []
    if not pairing.fetches:
        info = {"kind": "mtp", "family": pairing.family}
        say(f"{local.name}: drafts with its own multi-token-prediction head (nothing to fetch)")
    else:
        dname = parse(pairing.drafter)
        try:
            d = pull(dname, progress=progress, report=say, drafter=False) if fetch else locate(dname)
        except EdgespecError as e:
            return [f"the paired drafter {pairing.drafter} was not fetched: {e}"]
        if d is None:
            return [f"a drafter would help: `edgespec pull {pairing.drafter}`"]
        try:
            check_pairing_files(local, d)
        except EdgespecError as e:
            local.record = {**local.record, "drafter": {"kind": "model", "name": pairing.drafter, "verified": False,
                                                       "error": str(e)}}
            store.write_record(local.name, local.record)
            return [f"{pairing.drafter} does not pair with {local.name}: {e}"]
        info = {"kind": "model", "name": pairing.drafter, "family": pairing.family, "verified": True}
        say(f"{local.name}: paired with drafter {pairing.drafter} (tokenizers checked)")
    local.record = {**local.record, "drafter": info}
    if local.record.get("repo_id"):
        store.write_record(local.name, local.record)
    return []


def _drafter_info(record: dict) -> dict:
    info = record.get("drafter")
    return info if isinstance(info, dict) else {}


def check_pairing_files(model: Local, drafter: Local) -> None:
    """The tokenizer check edgespec runs when it attaches a drafter, on the two tokenizers as stored
    (no weights loaded); VocabularyMismatchError names the first id that differs."""
    check_tokenizers(_tokenizer(drafter), _tokenizer(model))


def _tokenizer(local: Local):
    if local.kind == "gguf":
        return Tokenizer(*build_tokenizer(_open(local.path), local.path))
    return Tokenizer.from_folder(local.path)


# ------------------------------------------------------------------ runs by name
@dataclass
class Resolved:
    """What a run by name opens: the model's files, the paired drafter's folder when it is on disk
    (None: none paired, the model's own MTP head, or not fetched), and notes for the user."""

    local: Local
    drafter: Path | None
    notes: list[str]


def resolve(name: HubName | str, fetch: bool = True, progress: bool = True, report: Report | None = None) -> Resolved:
    """The name's files: from the cache with no hub call when they are all there (edgespec's record,
    else the cache's ref), else fetched (with `fetch`, never when HF_HUB_OFFLINE is set).
    The paired drafter is only looked up, never fetched: a run never downloads mid-way."""
    name = parse(name) if isinstance(name, str) else name
    local = locate(name)
    if local is None:
        cfg = store.settings()
        if cfg.offline:
            raise NotStoredError(f"HF_HUB_OFFLINE is set and {name} is not in the cache ({_what_is_missing(name)}); "
                                 f"unset it or run `edgespec pull {name}` where the hub is reachable")
        if not fetch:
            raise NotStoredError(f"{name} is not stored here: `edgespec pull {name}` fetches it")
        local = pull(name, progress=progress, report=report, drafter=False)
    if local.record:
        store.touch_last_used(name, local.record)
    drafter, notes = _run_drafter(local)
    return Resolved(local, drafter, notes)


def _run_drafter(local: Local) -> tuple[Path | None, list[str]]:
    info = _drafter_info(local.record)
    if info.get("kind") in ("shipped", "mtp"):
        return None, []  # the loader finds a drafter/ folder or an MTP head itself
    if info.get("kind") == "model" and not info.get("verified"):
        return None, []  # checked at pull time and refused: not tried again
    pairing = paired_drafter(local.name.repo_id)
    if pairing is None or not pairing.fetches:
        return None, []
    d = locate(parse(pairing.drafter))
    if d is None:
        return None, [f"a drafter would help: `edgespec pull {pairing.drafter}` fetches the one paired with "
                      f"{local.name.repo_id}"]
    if d.kind != "safetensors":
        return None, []
    return d.path, []


def resolve_path(spec, what: str = "model", progress: bool = True, report: Report | None = None):
    """`spec` as a local path: a hub name is resolved (fetched when missing), anything else is
    returned as it is (a path that exists wins over a name)."""
    name = as_hub_name(spec)
    if name is None:
        return spec
    return resolve(name, fetch=True, progress=progress, report=report).local.path
