"""Loading and converting: round trips, clear errors on bad inputs, atomic writes."""

import json
import os
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest
from conftest import make_tiny_model, write_tiny_bundle, write_tiny_hf_folder
from edgespec.converters.convert import convert

from edgespec.errors import ModelLoadError
from edgespec.weights.loader import load


def logits_of(model, toks=(1, 2, 3, 4)):
    return np.array(model(mx.array([list(toks)])))


def test_hf_folder_and_bundle_give_the_source_model(tmp_path):
    src = write_tiny_hf_folder(tmp_path / "hf", seed=3)
    want = logits_of(make_tiny_model(3))
    np.testing.assert_allclose(logits_of(load(src).model), want, atol=1e-6)
    manifest = convert(src, tmp_path / "b", quantize="none", dtype="float32", progress=False)
    assert manifest["source"]["format"] == "hf" and "model.safetensors" in manifest["files"]
    loaded = load(tmp_path / "b")
    np.testing.assert_allclose(logits_of(loaded.model), want, atol=1e-6)
    assert loaded.tokenizer.vocab_hash() == manifest["vocab_hash"]


@pytest.mark.parametrize("bits", ["4", "8"])
def test_quantized_bundle_loads_quantized(tmp_path, bits):
    src = write_tiny_hf_folder(tmp_path / "hf", seed=4, hidden_size=128, intermediate_size=256)
    convert(src, tmp_path / "q", quantize=bits, dtype="float32", progress=False)
    model = load(tmp_path / "q").model
    assert model.layers[0].mlp.up_proj.bits == int(bits)
    ref = logits_of(make_tiny_model(4, hidden_size=128, intermediate_size=256))
    rel = np.abs(logits_of(model) - ref).max() / np.abs(ref).max()
    assert rel < (0.2 if bits == "4" else 0.02)


def test_qwen2_biases_round_trip(tmp_path):
    src = write_tiny_hf_folder(tmp_path / "hf", seed=5, model_type="qwen2")
    model = load(src).model
    assert "bias" in model.layers[0].self_attn.q_proj
    np.testing.assert_allclose(logits_of(model), logits_of(make_tiny_model(5, model_type="qwen2")), atol=1e-6)


def test_existing_output_is_not_overwritten_without_force(tmp_path):
    src = write_tiny_hf_folder(tmp_path / "hf")
    convert(src, tmp_path / "b", quantize="none", progress=False)
    with pytest.raises(FileExistsError, match="--force"):
        convert(src, tmp_path / "b", quantize="none", progress=False)
    convert(src, tmp_path / "b", quantize="none", force=True, progress=False)
    assert load(tmp_path / "b").model is not None


