"""The default model is fetched and converted by one process at a time: a second process (the
suite's parallel workers, two `edgespec` commands started together) waits for the first and
uses what it wrote instead of writing the same files at once (edgespec.paths.held)."""

from __future__ import annotations

import threading

from edgespec.paths import held


def _start(fn) -> tuple[threading.Thread, list]:
    out: list = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t.start()
    return t, out


def test_a_fetch_waits_for_the_one_in_progress_and_uses_its_file(tmp_path, monkeypatch):
    import edgespec.weights.default_model as dm

    monkeypatch.setenv("EDGESPEC_HOME", str(tmp_path))
    fetched = []
    monkeypatch.setattr(dm, "_fetch", lambda target, progress: fetched.append(target))
    target = tmp_path / "downloads" / dm.GGUF_NAME
    lock = held(target)
    with lock:  # "another process" is fetching
        t, out = _start(lambda: dm.default_gguf_path(progress=False))
        t.join(0.3)
        assert t.is_alive()  # it waits for the lock: no second download into the same files
        target.write_bytes(b"GGUF written by the first process")
    t.join(10)
    assert out == [target] and fetched == []  # it found the file made, and fetched nothing


def test_a_fetch_with_no_one_else_fetches_under_the_lock(tmp_path, monkeypatch):
    import edgespec.weights.default_model as dm

    monkeypatch.setenv("EDGESPEC_HOME", str(tmp_path))
    target = tmp_path / "downloads" / dm.GGUF_NAME
    calls = []
    monkeypatch.setattr(dm, "_fetch", lambda t, progress: (calls.append(t), t.write_bytes(b"x")))
    assert dm.default_gguf_path(progress=False) == target and calls == [target]
    assert dm.default_gguf_path(progress=False) == target and calls == [target]  # once


def test_a_conversion_waits_for_the_one_in_progress_and_uses_its_bundle(tmp_path, monkeypatch):
    import edgespec.converters.default_model as cdm

    monkeypatch.setenv("EDGESPEC_HOME", str(tmp_path))
    out_dir = tmp_path / "bundle"
    converted = []
    monkeypatch.setattr(cdm, "default_bundle_dir", lambda: out_dir)
    monkeypatch.setattr(cdm, "default_gguf_path", lambda progress=True: tmp_path / "model.gguf")
    monkeypatch.setattr(cdm, "convert", lambda *a, **k: converted.append(a))
    with held(out_dir):
        t, out = _start(lambda: cdm.default_bundle_path(progress=False))
        t.join(0.3)
        assert t.is_alive()
        out_dir.mkdir()
        (out_dir / "manifest.json").write_text("{}")
    t.join(10)
    assert out == [out_dir] and converted == []
