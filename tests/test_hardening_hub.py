"""Hostile and careless inputs to models stored by hub name: a hub answering a commit or file
names that climb out of the cache, an edited record, a name too long for the file system, two
GGUF files of one quant, a mistyped local path. Against the local stand-in hub (hub_support),
with a throwaway HOME, HF_HOME and EDGESPEC_HOME, and canary files outside the cache checked
untouched after every `rm` and `pull`."""

from __future__ import annotations

import asyncio
import json
import os
import random
from pathlib import Path

import pytest
from hub_support import Hub, Repo, start_hub

from edgespec.cli import main
from edgespec.hub import fetch, manage, store
from edgespec.hub.fetch import HubError, pull
from edgespec.hub.names import BadNameError, as_hub_name, check_spec, parse
from edgespec.hub.select import NothingRunnableError, select

EVIL = "evil/model"
GOOD_SHA = "a" * 40


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("evilhub")
    (root / "a.Q4_K_M.gguf").write_bytes(b"GGUF" + b"\1" * 60)
    (root / "b.Q4_K_M.gguf").write_bytes(b"GGUF" + b"\2" * 60)
    (root / "c.Q8_0.gguf").write_bytes(b"GGUF" + b"\3" * 30)
    return root


@pytest.fixture(scope="module")
def hub():
    h = Hub({})
    server = start_hub(h)
    yield h
    server.shutdown()


@pytest.fixture(autouse=True)
def env(hub, tmp_path, monkeypatch):
    for var in ("HF_HUB_CACHE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN",
                "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("EDGESPEC_HOME", str(tmp_path / "es"))
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    (tmp_path / "es").mkdir()
    (tmp_path / "home").mkdir()
    (tmp_path / "es" / "hub_drafters.json").write_text(json.dumps({
        "format": "edgespec-drafter-pairs", "version": 1, "pairs": []}))
    hub.repos.clear()
    hub.reset()
    return tmp_path


def canaries(root: Path) -> dict[str, tuple[bytes, int]]:
    """Canary files outside the cache (one of the very name and size the hub offers)."""
    c = root / "canary"
    (c / "x").mkdir(parents=True, exist_ok=True)
    (c / "a.Q4_K_M.gguf").write_bytes(b"GGUF" + b"\1" * 60)
    (c / "x" / "victim.gguf").write_bytes(b"mine, not the hub's")
    (root / "home" / "notes.txt").write_text("keep me")
    return snapshot_tree(root, skip=("hf", "es"))


def snapshot_tree(root: Path, skip=()) -> dict[str, tuple[bytes, int]]:
    out = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root)
        if rel.parts and rel.parts[0] in skip:
            continue
        if p.is_file() and not p.is_symlink():
            out[rel.as_posix()] = (p.read_bytes(), p.stat().st_mtime_ns)
    return out


def serve(hub, files, sha=GOOD_SHA, names=("a.Q4_K_M.gguf",), listing=None):
    hub.repos[EVIL] = Repo({n: files / n for n in names}, sha=sha, listing=listing)


# ------------------------------------------------------------------ 1: a hub's commit decides what rm deletes
def test_a_commit_that_climbs_out_of_the_cache_is_refused_at_pull_and_rm_deletes_only_the_cache(hub, files, env,
                                                                                                 capsys):
    before = canaries(env)
    serve(hub, files)
    first = pull(f"{EVIL}:Q4_K_M")
    assert first.commit == GOOD_SHA and first.path.is_file()
    serve(hub, files, sha="../../../../canary")  # from snapshots/<commit>/ up to tmp_path/canary
    hub.reset()
    with pytest.raises(HubError, match="not 40 hex digits"):
        pull(f"{EVIL}:Q4_K_M")
    assert main(["pull", f"{EVIL}:Q4_K_M", "--quiet"]) == 1
    err = capsys.readouterr().err
    assert "not 40 hex digits" in err and len(err.strip().splitlines()) == 1
    assert hub.downloads() == []
    assert store.read_record(parse(f"{EVIL}:Q4_K_M"))["commit"] == GOOD_SHA  # the record is the first pull's
    assert main(["rm", f"{EVIL}:Q4_K_M", "--yes"]) == 0
    assert snapshot_tree(env, skip=("hf", "es")) == before
    assert not list((env / "hf" / "hub").rglob("*.gguf"))


def test_a_commit_from_the_hub_that_is_not_hex_is_refused(hub, files):
    for sha in ("main", "A" * 40, "a" * 39, "a" * 41, "/" + "a" * 39, "a" * 40 + "\n"):
        serve(hub, files, sha=sha)
        with pytest.raises(HubError, match="not 40 hex digits"):
            pull(f"{EVIL}:Q4_K_M")