def test_failed_conversion_leaves_nothing_behind(tmp_path):
    src = write_tiny_hf_folder(tmp_path / "hf")
    cfg = json.loads((src / "config.json").read_text())
    cfg["hidden_size"] = 32  # weights no longer match
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="do not match"):
        convert(src, tmp_path / "out", quantize="none", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_interrupted_conversion_leaves_nothing_behind(tmp_path, monkeypatch):
    import edgespec.converters.convert as conv

    src = write_tiny_hf_folder(tmp_path / "hf")

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(conv, "finish_manifest", interrupted)
    with pytest.raises(KeyboardInterrupt):
        convert(src, tmp_path / "out", quantize="none", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_truncated_bundle_weights_are_reported(tmp_path):
    b = write_tiny_bundle(tmp_path / "b")
    w = b / "model.safetensors"
    w.write_bytes(w.read_bytes()[:-100])
    with pytest.raises(ModelLoadError, match="truncated"):
        load(b)


def test_corrupted_bundle_weights_are_reported(tmp_path):
    b = write_tiny_bundle(tmp_path / "b")
    w = b / "model.safetensors"
    data = bytearray(w.read_bytes())
    data[-10] ^= 0xFF
    w.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match="checksum"):
        load(b)


def _edit_manifest(b, **fields):
    m = json.loads((b / "manifest.json").read_text())
    m.update(fields)
    (b / "manifest.json").write_text(json.dumps(m))


@pytest.mark.parametrize(
    "damage, match",
    [
        (lambda b: (b / "manifest.json").write_text("{not json"), "invalid JSON"),
        (lambda b: (b / "tokenizer.json").unlink(), "missing"),
        (lambda b: (b / "manifest.json").unlink(), "neither an edgespec bundle"),
        # Valid JSON of the wrong shape: a clear error, not an AttributeError/KeyError traceback.
        (lambda b: (b / "manifest.json").write_text("[1, 2]"), "malformed manifest: expected a JSON object"),
        (lambda b: _edit_manifest(b, files=["model.safetensors"]), 'malformed manifest: "files" must be'),
        (lambda b: _edit_manifest(b, files={"model.safetensors": {"sha256": "x"}}), "size must be"),
        (lambda b: _edit_manifest(b, files={"../escape": {"size": 1, "sha256": "x"}}), "relative path inside"),
        (lambda b: (b / "manifest.json").write_bytes(b'{"format": "\xff"}'), "invalid JSON"),
    ],
)
def test_damaged_bundles_are_reported(tmp_path, damage, match):
    b = write_tiny_bundle(tmp_path / "b")
    if match == "neither an edgespec bundle":
        (b / "config.json").unlink()
    damage(b)
    with pytest.raises(ModelLoadError, match=match):
        load(b)


def test_truncated_hf_safetensors_are_reported(tmp_path):
    src = write_tiny_hf_folder(tmp_path / "hf")
    w = src / "model.safetensors"
    w.write_bytes(w.read_bytes()[:200])
    with pytest.raises(ModelLoadError, match="corrupt or truncated"):
        load(src)


def test_unknown_architecture_in_hf_folder(tmp_path):
    src = write_tiny_hf_folder(tmp_path / "hf")
    cfg = json.loads((src / "config.json").read_text())
    cfg["model_type"] = "mamba"
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="unsupported architecture 'mamba'"):
        load(src)


def test_not_a_model(tmp_path):
    (tmp_path / "x.gguf").write_bytes(b"NOPE" + bytes(100))
    with pytest.raises(ModelLoadError, match="not a GGUF"):
        load(tmp_path / "x.gguf")
    with pytest.raises(ModelLoadError, match="no such file"):
        load(tmp_path / "missing")


def test_truncated_gguf_is_reported(tmp_path, real_gguf):
    bad = tmp_path / "cut.gguf"
    with open(real_gguf, "rb") as f:
        bad.write_bytes(f.read(5_000_000))
    with pytest.raises(ModelLoadError, match="corrupt or truncated"):
        load(bad)


def test_cli_reports_bad_model_without_traceback(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "edgespec.cli", "generate", "--model", str(tmp_path / "nope"), "--prompt", "hi"],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 1
    assert "no such file or folder" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.real_model
def test_gguf_native_quantization_is_exact(real_gguf):
    """Q4_1/Q8_0 blocks kept as MLX affine quantization dequantize to exactly the GGUF values."""
    import gguf
    from edgespec.converters.gguf import _open, dequantized, native_quantized

    reader = _open(real_gguf)
    seen = set()
    for t in reader.tensors:
        kind = t.tensor_type.name
        if kind in seen or kind not in ("Q4_1", "Q8_0"):
            continue
        seen.add(kind)
        parts, bits = native_quantized(t)
        w = mx.dequantize(mx.array(parts["weight"]), mx.array(parts["scales"]), mx.array(parts["biases"]), 32, bits)
        np.testing.assert_allclose(np.array(w), dequantized(t), rtol=0, atol=1e-6)
    assert seen == {"Q4_1", "Q8_0"}
    assert gguf is not None


@pytest.mark.parametrize("where", ["same", "parent", "inside"])
def test_convert_refuses_an_out_that_overlaps_the_source(tmp_path, where, monkeypatch):
    """--force over SRC (or a folder holding it) would delete the checkpoint: refused, nothing touched."""
    import edgespec.converters.convert as conv

    src = write_tiny_hf_folder(tmp_path / "work" / "hf")
    out = {"same": src, "parent": tmp_path / "work", "inside": src / "bundle"}[where]
    before = sorted(p.name for p in src.iterdir())
    monkeypatch.setattr(conv, "_read_source", lambda *a, **k: pytest.fail("the work started"))
    with pytest.raises(ValueError, match="overlaps SRC"):
        convert(src, out, quantize="none", force=True, progress=False)
    assert sorted(p.name for p in src.iterdir()) == before


