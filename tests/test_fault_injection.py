"""Faults while writing or reading what edgespec keeps on disk: nothing is lost, the message is clear.

- kill -9 in the middle of convert, distill and a history save: the old destination is
  whole, a rerun works and leaves no temp behind;
- truncated or bit-flipped bundle weights and manifest: the loader names the file;
- a corrupted or truncated history file: an empty history, a warning, and the damaged file
  kept beside it as `<name>.corrupt` (never silently overwritten); two processes saving the
  same history file: it stays one writer's complete state (atomic rename, no lock needed);
- a read-only output folder and a full disk: a one-line error saying so, no temp left, the old
  bundle whole.

The kills are made deterministic by slowing the write from inside the child process
(a patched step that sleeps once its temp exists), so the SIGKILL lands mid-write.
Folders are all under tmp_path; the tmpfs mounts (root only) are unmounted in `finally`.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
from conftest import REPO, write_tiny_bundle, write_tiny_hf_folder

from edgespec.adaptive.history import HistoryStore
from edgespec.errors import ModelLoadError
from edgespec.weights.bundle import read_manifest
from edgespec.weights.loader import load

CONVERT_OPTS = dict(quantize="none", dtype="float32", progress=False)


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _temps(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if ".tmp-" in p.name or ".old-" in p.name)


def _child(code: str, *args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip


def _kill_when(proc: subprocess.Popen, ready, timeout: float = 120.0) -> None:
    """SIGKILL `proc` as soon as ready() holds (fails if the child exits first or it takes too long)."""
    deadline = time.monotonic() + timeout
    while not ready():
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"the child ended (rc {proc.returncode}) before the kill point:\n{out}\n{err}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail("the kill point was never reached")
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    proc.stdout.close()
    proc.stderr.close()


# ---------------------------------------------------------------- kill -9 while writing

CONVERT_CHILD = """
import sys, time
import edgespec.converters.convert as conv
real = conv.finish_manifest
def slow(folder, *a, **k):
    (folder / "KILL-ME-NOW").write_text("")   # the temp folder is written: kill here
    time.sleep(120)
conv.finish_manifest = slow
conv.convert(sys.argv[1], sys.argv[2], quantize="none", dtype="float32", force=True, progress=False)
"""


def test_kill_9_during_convert_loses_nothing_and_a_rerun_cleans_up(tmp_path):
    from edgespec.converters.convert import convert

    src = write_tiny_hf_folder(tmp_path / "hf", seed=1)
    out = write_tiny_bundle(tmp_path / "b", seed=0)  # the old bundle, replaced with --force
    before = _snapshot(out)
    proc = _child(CONVERT_CHILD, str(src), str(out))
    _kill_when(proc, lambda: any((p / "KILL-ME-NOW").exists() for p in tmp_path.glob(".b.tmp-*")))
    assert _snapshot(out) == before  # the old bundle, whole
    read_manifest(out, verify_hashes=True)
    assert _temps(tmp_path)  # the killed writer's temp folder (nobody could remove it)
    convert(src, out, force=True, **CONVERT_OPTS)  # the rerun
    read_manifest(out, verify_hashes=True)
    assert _snapshot(out) != before and _temps(tmp_path) == []


DISTILL_CHILD = """
import sys, time
from pathlib import Path
import edgespec.converters.distill.card as card
def slow(info):
    for tmp in Path(sys.argv[2]).parent.glob(".drafter.tmp-*"):
        (tmp / "KILL-ME-NOW").write_text("")
    time.sleep(120)
card.model_card = slow
from edgespec.cli import main
main(["distill", "--verifier", sys.argv[1], "--out", sys.argv[2], "--data", sys.argv[3], "--layers", "1",
      "--vocab", "40", "--steps", "2", "--batch-size", "2", "--max-new", "4", "--gen-batch", "4",
      "--checkpoint-every", "2", "--no-eval", "--quiet", *sys.argv[4:]])
