"""What edgespec may replace on disk, and how it writes: one rule for every command that writes.

An existing destination is replaced (with `--force`, or by edgespec's own rewrites such as
`convert --add-drafter`) only when it is something edgespec wrote:

- an edgespec **bundle**: `manifest.json` parses and says `"format": "edgespec-bundle"`,
  and every file in the folder is one the manifest lists (or the manifest itself);
- a **drafter folder** written by `edgespec distill`: a `distill.json` object with its
  `vocab_hash` and `params`, beside only the files distill writes (DISTILL_FILES);
- a **Core ML package** edgespec exported: `Manifest.json` lists its items and the model
  spec carries edgespec's metadata entry (`edgespec.coreml`); no file outside the items;
- an **empty folder**.

Everything else is refused with a message naming what is there: any other folder, a folder
of the above holding files edgespec did not write (a `notes.txt` dropped into a bundle), a
plain file, a symbolic link. Never replaced whatever it holds: `/`, the home folder
(`Path.home()`, `$HOME` and the account's home), any folder holding the home folder, and any
folder holding the current working folder. Ignored when judging: edgespec's own writer-pid
marker and macOS Finder's `.DS_Store`.

The check runs before any work (a conversion reads for minutes first) and again at the
moment of replacing: the old destination is first renamed aside, judged once more as it is
then, and put back if it changed meanwhile; only then the new one is renamed into place and
the old one removed.

Written folders and files get the user's normal permissions: 0777 / 0666 less the umask
(0755 / 0644 under the usual 022), although they are staged in `mkdtemp` folders (0700).

A writer killed outright (SIGKILL) leaves its temp beside the destination
(`.<name>.tmp-...`, holding its pid); the next write of that destination removes the temps
whose writer is gone, never another's, never a live one's. (Killed in the instant between
renaming the old destination aside and the new one into place, it leaves the old one in
`.<name>.old-...`: kept, never removed automatically.)

Runtime module (the history store uses it): it must not import edgespec.converters.

About 470 lines: one rule (replace only what edgespec wrote) and every writer that keeps it
(files, folders, packages, the checks before a write); kept together so the rule is read once.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from edgespec.errors import EdgespecError

PID_MARKER = ".edgespec-writer-pid"  # inside a temp folder: the pid of the process writing it
IGNORED = frozenset({PID_MARKER, ".DS_Store"})
MANIFEST = "manifest.json"
# What `edgespec distill` writes into its drafter folder (student and feature kinds).
DISTILL_FILES = frozenset(
    {"config.json", "model.safetensors", "vocab_map.json", "drafter.json", "distill.json", "MODEL_CARD.md",
     "corpus.bin"}
)
COREML_METADATA_KEY = b"edgespec.coreml"  # edgespec.drafters.coreml.METADATA_KEY, as stored in the spec
COREML_SPEC = "Data/com.apple.CoreML/model.mlmodel"
DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
NO_PERMISSION = (errno.EACCES, errno.EPERM, errno.EROFS)


class UnsafeDestinationError(EdgespecError, FileExistsError):
    """The destination exists and is not something edgespec wrote (or is never replaced): refused."""


class WriteError(EdgespecError, OSError):
    """Writing failed for a reason outside edgespec (full disk, no permission); nothing was changed."""


class WritePermissionError(WriteError, PermissionError):
    """The destination's folder may not be written (permissions, a read-only file system)."""


def write_error(err: int | None, message: str) -> WriteError:
    cls = WritePermissionError if err in NO_PERMISSION else WriteError
    e = cls(message)
    e.errno = err
    return e


# ---------------------------------------------------------------- what may be replaced


def _account_home() -> str:
    import pwd  # POSIX only

    return pwd.getpwuid(os.getuid()).pw_dir


def _homes() -> list[Path]:
    homes = []
    for get in (Path.home, lambda: os.environ["HOME"], _account_home):
        try:
            h = Path(get()).expanduser()
        except (KeyError, RuntimeError, OSError, ImportError, AttributeError):
            continue
        if str(h):
            homes.append(h.resolve())
    return homes


def _shown(path: str | Path) -> str:
    """`path` as the user typed it, with the folder it names when that is not obvious ('.', '..', links)."""
    p = Path(path).expanduser()
    real = p.resolve()
    return str(p) if str(p) == str(real) else f"{p} ({real})"