# ------------------------------------------------------------------ 2: an edited record decides what rm deletes
def test_a_record_naming_a_file_outside_its_snapshot_is_refused_by_rm_and_nothing_is_deleted(hub, files, env,
                                                                                             capsys):
    before = canaries(env)
    serve(hub, files)
    pull(f"{EVIL}:Q4_K_M")
    name = parse(f"{EVIL}:Q4_K_M")
    rec_path = store.record_path(name)
    rec = json.loads(rec_path.read_text())
    rec["files"] = ["a.Q4_K_M.gguf", "../../../../../canary/x/victim.gguf"]
    rec_path.write_text(json.dumps(rec))
    cache_before = snapshot_tree(env / "hf")
    assert main(["rm", f"{EVIL}:Q4_K_M", "--yes"]) == 1
    err = capsys.readouterr().err
    assert "outside" in err and "nothing removed" in err and len(err.strip().splitlines()) == 1
    assert snapshot_tree(env, skip=("hf", "es")) == before
    assert snapshot_tree(env / "hf") == cache_before and rec_path.is_file()  # nothing of it deleted
    assert not manage.find(f"{EVIL}:Q4_K_M").complete  # listed as damaged, not served
    assert fetch.locate(name) is None  # nothing of a damaged record is read


@pytest.mark.parametrize("files_field", [["/abs/victim.gguf"], ["sub/../../x.gguf"], "a.Q4_K_M.gguf", [7],
                                         ["a.Q4_K_M.gguf\0"], ["link/a.gguf"]])
def test_records_with_hostile_files_or_links_delete_nothing_outside(hub, files, env, files_field):
    before = canaries(env)
    serve(hub, files)
    pull(f"{EVIL}:Q4_K_M")
    snap = store.snapshot(EVIL, GOOD_SHA)
    (snap / "link").symlink_to(env / "canary")  # a folder link in the snapshot that leads out
    (snap / "out.gguf").symlink_to(env / "canary" / "a.Q4_K_M.gguf")
    rec_path = store.record_path(parse(f"{EVIL}:Q4_K_M"))
    rec = json.loads(rec_path.read_text())
    rec["files"] = files_field
    rec_path.write_text(json.dumps(rec))
    assert main(["rm", f"{EVIL}:Q4_K_M", "--yes"]) == 1
    assert main(["list"]) == 0
    assert snapshot_tree(env, skip=("hf", "es")) == before


def test_a_snapshot_link_leading_out_of_the_cache_is_not_taken_as_cached(hub, files, env):
    before = canaries(env)
    serve(hub, files)
    folder = store.snapshot(EVIL, GOOD_SHA)
    folder.mkdir(parents=True)
    (folder / "a.Q4_K_M.gguf").symlink_to(env / "canary" / "a.Q4_K_M.gguf")
    with pytest.raises(HubError, match="outside"):
        pull(f"{EVIL}:Q4_K_M")
    assert fetch.locate(parse(f"{EVIL}:Q4_K_M")) is None
    assert snapshot_tree(env, skip=("hf", "es")) == before


# ------------------------------------------------------------------ 3: a name too long for the file system
@pytest.mark.parametrize("spec", ["a" * 5000, "org/" + "n" * 5000, "x/" * 3000, "org/na\nme", "org/na\0me"])
def test_a_model_name_too_long_or_with_control_characters_is_one_line(spec, capsys):
    with pytest.raises(BadNameError):
        check_spec(spec)
    with pytest.raises(BadNameError):
        as_hub_name(spec)
    assert main(["generate", "--model", spec, "--prompt", "hi", "--max-tokens", "1"]) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err and len(err) < 400


def test_the_server_answers_a_too_long_model_name_with_a_400():
    from edgespec.apps.server.shelf import ModelShelf

    async def primary(scope, receive, send):
        raise AssertionError("the served model's app is not reached")

    shelf = ModelShelf(primary, ("served",), lambda n: None, None, 1 << 20)
    for model in ("m" * 5000, "org/" + "n" * 300, "org/a\tb"):
        body = json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}]}).encode()
        sent = []

        async def receive(body=body):
            return {"type": "http.request", "body": body, "more_body": False}

        async def send(msg, sent=sent):
            sent.append(msg)

        scope = {"type": "http", "path": "/v1/chat/completions", "method": "POST", "headers": []}
        asyncio.run(shelf(scope, receive, send))
        assert sent[0]["status"] == 400
        msg = json.loads(sent[1]["body"])["error"]["message"]
        assert "\n" not in msg and len(msg) < 300 and "model" in msg


# ------------------------------------------------------------------ 7: ambiguous quant, mistyped local path
def test_two_gguf_files_of_one_quant_are_listed_and_one_is_asked_for(hub, files):
    ggufs = ["a.Q4_K_M.gguf", "b.Q4_K_M.gguf", "c.Q8_0.gguf"]
    with pytest.raises(NothingRunnableError, match=r"2 GGUF files tagged Q4_K_M: a.Q4_K_M.gguf, b.Q4_K_M.gguf"):
        select(ggufs, "Q4_K_M", "evil/model")
    with pytest.raises(NothingRunnableError, match="a.Q4_K_M.gguf, b.Q4_K_M.gguf"):
        select(ggufs)  # the default quant is ambiguous too
    assert select(ggufs, "b.Q4_K_M").gguf == "b.Q4_K_M.gguf"  # a file's own name picks it
    assert select(ggufs, "Q8_0").gguf == "c.Q8_0.gguf"
    serve(hub, files, names=tuple(ggufs))
    with pytest.raises(NothingRunnableError, match="name one"):
        pull(f"{EVIL}:Q4_K_M")
    assert hub.downloads() == []
    assert pull(f"{EVIL}:b.Q4_K_M").path.name == "b.Q4_K_M.gguf"