"""


def test_kill_9_during_distill_loses_nothing_and_a_rerun_cleans_up(tmp_path):
    """Killed while its drafter folder is being written: the earlier drafter folder is whole;
    the rerun (--resume: the work folder keeps the data) replaces it and leaves no temp."""
    from edgespec.cli import main

    verifier = write_tiny_bundle(tmp_path / "verifier", seed=2, scale=3.0)
    data = tmp_path / "p.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": p}) for p in ("abc", "hello", "xyz top")))
    out = tmp_path / "drafter"
    argv = ["distill", "--verifier", str(verifier), "--out", str(out), "--data", str(data), "--layers", "1",
            "--vocab", "40", "--steps", "2", "--batch-size", "2", "--max-new", "4", "--gen-batch", "4",
            "--checkpoint-every", "2", "--no-eval", "--quiet"]  # fmt: skip
    assert main(argv) == 0
    before = _snapshot(out)
    proc = _child(DISTILL_CHILD, str(verifier), str(out), str(data), "--force", "--resume")
    _kill_when(proc, lambda: any((p / "KILL-ME-NOW").exists() for p in tmp_path.glob(".drafter.tmp-*")))
    assert _snapshot(out) == before and _temps(tmp_path)
    inode = out.stat().st_ino
    assert main(argv + ["--force", "--resume"]) == 0
    assert out.stat().st_ino != inode and (out / "distill.json").is_file() and _temps(tmp_path) == []


HISTORY_CHILD = """
import os, sys, time
from edgespec.adaptive import history
store = history.HistoryStore(path=sys.argv[1])
store.add([1, 2, 3, 4, 5, 6])          # saved whole
real_replace = os.replace
def stalled(a, b):
    open(sys.argv[1] + ".KILL-ME-NOW", "w").close()   # the new file is written, not yet renamed
    time.sleep(120)