def aside_name(path: Path) -> Path:
    """Where a damaged file edgespec reads is kept: <name>.corrupt, or .corrupt-1, -2, ...
    (an earlier one is never overwritten)."""
    aside = path.with_name(path.name + ".corrupt")
    i = 0
    while os.path.lexists(aside):
        i += 1
        aside = path.with_name(f"{path.name}.corrupt-{i}")
    return aside


def protected_reason(path: str | Path) -> str | None:
    """Why `path` is never replaced (root, home folder, holding it or the working folder), else None."""
    p = Path(path).expanduser().resolve()
    if p == Path(p.anchor):
        return "is the root folder"
    for home in _homes():
        if p == home:
            return "is your home folder"
        if p in home.parents:
            return f"holds your home folder {home}"
    try:
        cwd = Path.cwd().resolve()
    except OSError:
        cwd = None
    if cwd is not None and (p == cwd or p in cwd.parents):
        return "is the current working folder" if p == cwd else f"holds the current working folder {cwd}"
    return None


def _walk(folder: Path) -> Iterator[tuple[str, bool]]:
    """(relative path, is a folder) of everything under `folder`, never following links."""
    for root, dirs, files in os.walk(folder, followlinks=False):
        rel = Path(root).relative_to(folder)
        for d in dirs:
            yield str(rel / d), not (Path(root) / d).is_symlink()
        for f in files:
            yield str(rel / f), False


def _foreign(folder: Path, allowed: set[str]) -> list[str]:
    """Entries of `folder` outside `allowed` (relative file names), outermost first: 'notes/' for a whole
    foreign folder, not each file in it."""
    keep_dirs = {str(parent) for name in allowed for parent in Path(name).parents if str(parent) != "."}
    out: list[str] = []
    for name, is_dir in sorted(_walk(folder)):
        if Path(name).name in IGNORED or any(name.startswith(f + "/") for f in out if f.endswith("/")):
            continue
        if is_dir:
            if name not in keep_dirs:
                out.append(name + "/")
        elif name not in allowed:
            out.append(name)
    return out


def _json(path: Path):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _bundle_files(folder: Path) -> set[str] | None:
    m = _json(folder / MANIFEST)
    if not (isinstance(m, dict) and m.get("format") == "edgespec-bundle" and isinstance(m.get("files"), dict)):
        return None
    return {str(n) for n in m["files"]} | {MANIFEST}


def _distill_files(folder: Path) -> set[str] | None:
    info = _json(folder / "distill.json")
    if not (isinstance(info, dict) and "vocab_hash" in info and "params" in info):
        return None
    return set(DISTILL_FILES)


def _package_files(folder: Path) -> set[str] | None:
    m = _json(folder / "Manifest.json")
    entries = m.get("itemInfoEntries") if isinstance(m, dict) else None
    if not isinstance(entries, dict):
        return None
    try:
        with open(folder / COREML_SPEC, "rb") as f:
            if COREML_METADATA_KEY not in f.read():
                return None
    except OSError:
        return None
    allowed = {"Manifest.json"}
    for e in entries.values():
        item = folder / "Data" / str((e or {}).get("path", ""))
        if item.is_dir():
            allowed |= {str((Path(r) / f).relative_to(folder)) for r, _, fs in os.walk(item) for f in fs}
        else:
            allowed.add(str(item.relative_to(folder)))
    return allowed


KINDS = (
    ("an edgespec bundle", _bundle_files),
    ("an edgespec drafter folder", _distill_files),
    ("a Core ML package edgespec exported", _package_files),
)


def _names(entries: list[str], limit: int = 3) -> str:
    shown = ", ".join(entries[:limit])
    return f"{shown} and {len(entries) - limit} more" if len(entries) > limit else shown


