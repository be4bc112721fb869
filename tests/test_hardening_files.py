"""Saved sessions and prompt caches whose header was edited (the header's own checksum; counts
bounded by what the tensor data holds), and mode cascade given a drafter kind it cannot use
(refused by name before any calibration)."""

from __future__ import annotations

import hashlib
import json
import struct

import pytest
from test_dflash import VERIFIER, two_way_head, write_random  # noqa: F401
from test_sessions import chat, engine

from edgespec.caches import sessions


def digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def edit_info(path, change) -> None:
    """Rewrite the edgespec header (`change(info)` edits it in place), tensor data untouched."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    head = json.loads(raw[8:8 + n])
    info = json.loads(head["__metadata__"]["info"])
    change(info)
    head["__metadata__"]["info"] = json.dumps(info)
    text = json.dumps(head).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n:])


def saved_session(tmp_path):
    path = tmp_path / "talk.session"
    c, _ = chat(engine())
    for line in ["abc", "de fg"]:
        c.reply(line)
    c.save(str(path))
    return path


def saved_prompt(tmp_path, system="Answer briefly, in letters only. " * 3):
    e = engine()
    ids = e.encode_prompt(system)
    e.generate(ids, max_tokens=1, mode="plain")
    path = tmp_path / "sys.cache"
    sessions.save(e, path, ids, {"kind": "prompt", "system": system})
    return path


# ------------------------------------------------------------------ 4: a session's header
def test_a_session_header_edited_to_list_many_messages_is_refused_by_name_and_kept(tmp_path):
    path = saved_session(tmp_path)
    edit_info(path, lambda i: i["extra"].__setitem__("messages", i["extra"]["messages"] * 50_000))
    before = digest(path)
    with pytest.raises(sessions.SessionFileError, match=f"{path} is damaged.*header"):
        sessions.load(engine(), path)
    c, err = chat(engine())
    c.handle(f"/load {path}")
    assert "damaged" in err.getvalue() and c.history == []
    assert digest(path) == before


# ------------------------------------------------------------------ 5: a prompt cache's header
def test_one_byte_flipped_in_a_prompt_caches_system_text_is_refused(tmp_path):
    path = saved_prompt(tmp_path)
    raw = path.read_bytes()
    assert raw.count(b"briefly") >= 1
    i = raw.index(b"briefly")
    path.write_bytes(raw[:i + 1] + b"s" + raw[i + 2:])  # "briefly" -> "bsiefly", same size
    before = digest(path)
    with pytest.raises(sessions.SessionFileError, match=f"{path} is damaged.*header"):
        sessions.load(engine(), path, pin=True)
    assert digest(path) == before


def test_counts_in_a_header_are_bounded_by_the_tensor_data(tmp_path):
    """A header whose checksum was recomputed (as a careful forger would) still cannot claim
    more blocks, positions or messages than the tensors and tokens hold."""
    for change in (lambda i: i.__setitem__("blocks", 10 ** 6), lambda i: i.__setitem__("positions", 10 ** 6),
                   lambda i: i.__setitem__("blocks", -1), lambda i: i.__setitem__("tokens", "x"),
                   lambda i: i["extra"].__setitem__("messages", [{"role": "user", "content": "a"}] * 10 ** 5)):
        path = saved_session(tmp_path)

        def forged(info, change=change):
            change(info)
            info["header"] = sessions.header_checksum(info)

        edit_info(path, forged)
        with pytest.raises(sessions.SessionFileError, match=f"{path} is damaged"):
            sessions.load(engine(), path)
        path.unlink()


def test_an_intact_file_still_loads_and_a_damaged_one_can_be_saved_over(tmp_path):
    path = saved_session(tmp_path)
    tokens, extra, n = sessions.load(engine(), path)
    assert n > 0 and extra["messages"]
    edit_info(path, lambda i: i.__setitem__("positions", 0))
    with pytest.raises(sessions.SessionFileError):
        sessions.load(engine(), path)
    assert sessions.check_destination(path) == path  # edgespec's own damaged file: saving again replaces it


# ------------------------------------------------------------------ 6: cascade with a drafter it cannot use
@pytest.fixture(scope="module")
def dflash_engine(tmp_path_factory):
    from conftest import write_tiny_hf_folder

    import edgespec

    root = tmp_path_factory.mktemp("cascade_dflash")
    verifier = two_way_head(write_tiny_hf_folder(root / "hf", seed=3, **VERIFIER))
    return edgespec.load(str(verifier), drafter=str(write_random(root / "dflash")), progress=False, history="off")


def test_cascade_refuses_a_dflash_drafter_by_name_before_any_calibration(dflash_engine, monkeypatch, tmp_path):
    from edgespec.errors import EdgespecError
    from edgespec.modes import cascade, make_mode
    from edgespec.options import GenerateOptions

    calls = []
    # a shipped drafter at hand (the case that put one in silently) and no loading of any
    monkeypatch.setattr(cascade, "shipped_drafter_path", lambda e: tmp_path, raising=False)
    monkeypatch.setattr(cascade, "load_drafter", lambda e, p: calls.append(("load", p)), raising=False)
    monkeypatch.setattr("edgespec.drafters.registry.shipped_drafter_path", lambda e: tmp_path)
    monkeypatch.setattr(cascade, "self_drafter", lambda e: calls.append("calibrate"))
    with pytest.raises(EdgespecError, match="cascade.*dflash"):
        make_mode("cascade", dflash_engine, GenerateOptions(mode="cascade"))
    assert calls == []


@pytest.mark.parametrize("edit", ["layer out of range", "value edited", "not sealed"])
def test_a_self_speculation_skip_set_read_back_is_checked(tmp_path, monkeypatch, edit):
    """The skip set kept per model ($EDGESPEC_HOME/self_spec) is sealed: an edited one, or one
    naming a layer the model has not, is searched again (never indexed into the model)."""
    from conftest import make_tiny_engine

    from edgespec import sealed
    from edgespec.drafters import self_spec

    monkeypatch.setenv("EDGESPEC_HOME", str(tmp_path))
    engine = make_tiny_engine(0)
    loaded = engine.loaded
    n = len(loaded.model.layers)
    monkeypatch.setattr(self_spec, "model_key", lambda _: "ab" * 32)
    searched = []
    monkeypatch.setattr(self_spec, "search_skip_layers",
                        lambda *a, **k: searched.append(1) or {"keep": list(range(n - 1)), "acceptance": 0.5})
    good = self_spec.skip_set_for(loaded, progress=False)
    assert searched == [1] and good["keep"] == list(range(n - 1))
    assert self_spec.skip_set_for(loaded, progress=False) == good and searched == [1]  # read back
    f = self_spec._cache_file("ab" * 32)
    data = json.loads(f.read_text())
    if edit == "layer out of range":
        data = sealed.seal({**data, "keep": [0, n + 5]})
    elif edit == "value edited":
        data["acceptance"] = 0.99
    else:
        data = {k: v for k, v in data.items() if k != "sha256"}
    f.write_text(json.dumps(data))
    assert self_spec.skip_set_for(loaded, progress=False)["keep"] == list(range(n - 1))
    assert searched == [1, 1]