def test_existing_out_is_refused_before_the_work(tmp_path, monkeypatch):
    import edgespec.converters.convert as conv

    src = write_tiny_hf_folder(tmp_path / "hf")
    (tmp_path / "b").mkdir()
    monkeypatch.setattr(conv, "_read_source", lambda *a, **k: pytest.fail("the work started"))
    with pytest.raises(FileExistsError, match="--force"):
        convert(src, tmp_path / "b", quantize="none", progress=False)


def test_temp_folders_of_killed_conversions_are_cleaned_but_not_running_ones(tmp_path):
    from edgespec.converters.bundle import PID_MARKER

    src = write_tiny_hf_folder(tmp_path / "hf")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    killed = tmp_path / ".b.tmp-killed"
    killed.mkdir()
    (killed / PID_MARKER).write_text(str(dead.pid))
    (killed / "model.safetensors").write_bytes(b"\0" * 1024)
    running = tmp_path / ".b.tmp-running"
    running.mkdir()
    (running / PID_MARKER).write_text(str(os.getppid()))  # a live process (pytest's parent)
    other = tmp_path / ".c.tmp-killed"  # another bundle's: not ours to judge
    other.mkdir()
    (other / PID_MARKER).write_text(str(dead.pid))
    convert(src, tmp_path / "b", quantize="none", progress=False)
    assert not killed.exists() and running.exists() and other.exists()
    assert not any(p.name.startswith(".b.tmp-") and p != running for p in tmp_path.iterdir())


def _hand_bundle(folder, payload: bytes):
    from edgespec.weights.bundle import file_entry

    folder.mkdir()
    (folder / "model.safetensors").write_bytes(payload)
    entry = file_entry(folder / "model.safetensors")
    (folder / "manifest.json").write_text(json.dumps(
        {"format": "edgespec-bundle", "format_version": 1, "files": {"model.safetensors": entry}}))
    return folder / "model.safetensors"


def _counting_hashes(monkeypatch):
    from edgespec.weights import bundle

    calls = []
    real = bundle.sha256_file
    monkeypatch.setattr(bundle, "sha256_file", lambda p, *a: calls.append(p) or real(p, *a))
    return calls


def test_verified_weights_are_not_hashed_again_until_written(tmp_path, monkeypatch):
    from edgespec.weights import bundle

    monkeypatch.setenv("EDGESPEC_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(bundle, "RACY_S", 0.0)
    weights = _hand_bundle(tmp_path / "b", b"w" * 4096)
    calls = _counting_hashes(monkeypatch)
    bundle.read_manifest(tmp_path / "b")
    assert len(calls) == 1 and bundle.verified_record_path(tmp_path / "b").is_file()
    bundle.read_manifest(tmp_path / "b")
    assert len(calls) == 1  # recorded: not hashed again
    with open(weights, "r+b") as f:  # corrupt in place, same size, mtime put back
        st = os.stat(weights)
        f.seek(100)
        f.write(b"x")
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(ModelLoadError, match="checksum differs"):
        bundle.read_manifest(tmp_path / "b")
    assert len(calls) == 2


def test_racily_written_weights_are_hashed_every_time(tmp_path, monkeypatch):
    from edgespec.weights import bundle

    monkeypatch.setenv("EDGESPEC_HOME", str(tmp_path / "home"))
    _hand_bundle(tmp_path / "b", b"w" * 4096)  # written just now: within RACY_S
    calls = _counting_hashes(monkeypatch)
    bundle.read_manifest(tmp_path / "b")
    bundle.read_manifest(tmp_path / "b")
    assert len(calls) == 2 and not bundle.verified_record_path(tmp_path / "b").exists()


def test_a_foreign_file_at_the_record_path_is_left_alone(tmp_path, monkeypatch):
    from edgespec.weights import bundle

    monkeypatch.setenv("EDGESPEC_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(bundle, "RACY_S", 0.0)
    _hand_bundle(tmp_path / "b", b"w" * 4096)
    record = bundle.verified_record_path(tmp_path / "b")
    record.parent.mkdir(parents=True)
    record.write_text("mine")
    calls = _counting_hashes(monkeypatch)
    for _ in range(2):
        bundle.read_manifest(tmp_path / "b")
    assert len(calls) == 2 and record.read_text() == "mine"
