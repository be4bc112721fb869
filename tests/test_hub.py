"""Models by hub name (edgespec.hub), against a local stand-in for the hub's HTTP API (hub_support)
serving real files: tiny random checkpoints, GGUF files of several quant types, a shipped drafter,
a gated repository, repositories holding nothing edgespec runs. Every test has its own HF_HOME and
EDGESPEC_HOME; the server is shared by the module."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from conftest import write_tiny_hf_folder
from gguf import GGMLQuantizationType as Q
from gguf_support import write_llama_gguf
from hub_support import TOKEN, Hub, Repo, start_hub

import edgespec
from edgespec.hub import fetch, manage, store
from edgespec.hub.fetch import DiskSpaceError, HubError, NotStoredError, pull, resolve
from edgespec.hub.names import as_hub_name, parse
from edgespec.hub.pairing import paired_drafter
from edgespec.hub.select import NothingRunnableError, quant_of, select

BIG, SMALL = "tiny/llama-big", "tiny/llama-small"


def _files(folder: Path) -> dict[str, Path]:
    return {p.relative_to(folder).as_posix(): p for p in folder.rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    root = tmp_path_factory.mktemp("hubfiles")
    big = write_tiny_hf_folder(root / "big", seed=0)
    (big / "pytorch_model.bin").write_bytes(b"\0" * 1000)  # another format: never fetched
    (big / "README.md").write_text("# tiny\n")
    small = write_tiny_hf_folder(root / "small", seed=1, num_hidden_layers=1)
    odd = write_tiny_hf_folder(root / "odd", seed=2, num_hidden_layers=1)
    spec = json.loads((odd / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    vocab["b"], vocab["c"] = vocab["c"], vocab["b"]  # same size, another tokenizer
    (odd / "tokenizer.json").write_text(json.dumps(spec))
    shipped = write_tiny_hf_folder(root / "shipped", seed=3)
    write_tiny_hf_folder(shipped / "drafter", seed=4, num_hidden_layers=1)
    gg = root / "gguf"
    gg.mkdir()
    for tag, qtype, seed in (("Q4_0", Q.Q4_0, 5), ("Q8_0", Q.Q8_0, 6), ("F16", Q.F16, 7)):
        write_llama_gguf(gg / f"tiny-{tag}.gguf", seed=seed, default_type=qtype)
    (gg / "README.md").write_text("# gguf\n")
    onnx = root / "onnx"
    (onnx / "onnx").mkdir(parents=True)
    (onnx / "onnx" / "model.onnx").write_bytes(b"onnx" * 10)
    (onnx / "config.json").write_text(json.dumps({"model_type": "bert"}))
    bert = root / "bert"
    bert.mkdir()
    (bert / "config.json").write_text(json.dumps({"model_type": "bert", "vocab_size": 64}))
    (bert / "model.safetensors").write_bytes((big / "model.safetensors").read_bytes())
    h = Hub({
        BIG: Repo(_files(big)), SMALL: Repo(_files(small)), "tiny/odd-small": Repo(_files(odd)),
        "tiny/llama-mismatch": Repo(_files(big), sha="1" * 40),
        "tiny/shipped": Repo(_files(shipped)), "tiny/gguf": Repo(_files(gg)),
        "tiny/gated": Repo(_files(big), sha="2" * 40, gated=True),
        "tiny/onnx-only": Repo(_files(onnx)), "tiny/bert": Repo(_files(bert)),
    })
    server = start_hub(h)
    yield h
    server.shutdown()


@pytest.fixture(autouse=True)
def env(hub, tmp_path, monkeypatch):
    for var in ("HF_HUB_CACHE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("EDGESPEC_HOME", str(tmp_path / "es"))
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    (tmp_path / "es").mkdir()
    (tmp_path / "es" / "hub_drafters.json").write_text(json.dumps({
        "format": "edgespec-drafter-pairs", "version": 1, "pairs": [
            {"family": "tiny", "match": "tiny/llama-big", "drafter": SMALL},
            {"family": "tiny odd", "match": "tiny/llama-mismatch", "drafter": "tiny/odd-small"},
        ]}))
    hub.reset()
    return tmp_path


def _blobs(tmp_path) -> list[Path]:
    return sorted((tmp_path / "hf" / "hub").rglob("blobs/*"))


# ------------------------------------------------------------------ names, file choice, catalog
def test_names_and_paths(tmp_path):
    assert parse("Qwen/Qwen3-0.6B") == parse("Qwen/Qwen3-0.6B@main").__class__("Qwen/Qwen3-0.6B")
    n = parse("ggml-org/gemma-3-1b-it-GGUF@v1.0:Q4_K_M")
    assert (n.repo_id, n.revision, n.quant) == ("ggml-org/gemma-3-1b-it-GGUF", "v1.0", "Q4_K_M")
    assert parse("a/b/c") is None and parse("model.gguf") is None and parse("../x/y") is None
    (tmp_path / "org").mkdir()
    (tmp_path / "org" / "model").mkdir()
    import os

    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        assert as_hub_name("org/model") is None  # a local path that exists wins
        assert as_hub_name("org/other") is None  # its first folder exists here: a (mistyped) path
        assert as_hub_name("elsewhere/other") == parse("elsewhere/other")
    finally:
        os.chdir(cwd)


def test_file_choice():
    ggufs = ["m-Q2_K.gguf", "m-Q4_K_M.gguf", "m-Q8_0.gguf", "mmproj-m-f16.gguf", "README.md"]
    assert select(ggufs).gguf == "m-Q4_K_M.gguf"  # the documented default, as llama.cpp's -hf
    assert select(ggufs[:1] + ggufs[2:]).gguf == "m-Q8_0.gguf"
    assert select(ggufs, "q2_k").gguf == "m-Q2_K.gguf"
    with pytest.raises(NothingRunnableError, match="no GGUF file tagged Q5_K_M; it offers Q2_K, Q4_K_M, Q8_0"):
        select(ggufs, "Q5_K_M")
    st = select(["config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                 "model.safetensors.index.json", "consolidated.safetensors", "pytorch_model.bin", "tokenizer.json",
                 "onnx/model.onnx", "README.md"])
    assert st.kind == "safetensors" and "consolidated.safetensors" not in st.files and "pytorch_model.bin" not in st.files
    assert quant_of("SmolLM2-135M-Instruct.Q4_1.gguf") == "Q4_1" and quant_of("x-IQ4_XS.gguf") == "IQ4_XS"
    with pytest.raises(NothingRunnableError, match=r"only PyTorch pickles \(pytorch_model.bin\)"):
        select(["config.json", "pytorch_model.bin", "README.md"])


def test_catalog_pairs_families():
    assert paired_drafter("Qwen/Qwen3.5-0.8B").drafter == "mtp"  # its own head: nothing to fetch
    assert paired_drafter("google/gemma-4-E2B-it").drafter == "google/gemma-4-E2B-it-assistant"
    assert paired_drafter("Qwen/Qwen3-8B").drafter == "Qwen/Qwen3-0.6B"
    assert paired_drafter("Qwen/Qwen2.5-7B-Instruct").drafter == "Qwen/Qwen2.5-0.5B-Instruct"
    assert paired_drafter("meta-llama/Llama-3.1-8B-Instruct").drafter == "meta-llama/Llama-3.2-1B-Instruct"
    assert paired_drafter("google/gemma-3-4b-it").drafter == "google/gemma-3-270m-it"
    assert paired_drafter("HuggingFaceTB/SmolLM2-1.7B-Instruct").drafter == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert paired_drafter("Qwen/Qwen3-0.6B") is None and paired_drafter("someone/else") is None


# ------------------------------------------------------------------ pull
def test_pull_fetches_what_runs_pairs_the_drafter_and_a_second_pull_fetches_nothing(hub, env):
    local = pull(BIG)
    got = {p.rsplit("/", 1)[-1] for p in hub.downloads()}
    assert "pytorch_model.bin" not in got and "README.md" not in got
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= got
    drafter = local.record["drafter"]
    assert drafter == {"kind": "model", "name": SMALL, "family": "tiny", "verified": True}
    small = sum(f.stat().st_size for f in _files(Path(resolve(SMALL).local.path)).values())
    assert local.fetched + small == sum(hub.served.values())  # bytes reported = bytes served
    hub.reset()
    again = pull(BIG)
    assert again.fetched == 0 and hub.downloads() == [] and again.path == local.path
    rows = {s.name: s for s in manage.stored_models()}
    assert rows[BIG].drafter == SMALL and rows[BIG].kind == "safetensors" and rows[BIG].complete
    assert rows[BIG].size == sum(f.stat().st_size for f in local.path.iterdir() if f.is_file())


def test_pull_by_quant_tag(hub, env):
    local = pull("tiny/gguf:Q4_0")
    assert local.kind == "gguf" and local.path.name == "tiny-Q4_0.gguf"
    assert [p.rsplit("/", 1)[-1] for p in hub.downloads()] == ["tiny-Q4_0.gguf"]
    assert pull("tiny/gguf").path.name == "tiny-Q8_0.gguf"  # no Q4_K_M here: the next default
    with pytest.raises(NothingRunnableError, match="tiny/gguf has no GGUF file tagged Q5_K; it offers F16, Q4_0, Q8_0"):
        pull("tiny/gguf:Q5_K")


def test_resume_after_the_connection_drops_mid_file(hub, env, monkeypatch):
    from huggingface_hub import constants

    # huggingface_hub writes what it received chunk by chunk; cut the connection on a chunk boundary
    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 16384)
    hub.drops[(BIG, "model.safetensors")] = 1
    hub.cut_at = 4 * 16384
    local = pull(BIG, drafter=False)
    size = (local.path / "model.safetensors").stat().st_size
    assert hub.ranges == [("model.safetensors", f"bytes={4 * 16384}-")]  # resumed where the cut was
    assert hub.served[(BIG, "model.safetensors")] == size  # each byte sent once: the half before the cut, then the rest
    assert local.fetched == sum(hub.served.values())
    assert store.read_record(parse(BIG))["files"]


def test_a_download_cut_off_keeps_nothing_partial_and_the_next_pull_completes(hub, env, monkeypatch):
    import huggingface_hub.file_download as fd

    monkeypatch.setattr(fd.time, "sleep", lambda s: None)  # its retries wait a second each
    hub.drops[(BIG, "model.safetensors")] = 99
    with pytest.raises(HubError, match="cut off .* nothing partial is kept as complete"):
        pull(BIG, drafter=False)
    assert store.read_record(parse(BIG)) is None and fetch.locate(parse(BIG)) is None
    assert not [b for b in _blobs(env) if b.name.endswith(".incomplete")]
    snap = next((env / "hf" / "hub").rglob("snapshots/*"))
    assert not (snap / "model.safetensors").exists() and (snap / "config.json").is_file()
    hub.reset()
    pull(BIG, drafter=False)
    again = [p.rsplit("/", 1)[-1] for p in hub.downloads()]
    assert "model.safetensors" in again and "config.json" not in again  # what was complete is kept
    assert fetch.locate(parse(BIG)) is not None


def test_ctrl_c_during_a_pull_leaves_nothing_broken(hub, env, monkeypatch):
    real = fetch._Bytes.update

    def interrupt(self, n=1):
        if n:
            raise KeyboardInterrupt
        real(self, n)

    monkeypatch.setattr(fetch._Bytes, "update", interrupt)
    with pytest.raises(KeyboardInterrupt):
        pull(BIG)
    monkeypatch.setattr(fetch._Bytes, "update", real)
    assert not [b for b in _blobs(env) if b.name.endswith(".incomplete")]
    assert store.read_record(parse(BIG)) is None and manage.stored_models() == []
    assert pull(BIG).record["drafter"]["verified"]


def test_unknown_and_gated_names_say_what_to_do(hub, env, monkeypatch):
    with pytest.raises(HubError, match=r"no model named tiny/nope on the hub \(404"):
        pull("tiny/nope")
    with pytest.raises(HubError, match=r"tiny/gated is gated: accept its license on its page .* \(HF_TOKEN"):
        pull("tiny/gated")
    assert hub.downloads() == []
    monkeypatch.setenv("HF_TOKEN", TOKEN)  # a token opens it
    assert pull("tiny/gated", drafter=False).kind == "safetensors"


def test_repositories_with_nothing_runnable_are_named_before_any_weights(hub, env):
    with pytest.raises(NothingRunnableError, match=r"tiny/onnx-only holds no model edgespec can run: only ONNX"):
        pull("tiny/onnx-only")
    with pytest.raises(NothingRunnableError, match="tiny/bert: unsupported architecture 'bert'"):
        pull("tiny/bert")
    assert not [p for p in hub.downloads() if p.endswith(".safetensors")]  # refused on config.json alone


def test_disk_full_is_refused_with_the_sizes(hub, env, monkeypatch):
    """A small tmpfs when this machine lets the test mount one (root), else the free-space probe
    patched; either way the check runs before any weights are fetched."""
    mount = env / "small"
    mount.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)],
                             capture_output=True).returncode == 0
    try:
        if mounted:
            monkeypatch.setenv("HF_HOME", str(mount / "hf"))
        else:
            monkeypatch.setattr(fetch, "free_bytes", lambda folder: 64 * 1024)
        with pytest.raises(DiskSpaceError, match=r"tiny/llama-big needs .* KB \(\d+ files\) and .* has .* free"):
            pull(BIG, drafter=False)
        assert not [p for p in hub.downloads() if p.endswith(".safetensors")]
        assert store.read_record(parse(BIG)) is None
        if mounted:  # past the check (a wrong estimate): the disk fills mid-file, nothing partial stays
            monkeypatch.setattr(fetch, "free_bytes", lambda folder: 1 << 40)
            with pytest.raises(HubError, match="could not store tiny/llama-big"):
                pull(BIG, drafter=False)
            blobs = list((mount / "hf").rglob("blobs/*"))
            assert all(not b.name.endswith(".incomplete") for b in blobs)
            assert fetch.locate(parse(BIG)) is None and store.read_record(parse(BIG)) is None
    finally:
        if mounted:
            subprocess.run(["umount", str(mount)], check=False)


def test_offline_with_and_without_a_cached_copy(hub, env, monkeypatch):
    with monkeypatch.context() as m:
        m.setenv("HF_HUB_OFFLINE", "1")
        with pytest.raises(NotStoredError, match=f"HF_HUB_OFFLINE is set and {BIG} is not in the cache "
                                                 r"\(never fetched\)"):
            resolve(BIG)
    pull(BIG)
    hub.reset()
    with monkeypatch.context() as m:
        m.setenv("HF_HUB_OFFLINE", "1")
        r = resolve(BIG)
        assert r.drafter is not None and pull(BIG).fetched == 0
    assert hub.requests == []
    # no network at all: a dead endpoint
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    assert resolve(BIG).local.path.is_dir()  # a run by name needs no network once cached
    with pytest.raises(HubError, match="cannot reach the hub for tiny/llama-big .* a cached copy exists"):
        pull(BIG)
    with pytest.raises(HubError, match="cannot reach the hub for tiny/gguf .* no cached copy"):
        pull("tiny/gguf")


def test_pairing_refuses_a_drafter_whose_tokenizer_differs(hub, env):
    local = pull("tiny/llama-mismatch")
    assert local.record["drafter"]["verified"] is False
    assert any("does not pair" in n and "differs from the verifier's at id 2" in n for n in local.notes)
    assert resolve("tiny/llama-mismatch").drafter is None  # refused once, not tried at run time


def test_a_shipped_drafter_comes_with_the_model(hub, env):
    local = pull("tiny/shipped")
    assert "drafter/model.safetensors" in local.files and local.record["drafter"] == {"kind": "shipped"}
    engine = edgespec.load("tiny/shipped", progress=False)
    assert engine.drafter is not None and type(engine.drafter).__name__ == "MLXDrafter"


# ------------------------------------------------------------------ runs by name
def test_a_run_by_name_equals_the_run_by_path_and_calls_no_hub_once_cached(hub, env):
    res = {}
    engine = edgespec.load(BIG, progress=False)  # first run: fetched, the drafter not (never mid-run)
    assert engine.drafter is None and any(f"edgespec pull {SMALL}" in n for n in engine.load_notes)
    pull(BIG)  # now with its drafter
    hub.reset()
    named = edgespec.load(BIG, progress=False)
    assert hub.requests == [] and named.drafter is not None and named.load_notes == []
    by_path = edgespec.load(str(resolve(BIG).local.path), drafter="none", progress=False)
    prompt = [1, 2, 3, 4, 5, 6]
    res["path"] = by_path.generate(prompt, max_tokens=20, mode="plain").tokens
    res["named"] = named.generate(prompt, max_tokens=20, mode="speculative", draft_tokens=3)
    assert res["named"].tokens == res["path"] and res["named"].stats.drafted > 0
    assert named.loaded.manifest["source"]["name"] == "llama-big"
    assert manage.find(BIG).last_used is not None


def test_cli_pull_list_rm_and_one_line_errors(hub, env, capsys, monkeypatch):
    from edgespec.cli import main

    assert main(["pull", "tiny/nope"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "edgespec pull: error: no model named tiny/nope" in err
    assert main(["pull", BIG]) == 0
    out = capsys.readouterr()
    assert "fetching tiny/llama-big: " in out.err and " KB (" in out.err
    assert main(["generate", "--model", BIG, "--prompt", "abc", "--max-tokens", "4", "--stats", "none"]) == 0
    capsys.readouterr()
    assert main(["list"]) == 0
    table = capsys.readouterr().out
    assert BIG in table and SMALL in table and "safetensors" in table
    # things edgespec and the hub cache did not write, around what rm removes
    snap = resolve(BIG).local.path
    (snap / "my-notes.txt").write_text("mine")
    (env / "es" / "hub" / "notes.json").write_text("{}")
    from huggingface_hub import hf_hub_download

    other = hf_hub_download("tiny/gguf", "README.md", cache_dir=str(env / "hf" / "hub"), endpoint=hub.url)
    monkeypatch.setattr("sys.stdin", open("/dev/null"))
    assert main(["rm", BIG]) == 1  # no terminal to ask on, no --yes: nothing removed
    assert "add --yes" in capsys.readouterr().err and (snap / "model.safetensors").is_file()
    assert main(["rm", BIG, "--yes"]) == 0
    assert f"its drafter {SMALL} stays" in capsys.readouterr().out
    assert not (snap / "model.safetensors").exists() and not (snap / "config.json").exists()
    assert (snap / "my-notes.txt").read_text() == "mine" and (env / "es" / "hub" / "notes.json").is_file()
    assert Path(other).is_file() and fetch.locate(parse(SMALL)) is not None
    assert [s.name for s in manage.stored_models()] == [SMALL]
    assert main(["rm", BIG, "--yes"]) == 1 and "not stored by name" in capsys.readouterr().err


# ------------------------------------------------------------------ the server
def _served_app(tmp_path, *flags):
    from edgespec.apps.serve import _shelf, server_defaults
    from edgespec.apps.server import ServerSettings, create_app

    from edgespec.cli import build_parser

    folder = write_tiny_hf_folder(tmp_path / "served", seed=9)
    args = build_parser().parse_args(["serve", "--model", str(folder), *flags])
    settings = ServerSettings(model_id="served", api_key=args.api_key, defaults=server_defaults(args))
    return _shelf(create_app(edgespec.load(str(folder), progress=False), settings), args, settings)


def test_the_server_lists_stored_models_and_answers_with_them(hub, env):
    from fastapi.testclient import TestClient

    pull(BIG)
    with TestClient(_served_app(env)) as client:
        ids = [m["id"] for m in client.get("/v1/models").json()["data"]]
        assert ids == ["served", "default", BIG, SMALL]
        assert client.get(f"/v1/models/{BIG}").json()["stored"] is True
        body = {"model": BIG, "prompt": "abc", "max_tokens": 6, "temperature": 0}
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 200 and r.json()["model"] == BIG
        ref = edgespec.load(BIG, drafter="none", progress=False).generate("abc", max_tokens=6, mode="plain")
        assert r.json()["choices"][0]["text"] == ref.text
        hub.reset()
        r = client.post("/v1/completions", json={**body, "model": "tiny/gguf:Q4_0"})
        assert r.status_code == 404 and "`edgespec pull tiny/gguf:Q4_0` fetches it" in r.json()["error"]["message"]
        assert hub.requests == []  # not started with --allow-pull: never fetched
        assert client.post("/v1/completions", json={**body, "model": "served"}).status_code == 200


def test_a_server_allowed_to_pull_fetches_a_named_model_and_keeps_the_api_key(hub, env):
    from fastapi.testclient import TestClient

    with TestClient(_served_app(env, "--allow-pull", "--api-key", "k")) as client:
        body = {"model": "tiny/gguf:Q4_0", "prompt": "ab", "max_tokens": 3}
        assert client.post("/v1/completions", json=body).status_code == 401
        assert client.get("/v1/models").status_code == 401
        r = client.post("/v1/completions", json=body, headers={"Authorization": "Bearer k"})
        assert r.status_code == 200 and r.json()["model"] == "tiny/gguf:Q4_0"
        assert [p.rsplit("/", 1)[-1] for p in hub.downloads()] == ["tiny-Q4_0.gguf"]


# ------------------------------------------------------------------ the default model by name
@pytest.fixture(scope="module")
def smollm_on_hub(hub, real_gguf):
    """The default model's GGUF (as the tests keep it) published on the stand-in hub."""
    name = "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF"
    hub.repos[name] = Repo({real_gguf.name: real_gguf})
    return name