history.os.replace = stalled
store.add([7, 8, 9, 10, 11])
"""


def test_kill_9_during_a_history_save_keeps_a_whole_file(tmp_path):
    path = tmp_path / "history" / "m.bin"
    proc = _child(HISTORY_CHILD, str(path))
    _kill_when(proc, lambda: Path(str(path) + ".KILL-ME-NOW").exists())
    assert _temps(path.parent)  # the killed writer's temp file
    store = HistoryStore(path=path)  # the last complete state: the first document only
    assert store.documents == 1 and store.lookup([0, 2, 3], limit=1) == [(2, [4, 5, 6])]
    assert not list(path.parent.glob("*.corrupt*"))
    store.add([20, 21, 22, 23])  # the next save works and removes the dead writer's temp
    assert _temps(path.parent) == []
    assert HistoryStore(path=path).documents == 2


# ---------------------------------------------------------------- damaged bundles


@pytest.fixture
def bundle(tmp_path) -> Path:
    return write_tiny_bundle(tmp_path / "b")


def _flip(path: Path, offset: int, bit: int = 0x10) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= bit
    path.write_bytes(bytes(data))


def test_truncated_bundle_weights_name_the_file(bundle):
    w = bundle / "model.safetensors"
    w.write_bytes(w.read_bytes()[: w.stat().st_size // 2])
    with pytest.raises(ModelLoadError, match=r"model\.safetensors.*truncated"):
        load(bundle)


@pytest.mark.parametrize("where", [0.1, 0.5, -1])
def test_bit_flipped_bundle_weights_name_the_file(bundle, where):
    w = bundle / "model.safetensors"
    size = w.stat().st_size
    _flip(w, int(size * where) if where > 0 else size - 1)
    with pytest.raises(ModelLoadError, match=r"model\.safetensors.*checksum"):
        load(bundle)


def test_truncated_manifest_names_the_file(bundle):
    m = bundle / "manifest.json"
    m.write_bytes(m.read_bytes()[:-40])
    with pytest.raises(ModelLoadError, match=r"manifest\.json.*invalid JSON"):
        load(bundle)


def _after(data: bytes, anchor: bytes, then: bytes) -> int:
    return data.index(then, data.index(anchor)) + len(then)


@pytest.mark.parametrize(
    "where, match",
    [
        (lambda d: 0, r"manifest\.json.*invalid JSON"),  # a structural byte
        (lambda d: d.index(b'"edgespec-bundle"') + 1, r"manifest\.json.*not an edgespec bundle"),  # the format
        (lambda d: _after(d, b"{", b'"format_version": '), r"manifest\.json.*bundle format 0"),  # its version
        (lambda d: _after(d, b'"model.safetensors": {', b'"size": '),  # a recorded size
         r"(model\.safetensors.*size \d+ differs|manifest\.json.*invalid JSON)"),
        (lambda d: _after(d, b'"model.safetensors": {', b'"sha256": "'), r"model\.safetensors.*checksum"),
    ],
    ids=["structure", "format", "version", "size", "checksum"],
)
def test_bit_flipped_manifest_is_reported(bundle, where, match):
    m = bundle / "manifest.json"
    _flip(m, where(m.read_bytes()), 0x01)
    with pytest.raises(ModelLoadError, match=match):
        load(bundle)


# ---------------------------------------------------------------- damaged and contended history


def _history_with(path: Path, *docs) -> HistoryStore:
    store = HistoryStore(path=path)
    for d in docs:
        store.add(d)
    return store


@pytest.mark.parametrize("damage", ["truncated", "bit-flipped", "garbage"])
def test_a_damaged_history_file_is_kept_aside_and_history_starts_empty(tmp_path, caplog, damage):
    path = tmp_path / "history" / "m.bin"
    _history_with(path, [1, 2, 3, 4, 5, 6], [7, 8, 9, 10])
    data = path.read_bytes()
    if damage == "truncated":
        bad = data[: len(data) - 7]
    elif damage == "bit-flipped":
        bad = bytearray(data)
        bad[len(data) - 9] ^= 0x04  # inside a token id: only a checksum notices
        bad = bytes(bad)
    else:
        bad = b"this is not a history file at all"
    path.write_bytes(bad)
    with caplog.at_level(logging.WARNING, logger="edgespec"):
        store = HistoryStore(path=path)
    assert store.documents == 0
    warning = " ".join(r.getMessage() for r in caplog.records)
    assert str(path) in warning and ".corrupt" in warning
    kept = path.with_name(path.name + ".corrupt")
    assert kept.read_bytes() == bad  # not lost
    store.add([30, 31, 32, 33])  # history goes on, in a fresh file
    assert HistoryStore(path=path).documents == 1 and kept.read_bytes() == bad
    path.write_bytes(b"damaged again")
    HistoryStore(path=path)
    assert kept.read_bytes() == bad  # an earlier .corrupt is never overwritten
    assert path.with_name(path.name + ".corrupt-1").read_bytes() == b"damaged again"


def test_history_never_overwrites_a_file_it_did_not_write(tmp_path, caplog):
    path = tmp_path / "history" / "m.bin"
    store = _history_with(path, [1, 2, 3, 4])
    path.write_bytes(b"someone else's file, put here after the store loaded")
    with caplog.at_level(logging.WARNING, logger="edgespec"):
        store.add([5, 6, 7, 8])
        store.clear()
    assert path.read_bytes() == b"someone else's file, put here after the store loaded"
    assert "not an edgespec history file" in caplog.text


WRITER_CHILD = """
import json, sys
from edgespec.adaptive.history import HistoryStore
seed, path = int(sys.argv[1]), sys.argv[2]
store = HistoryStore(path=path)
docs = [[seed * 1000 + i * 10 + j for j in range(40)] for i in range(60)]
for d in docs:
    store.add(d)
with store._lock:
    json.dump({"tokens": store._tokens.tolist()}, open(sys.argv[3], "w"))