def replace_refusal(path: str | Path, label: str = "OUT") -> str | None:
    """None when `path` may be replaced (absent, empty folder, or what edgespec wrote), else why not."""
    path = Path(path).expanduser()
    why = protected_reason(path)
    if why:
        return f"{label} {_shown(path)} {why}; edgespec never replaces it: choose another {label}"
    if path.is_symlink():
        return (f"{label} {path} is a symbolic link (to {os.readlink(path)}); refusing to replace it: "
                f"choose another {label} or remove the link yourself")  # fmt: skip
    if not path.exists():
        return None
    if not path.is_dir():
        return (f"{label} {path} is a file, not a folder edgespec wrote; refusing to replace it: "
                f"choose another {label} or remove it yourself")  # fmt: skip
    top = sorted((p.name + ("/" if p.is_dir() and not p.is_symlink() else "") for p in path.iterdir()),
                 key=lambda n: (not n.endswith("/"), n))  # folders first: they hold the most
    top = [n for n in top if n.rstrip("/") not in IGNORED]
    if not top:
        return None  # an empty folder
    for kind, files in KINDS:
        allowed = files(path)
        if allowed is None:
            continue
        foreign = _foreign(path, allowed)
        if not foreign:
            return None
        return (f"{label} {path} is {kind} but also holds files edgespec did not write ({_names(foreign)}); "
                f"refusing to replace it: move them out or choose another {label}")  # fmt: skip
    return (f"{label} {path} is not an edgespec bundle (it holds {_names(top)}); refusing to replace it: "
            f"choose another {label} or remove it yourself")  # fmt: skip


def check_protected(path: str | Path, label: str = "OUT") -> None:
    """Refuse the folders never replaced: the root, the home folder or one holding it, one holding the
    working folder."""
    why = protected_reason(path)
    if why:
        raise UnsafeDestinationError(f"{label} {_shown(path)} {why}; edgespec never replaces it: "
                                     f"choose another {label}")  # fmt: skip


def check_replaceable(path: str | Path, force: bool, label: str = "OUT") -> None:
    """Before any work: refuse an existing `path` without force, and with force anything but what
    edgespec wrote (or an empty folder); refuse the protected folders always."""
    path = Path(path).expanduser()
    check_protected(path, label)
    if not os.path.lexists(path):
        return
    if not force:
        raise FileExistsError(
            f"{path} already exists (pass --force to replace it; --force replaces only an edgespec bundle, "
            "a drafter folder or Core ML package edgespec wrote, or an empty folder)"
        )
    why = replace_refusal(path, label)
    if why:
        raise UnsafeDestinationError(why)


def check_writable(path: str | Path, label: str = "OUT") -> None:
    """Refuse early when `path` could not be written: its nearest existing folder is read-only to us."""
    path = Path(path).expanduser().absolute()
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise write_error(errno.ENOTDIR, f"cannot write {label} {path}: {parent} is not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise write_error(errno.EACCES, f"cannot write {label} {path}: {parent} is not writable "
                          "(permission denied or a read-only file system); choose another place")  # fmt: skip


# ---------------------------------------------------------------- permissions


def umask() -> int:
    try:  # Linux: read it without changing it (os.umask would, briefly, for every thread)
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def fix_modes(path: str | Path) -> None:
    """Give `path` (and everything under it) the user's normal permissions: folders 0777 and files
    0666 less the umask (files that had an execute bit keep one). Links are left alone."""
    mask = umask()
    path = Path(path)

    def one(p: str) -> None:
        st = os.lstat(p)
        if stat.S_ISDIR(st.st_mode):
            os.chmod(p, 0o777 & ~mask)
        elif stat.S_ISREG(st.st_mode):
            os.chmod(p, (0o777 if st.st_mode & 0o111 else 0o666) & ~mask)

    one(str(path))
    if path.is_dir() and not path.is_symlink():
        for root, dirs, files in os.walk(path):
            for n in dirs + files:
                one(os.path.join(root, n))


# ---------------------------------------------------------------- temps


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process: alive
    return True


def temp_prefix(out: Path) -> str:
    return f".{out.name}.tmp-"


def clean_stale_temps(out: str | Path) -> list[Path]:
    """Remove the temps of earlier writes of `out` whose writer is gone (killed, crashed).

    A temp folder carries its writer's pid in PID_MARKER, a temp file in its name
    (`.<name>.tmp-<pid>-...`); one whose writer still runs is left alone, and so is one
    whose writer cannot be told (an empty temp folder is removed: it holds nothing).
    """
    out = Path(out)
    removed: list[Path] = []
    if not out.parent.is_dir():
        return removed
    for t in out.parent.glob(f"{temp_prefix(out)}*"):
        if t.is_symlink():
            continue
        if t.is_dir():
            try:
                pid = int((t / PID_MARKER).read_text().strip())
            except (OSError, ValueError):
                try:
                    t.rmdir()  # empty: a writer killed before its marker
                    removed.append(t)
                except OSError:
                    pass
                continue
            if not _alive(pid):
                shutil.rmtree(t, ignore_errors=True)
                removed.append(t)
        elif t.is_file():
            head = t.name[len(temp_prefix(out)) :].split("-", 1)[0]
            if head.isdigit() and not _alive(int(head)):
                t.unlink(missing_ok=True)
                removed.append(t)
    return removed


