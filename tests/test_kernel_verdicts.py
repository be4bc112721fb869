"""The verdict store: one check per (kernel, variant, machine), kept on disk with a checksum."""

from __future__ import annotations

import json

import pytest

from edgespec.kernels import verdicts
from edgespec.kernels.verdicts import Verdict


@pytest.fixture
def store(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGESPEC_HOME", str(tmp_path / "home"))
    verdicts.forget()
    yield tmp_path / "home" / "kernels" / "verdicts.json"
    verdicts.forget()


def test_decide_checks_once_and_keeps_it(store):
    calls = []

    def check():
        calls.append(1)
        return Verdict("k", "f16", "native", "agrees")

    assert verdicts.decide("k", "f16", check).used
    assert verdicts.decide("k", "f16", check).used
    assert len(calls) == 1
    verdicts.forget()  # a new process reads the file
    assert verdicts.get("k", "f16") == Verdict("k", "f16", "native", "agrees")
    assert verdicts.decide("k", "f16", check).used and len(calls) == 1


def test_a_failing_check_is_a_fallback_naming_the_error(store):
    def check():
        raise RuntimeError("shader compile failed: line 3\nmore")

    v = verdicts.decide("k", "", check)
    assert v.status == "fallback" and not v.used
    assert v.note == "RuntimeError: shader compile failed: line 3"


def test_damaged_or_foreign_file_is_checked_afresh_and_not_trusted(store):
    verdicts.put(Verdict("k", "", "native"))
    data = json.loads(store.read_text())
    data["entries"]["k|"]["status"] = "slower"  # edited without the checksum
    store.write_text(json.dumps(data))
    verdicts.forget()
    assert verdicts.get("k") is None
    data = json.loads(store.read_text())
    data["entries"]["k|"]["status"] = "native"
    data["sha256"] = verdicts._digest(data["entries"])
    data["scope"]["cpu"] = "another CPU"
    store.write_text(json.dumps(data))
    verdicts.forget()
    assert verdicts.get("k") is None


def test_flags_override_changes_the_scope(store, monkeypatch):
    verdicts.put(Verdict("k", "", "native"))
    monkeypatch.setenv("EDGESPEC_CPU_FLAGS", "avx2 fma")
    verdicts.forget()
    assert verdicts.scope()["flags"] == ["avx2", "fma"]
    assert verdicts.get("k") is None


def test_a_symlink_in_place_of_the_file_is_not_written_through(store, tmp_path):
    target = tmp_path / "elsewhere.json"
    target.write_text("mine")
    store.parent.mkdir(parents=True)
    store.symlink_to(target)
    assert verdicts.put(Verdict("k", "", "native")) is False
    assert target.read_text() == "mine"
    assert verdicts.get("k").used  # still holds for this process