"""


def test_two_processes_saving_one_history_file_leave_one_complete_state(tmp_path):
    path = tmp_path / "history" / "m.bin"
    path.parent.mkdir()
    procs = [_child(WRITER_CHILD, str(seed), str(path), str(tmp_path / f"state{seed}.json")) for seed in (1, 2)]
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
    states = [json.loads((tmp_path / f"state{s}.json").read_text())["tokens"] for s in (1, 2)]
    final = HistoryStore(path=path)
    assert final._tokens.tolist() in states
    assert not list(path.parent.glob("*.corrupt*")) and _temps(path.parent) == []


# ---------------------------------------------------------------- read-only folder, full disk


def _can_mount() -> bool:
    return os.geteuid() == 0 and shutil.which("mount") is not None


@contextmanager
def tmpfs(where: Path, options: str):
    where.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


@contextmanager
def read_only_folder(where: Path):
    """A folder nobody may write: a read-only tmpfs as root (chmod does not bind root), else mode 0555."""
    if _can_mount():
        with tmpfs(where, "ro,size=64k") as d:
            yield d
        return
    where.mkdir()
    where.chmod(0o555)
    try:
        yield where
    finally:
        where.chmod(0o755)


def test_a_read_only_output_folder_is_reported_before_the_work(tmp_path, monkeypatch):
    import edgespec.converters.convert as conv


    src = write_tiny_hf_folder(tmp_path / "hf")
    with read_only_folder(tmp_path / "ro") as ro:
        monkeypatch.setattr(conv, "_read_source", lambda *a, **k: pytest.fail("the conversion work started"))
        with pytest.raises(PermissionError, match="not writable"):
            conv.convert(src, ro / "b", **CONVERT_OPTS)
        assert not any(ro.iterdir())


def test_permission_denied_at_the_swap_leaves_the_old_bundle_and_no_temp(tmp_path, monkeypatch, capsys):
    """Where the folder turns read-only mid-way (simulated: the rename is refused)."""
    import edgespec.safe_write as sw
    from edgespec.cli import main

    src = write_tiny_hf_folder(tmp_path / "hf", seed=3)
    out = write_tiny_bundle(tmp_path / "b")
    before = _snapshot(out)
    real = os.replace

    def refused(a, b, *args, **kw):  # a read-only folder refuses every rename in it
        if out in (Path(a), Path(b)):
            raise PermissionError(errno.EACCES, "Permission denied", str(b))
        return real(a, b, *args, **kw)

    monkeypatch.setattr(sw.os, "replace", refused)
    assert main(["convert", str(src), str(out), "--force", "--quiet"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "permission denied" in err.lower() and str(out) in err
    monkeypatch.undo()
    assert _snapshot(out) == before and _temps(tmp_path) == []


def test_a_full_disk_is_reported_and_the_old_bundle_survives(tmp_path):
    from edgespec.converters.convert import convert

    from edgespec.safe_write import WriteError

    if not _can_mount():
        pytest.skip("a size-limited tmpfs needs root here (the simulated ENOSPC test below still runs)")
    src = write_tiny_hf_folder(tmp_path / "hf", seed=4)
    with tmpfs(tmp_path / "small", "size=1m") as disk:
        out = write_tiny_bundle(disk / "b")
        shutil.rmtree(disk / ".b-hf")  # the helper's source folder
        before = _snapshot(out)
        free = shutil.disk_usage(disk).free
        (disk / "filler").write_bytes(b"\0" * max(0, free - 100_000))  # room for a third of a bundle
        with pytest.raises(WriteError, match="disk .*full") as e:
            convert(src, out, force=True, **CONVERT_OPTS)
        assert e.value.errno == errno.ENOSPC and str(out) in str(e.value)
        assert _snapshot(out) == before and _temps(disk) == []
        read_manifest(out, verify_hashes=True)


def test_a_simulated_full_disk_is_reported(tmp_path, monkeypatch, capsys):
    import edgespec.converters.convert as conv

    from edgespec.cli import main

    src = write_tiny_hf_folder(tmp_path / "hf", seed=5)
    out = write_tiny_bundle(tmp_path / "b")
    before = _snapshot(out)
    real = conv.write_model_files

    def full(folder, *a, **k):
        real(folder, *a, **k)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(conv, "write_model_files", full)
    assert main(["convert", str(src), str(out), "--force", "--quiet"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "full" in err and str(out) in err
    assert _snapshot(out) == before and _temps(tmp_path) == []


def test_a_full_disk_while_saving_history_keeps_the_old_file(tmp_path, monkeypatch, caplog):
    path = tmp_path / "history" / "m.bin"
    store = _history_with(path, [1, 2, 3, 4, 5])
    before = path.read_bytes()
    import edgespec.adaptive.history as history

    real = history.os.replace
    monkeypatch.setattr(history.os, "replace", lambda *a: (_ for _ in ()).throw(OSError(errno.ENOSPC, "full")))
    with caplog.at_level(logging.WARNING, logger="edgespec"):
        store.add([6, 7, 8, 9])  # no exception: history is only a hint
    monkeypatch.setattr(history.os, "replace", real)
    assert "full" in caplog.text and path.read_bytes() == before and _temps(path.parent) == []
    assert store.documents == 2  # still kept in memory