@pytest.mark.real_model
def test_the_default_model_by_name_runs_as_by_path_with_no_hub_call(hub, env, smollm_on_hub, real_gguf, real_engine):
    """Fetched once, then resolved with no hub call to the very file a path names: the same load,
    so the same time to the first token; and the same reply as the model's bundle."""
    local = pull(f"{smollm_on_hub}:Q4_1")
    assert local.path.read_bytes() == real_gguf.read_bytes()
    hub.reset()
    assert resolve(f"{smollm_on_hub}:Q4_1").local.path == local.path and hub.requests == []
    engine = edgespec.load(f"{smollm_on_hub}:Q4_1", drafter="none", progress=False)
    msgs = [{"role": "user", "content": "Name three colors."}]
    ref = real_engine.generate(messages=msgs, max_tokens=8, mode="plain").tokens
    assert engine.generate(messages=msgs, max_tokens=8, mode="plain").tokens == ref and hub.requests == []


def test_convert_by_name_stores_the_paired_drafter(hub, env, capsys):
    from edgespec.cli import main

    pull(BIG)
    out = env / "bundle"
    assert main(["convert", BIG, str(out), "--quantize", "none", "--no-coreml", "--quiet"]) == 0
    assert f"storing the paired drafter {SMALL} in the bundle" in capsys.readouterr().err
    manifest = json.loads((out / "manifest.json").read_text())
    assert (out / "drafter" / "model.safetensors").is_file() and manifest.get("drafter")
    engine = edgespec.load(str(out), progress=False)
    assert type(engine.drafter).__name__ == "MLXDrafter"