def _disk_full(where: Path) -> bool:
    try:
        st = os.statvfs(where)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize < (1 << 20)


def describe_failure(e: BaseException, out: Path, existed: bool, where: Path, label: str = "OUT") -> WriteError | None:
    """A WriteError saying what happened when writing `out` failed for a reason outside edgespec
    (a full disk, no permission), else None. `where`: a path on the disk being written (checked
    for free space while the partial write is still there: some writers, MLX's among them,
    report a full disk without an errno)."""
    if isinstance(e, EdgespecError) or not isinstance(e, (OSError, RuntimeError)):
        return None
    err = getattr(e, "errno", None)
    kept = f"{out} is as it was" if existed else f"{out} was not created"
    if err in DISK_FULL or (err not in NO_PERMISSION and _disk_full(where)):
        return write_error(errno.ENOSPC, f"writing {label} {out} failed: the disk is full ({e}); nothing was "
                           f"changed ({kept}, no temp left): free some space and run again")  # fmt: skip
    if err in NO_PERMISSION:
        return write_error(err, f"writing {label} {out} failed: permission denied or a read-only file system "
                           f"({e}); nothing was changed ({kept}, no temp left)")  # fmt: skip
    return None


# ---------------------------------------------------------------- writing


def install(tmp: Path, out: Path, force: bool, label: str = "OUT") -> None:
    """Move the finished temp `tmp` to `out` (same folder); an existing `out` is replaced only with
    force and only while it is what edgespec wrote (checked again now, and once more after it was
    renamed aside, so a file dropped in meanwhile is never deleted)."""
    fix_modes(tmp)
    if not os.path.lexists(out):
        os.replace(tmp, out)
        return
    if not force:
        raise FileExistsError(f"{out} already exists (pass --force to replace it)")
    why = replace_refusal(out, label)
    if why:
        raise UnsafeDestinationError(why)
    trash = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
    old = trash / out.name
    try:
        os.replace(out, old)
    except BaseException:
        trash.rmdir()
        raise
    why = replace_refusal(old, label)
    if why:  # it changed between the check and the rename: put it back untouched
        os.replace(old, out)
        trash.rmdir()
        raise UnsafeDestinationError(why.replace(str(old), str(out)))
    try:
        os.replace(tmp, out)
    except BaseException:
        os.replace(old, out)
        trash.rmdir()
        raise
    shutil.rmtree(trash, ignore_errors=True)


@contextmanager
def atomic_folder(out: str | Path, force: bool = False, label: str = "OUT"):
    """Yield a temp folder beside `out`; on success it becomes `out`, on any error it is removed.

    `out` is judged first (check_replaceable) and again when it is replaced (install).
    Interrupting (Ctrl-C) or any error leaves `out` as it was: absent or the old one. A run
    killed outright (SIGKILL) leaves its temp folder; the next write of `out` removes it.
    A full disk or a permission error is reported as a WriteError saying so.
    """
    out = Path(out).expanduser()
    check_replaceable(out, force, label)
    existed = os.path.lexists(out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        clean_stale_temps(out)
        tmp = Path(tempfile.mkdtemp(prefix=temp_prefix(out), dir=out.parent))
    except OSError as e:
        raise describe_failure(e, out, existed, out.parent, label) or e from None
    try:
        (tmp / PID_MARKER).write_text(str(os.getpid()))
        yield tmp
        (tmp / PID_MARKER).unlink(missing_ok=True)
        install(tmp, out, force, label)
    except BaseException as e:
        nicer = describe_failure(e, out, existed, tmp, label)
        shutil.rmtree(tmp, ignore_errors=True)
        if nicer is not None:
            raise nicer from e
        raise
