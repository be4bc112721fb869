"""The history store: suffix look-ups over earlier generations, bounded, thread-safe, memory or disk."""

from __future__ import annotations

import random
import threading
import tracemalloc

import pytest

from edgespec.adaptive.history import HistoryStore, history_mode, make_history


def test_longest_match_wins_and_never_crosses_documents():
    h = HistoryStore()
    h.add([1, 2, 3, 4, 5, 6])
    h.add([9, 3, 4, 7, 8])
    # "3 4" ends both documents' n-grams: the longer context "2 3 4" picks the first one.
    assert h.lookup([0, 2, 3, 4], limit=1, span=3) == [(3, [5, 6])]
    n, cont = h.lookup([0, 9, 3, 4], limit=1, span=5)[0]
    assert n == 3 and cont == [7, 8]  # stops at the document's end
    assert h.lookup([42, 43], limit=2) == []
    assert h.lookup([1], limit=2) == []  # shorter than the shortest indexed n-gram


def test_most_frequent_continuation_first_then_most_recent():
    h = HistoryStore()
    for tail in ([7, 7], [8, 8], [8, 8], [9, 9]):
        h.add([1, 2, 3] + tail)
    out = h.lookup([5, 2, 3], limit=3, span=2)
    assert [c for _, c in out] == [[8, 8], [9, 9], [7, 7]]


def test_memory_stays_under_the_cap_and_oldest_documents_go_first():
    cap = 256 * 1024
    h = HistoryStore(max_bytes=cap)
    rng = random.Random(0)
    docs = [[rng.randrange(1000) for _ in range(200)] for _ in range(60)]
    for d in docs:
        h.add(d)
        assert h.nbytes <= cap
    assert 0 < h.documents < 60
    assert h.lookup(docs[-1][:50], limit=1)[0][1][0] == docs[-1][50]  # the newest is kept
    assert h.lookup(docs[0][:50], limit=1) == []  # the oldest was dropped


def test_estimated_size_is_not_below_what_python_really_holds():
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    h = HistoryStore()
    rng = random.Random(1)
    for _ in range(30):
        h.add([rng.randrange(50000) for _ in range(300)])
    real = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert real <= 1.2 * h.nbytes, (real, h.nbytes)


def test_concurrent_adds_and_lookups():
    h = HistoryStore(max_bytes=512 * 1024)
    errors = []

    def writer(seed):
        rng = random.Random(seed)
        try:
            for _ in range(40):
                h.add([rng.randrange(100) for _ in range(50)])
        except BaseException as e:
            errors.append(e)

    def reader(seed):
        rng = random.Random(seed)
        try:
            for _ in range(400):
                for n, cont in h.lookup([rng.randrange(100) for _ in range(6)], limit=2, span=4):
                    assert 2 <= n <= 12 and 1 <= len(cont) <= 4
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=f, args=(i,)) for i, f in enumerate([writer, writer, reader, reader])]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and h.nbytes <= 512 * 1024


def test_disk_mode_persists_under_edgespec_home_and_memory_mode_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGESPEC_HOME", str(tmp_path))
    mem = make_history("memory", "model-a")
    mem.add([1, 2, 3, 4])
    assert not (tmp_path / "history").exists()
    disk = make_history("disk", "model-a")
    disk.add([1, 2, 3, 4, 5])
    files = list((tmp_path / "history").iterdir())
    assert [f.name for f in files] == ["model-a.bin"]
    again = make_history("disk", "model-a")  # a new process
    assert again.lookup([0, 2, 3], limit=1) == [(2, [4, 5])]
    assert make_history("disk", "model-b").documents == 0  # per model
    files[0].write_bytes(b"garbage")  # a damaged file is ignored, not fatal
    assert make_history("disk", "model-a").documents == 0
    again.clear()
    assert not files[0].exists()
    assert make_history("off", "model-a") is None


def test_history_setting_is_validated(monkeypatch):
    monkeypatch.delenv("EDGESPEC_HISTORY", raising=False)
    assert history_mode(None) == "memory"
    monkeypatch.setenv("EDGESPEC_HISTORY", "DISK")
    assert history_mode(None) == "disk"
    with pytest.raises(ValueError, match="history must be one of"):
        history_mode("cloud")
    with pytest.raises(ValueError, match="at least 64 KiB"):
        HistoryStore(max_bytes=1000)