def test_a_local_looking_path_is_never_sent_to_the_hub(hub, files, env, monkeypatch, capsys):
    (env / "work" / "drafters").mkdir(parents=True)
    monkeypatch.chdir(env / "work")
    assert as_hub_name("drafters/dflsh") is None  # its folder exists: a mistyped path
    assert as_hub_name("./org/name") is None and as_hub_name("~/org/name") is None
    assert as_hub_name("evil/model") == parse("evil/model")
    from edgespec.hub.names import local_path_error

    assert "drafters/dflsh" in local_path_error("drafters/dflsh")
    assert local_path_error("evil/model") is None
    assert main(["generate", "--model", "drafters/dflsh", "--prompt", "hi", "--max-tokens", "1"]) == 1
    err = capsys.readouterr().err
    assert "no such file or folder" in err and len(err.strip().splitlines()) == 1
    import edgespec
    from edgespec.errors import ModelLoadError

    with pytest.raises(ModelLoadError, match="drafter drafters/dflsh: no such file or folder"):
        edgespec.load(None, drafter="drafters/dflsh", progress=False)  # refused before any model loads
    assert hub.requests == []


# ------------------------------------------------------------------ fuzz: rm and pull against a hostile hub
_NAMES = ["..", "../x.gguf", "../../../../canary/a.Q4_K_M.gguf", "/etc/passwd.gguf", "/tmp/a.Q4_K_M.gguf",
          "sub/../../a.Q4_K_M.gguf", "link/a.gguf", "\u00e9t\u00e9-Q4_K_M.gguf", "\u202ertl.Q4_K_M.gguf",
          "x" * 300 + ".Q4_K_M.gguf", "a.Q4_K_M.gguf", "a\\..\\b.Q4_K_M.gguf", "dir/" * 40 + "d.Q4_K_M.gguf",
          "config.json", ".", "./a.Q4_K_M.gguf", "a.Q4_K_M.gguf/..", "nul\0.Q4_K_M.gguf"]
_COMMITS = [GOOD_SHA, "b" * 40, "../../../../canary", "..", "/tmp", "a" * 39 + "/", "", "\u00e9" * 40,
            "c" * 4000, "../" * 10 + "canary", "d" * 40]


def test_fuzz_rm_and_pull_touch_nothing_outside_the_cache(hub, files, env, capsys):
    rng = random.Random(62)
    before = canaries(env)
    codes = []
    for _ in range(40):
        listing = {n: rng.choice([64, 64, 64, 10 ** 12]) for n in rng.sample(_NAMES, rng.randint(0, 3))}
        sha = rng.choice([GOOD_SHA, "b" * 40]) if rng.random() < 0.5 else rng.choice(_COMMITS)
        serve(hub, files, sha=sha, names=("a.Q4_K_M.gguf", "c.Q8_0.gguf") if rng.random() < 0.8 else (),
              listing=listing)
        snap = store.snapshot(EVIL, rng.choice([GOOD_SHA, "b" * 40]))
        if rng.random() < 0.25:  # a link the hub cache did not make, inside the snapshot
            snap.mkdir(parents=True, exist_ok=True)
            target = rng.choice([env / "canary", env / "canary" / "a.Q4_K_M.gguf", env / "home"])
            link = snap / rng.choice(["link", "a.Q4_K_M.gguf", "out.gguf"])
            if not os.path.lexists(link):
                link.symlink_to(target)
        quant = rng.choice(["Q4_K_M", "a.Q4_K_M", "Q8_0", None])
        spec = EVIL + (f":{quant}" if quant else "")
        codes.append(("pull", main(["pull", spec, "--quiet"])))
        if rng.random() < 0.3:  # a record edited by hand, or by someone else
            recs = list((env / "es" / "hub").glob("*.json")) if (env / "es" / "hub").is_dir() else []
            if recs:
                rec = json.loads(recs[0].read_text())
                rec[rng.choice(["files", "commit", "repo_id", "name"])] = rng.choice(
                    [[rng.choice(_NAMES)], rng.choice(_COMMITS), "../../x", None, 5, ["a.Q4_K_M.gguf"] * 2])
                recs[0].write_text(json.dumps(rec))
        assert main(["list"]) == 0
        for s in rng.sample([spec, EVIL, f"{EVIL}:Q4_K_M", f"{EVIL}:Q8_0"], 2):
            codes.append(("rm", main(["rm", s, "--yes"])))
        err = capsys.readouterr().err
        assert "Traceback" not in err and all(len(line) < 2000 for line in err.splitlines())
        assert snapshot_tree(env, skip=("hf", "es")) == before
    assert {c for _, c in codes} <= {0, 1} and len(codes) == 120
    # the rounds reach both sides: pulls that store and removals that delete, not only refusals
    assert codes.count(("pull", 0)) >= 5 and codes.count(("rm", 0)) >= 5, codes
