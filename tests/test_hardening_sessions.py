"""Saved sessions are never silently wrong or lost (#43, findings 5 and 6).

A file whose header is intact but whose cached keys and values were overwritten is
refused (by /load, --session and the prompt-cache loader) naming the file, and left as it
is; where a session or a prompt cache will be written is checked before the work (a
folder that cannot be written, a foreign file), a symlink is written through, and a save
that still fails at exit goes to a new file, said where."""

from __future__ import annotations

import hashlib
import os
import struct

import pytest
from test_sessions import bundle, chat, engine, run_cli  # noqa: F401 -- bundle is a fixture

from edgespec.caches import sessions

ROOT = os.geteuid() == 0  # root writes into read-only folders: those cases need another user


def saved(tmp_path, name="talk.session"):
    path = tmp_path / name
    c, _ = chat(engine())
    for line in ["abc", "de fg"]:
        c.reply(line)
    c.save(str(path))
    return path


def damage_values(path) -> None:
    """Overwrite the middle of the tensor data, header untouched, size unchanged."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    start = 8 + n
    mid = start + (len(raw) - start) // 2
    path.write_bytes(raw[:mid] + bytes([0x7B]) * 64 + raw[mid + 64:])


def digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_overwritten_values_are_refused_naming_the_file_and_left_as_is(tmp_path):
    path = saved(tmp_path)
    sessions.read_header(path)  # intact header
    damage_values(path)
    before = digest(path)
    with pytest.raises(sessions.SessionFileError, match=f"{path} is damaged.*checksum"):
        sessions.load(engine(), path)
    c, err = chat(engine())
    c.handle(f"/load {path}")
    assert "checksum" in err.getvalue() and c.history == []
    assert digest(path) == before and os.listdir(tmp_path) == [path.name]


def test_session_and_prompt_cache_refuse_a_damaged_file_in_the_cli(bundle, tmp_path):  # noqa: F811
    session = tmp_path / "s.session"
    r = run_cli(["chat", "--model", str(bundle), "--session", str(session)], stdin="abc\n")
    assert r.returncode == 0, r.stderr
    damage_values(session)
    before = digest(session)
    for args in (["chat", "--session", str(session)], ["chat", "--prompt-cache", str(session)]):
        r = run_cli([*args, "--model", str(bundle)], stdin="abc\n")
        assert r.returncode != 0 and str(session) in r.stderr and "checksum" in r.stderr, r.stderr
        assert "Traceback" not in r.stderr
    assert digest(session) == before  # not saved back over, not moved


def test_a_destination_that_cannot_be_written_is_refused_before_the_model_loads(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("mine")
    nowhere = tmp_path / "no-model"  # the model never loads: the destination is refused first
    for args in (["chat", "--session", str(blocker / "s.session")],
                 ["cache-prompt", "--system-file", str(blocker), "--out", str(blocker / "c.cache")],
                 ["chat", "--session", str(blocker)]):  # a foreign file
        r = run_cli([*args, "--model", str(nowhere)], stdin="abc\n")
        assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
        assert "not a folder" in r.stderr or "not a cache edgespec saved" in r.stderr, r.stderr
        assert str(nowhere) not in r.stderr
    assert blocker.read_text() == "mine"


@pytest.mark.skipif(ROOT, reason="root can write into a read-only folder")
def test_a_read_only_folder_is_refused_before_the_prefill(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    system = tmp_path / "system.txt"
    system.write_text("be brief")
    ro.chmod(0o500)
    try:
        for args in (["chat", "--session", str(ro / "s.session")],
                     ["cache-prompt", "--system-file", str(system), "--out", str(ro / "c.cache")]):
            r = run_cli([*args, "--model", str(tmp_path / "no-model")], stdin="abc\n")
            assert r.returncode != 0 and "is not writable" in r.stderr, r.stderr
    finally:
        ro.chmod(0o700)


def test_a_symlinked_session_is_written_through_and_read_back(tmp_path):
    (tmp_path / "real").mkdir()
    target = tmp_path / "real" / "talk.session"
    link = tmp_path / "link.session"
    link.symlink_to(target)  # dangling until the first save
    assert sessions.check_destination(link) == target
    c, _ = chat(engine())
    c.reply("abc")
    c.save_at_exit(str(link))
    assert link.is_symlink() and sessions.read_header(target)["extra"]["kind"] == "chat"
    d, _ = chat(engine())
    d.load(str(link))
    assert d.history == c.history


def test_a_save_that_fails_at_exit_goes_beside_or_home_and_says_where(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGESPEC_HOME", str(tmp_path / "home"))
    path = tmp_path / "talk.session"
    c, err = chat(engine())
    c.reply("abc")
    path.write_text("someone else's file, put there during the chat")
    c.save_at_exit(str(path))
    assert path.read_text().startswith("someone else's")  # never replaced
    beside = [p for p in tmp_path.iterdir() if p.name.startswith("talk.session-")]
    assert len(beside) == 1
    assert f"could not save to {path}" in err.getvalue() and str(beside[0]) in err.getvalue()
    d, _ = chat(engine())
    d.load(str(beside[0]))
    assert d.history == c.history


@pytest.mark.skipif(ROOT, reason="root can write into a read-only folder")
def test_a_folder_made_read_only_during_the_chat_saves_under_edgespec_home(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGESPEC_HOME", str(tmp_path / "home"))
    folder = tmp_path / "chats"
    folder.mkdir()
    c, err = chat(engine())
    c.reply("abc")
    folder.chmod(0o500)
    try:
        c.save_at_exit(str(folder / "talk.session"))
    finally:
        folder.chmod(0o700)
    kept = list((tmp_path / "home" / "sessions").iterdir())
    assert len(kept) == 1 and str(kept[0]) in err.getvalue()


def test_files_of_the_previous_format_without_checksum_are_refused_by_version(tmp_path, monkeypatch):
    monkeypatch.setattr(sessions, "VERSION", 1)
    path = saved(tmp_path)
    monkeypatch.setattr(sessions, "VERSION", 2)
    with pytest.raises(sessions.SessionFileError, match="another edgespec version"):
        sessions.load(engine(), path)
