"""`edgespec convert --drafter`: the Core ML drafter inside a bundle, vocabulary checks,
tampering, interrupts, and the fallback to the MLX drafter off macOS."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("coremltools")

from conftest import write_tiny_hf_folder  # noqa: E402

from edgespec.errors import ModelLoadError, VocabularyMismatchError  # noqa: E402


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    from edgespec.cli import main

    root = tmp_path_factory.mktemp("cmlbundle")
    verifier = write_tiny_hf_folder(root / "verifier", seed=0)
    drafter = write_tiny_hf_folder(root / "drafter-src", seed=1, num_hidden_layers=1)
    out = root / "bundle"
    argv = ["convert", str(verifier), str(out), "--drafter", str(drafter), "--quantize", "none",
            "--dtype", "float32", "--drafter-context", "32", "--drafter-chunk", "8", "--quiet"]  # fmt: skip
    assert main(argv) == 0
    return out


def test_bundle_records_drafter_and_package_files(bundle):
    manifest = json.loads((bundle / "manifest.json").read_text())
    d = manifest["drafter"]
    assert d["config"] == "drafter/config.json" and d["num_layers"] == 1
    assert d["vocab_hash"] == manifest["vocab_hash"]
    c = d["coreml"]
    assert (
        c["package"] == "drafter.mlpackage"
        and c["context_length"] == 32
        and c["prefill_chunk"] == 8
    )
    assert c["compression"] == "none" and c["vocab_hash"] == manifest["vocab_hash"]
    assert set(c["functions"]) == {"prefill", "decode", "decode_2"}
    pkg_files = [n for n in manifest["files"] if n.startswith("drafter.mlpackage/")]
    assert "drafter.mlpackage/Manifest.json" in pkg_files
    assert any(n.endswith("weights/weight.bin") for n in pkg_files)
    assert "drafter/model.safetensors" in manifest["files"]
    assert not [
        p for p in bundle.parent.iterdir() if p.name.startswith(".")
    ]  # no temp folders left


def test_off_macos_the_mlx_copy_drafts_and_says_why(bundle):
    import edgespec
    from edgespec.drafters.coreml import CoreMLDrafter, CoreMLUnavailable
    from edgespec.drafters.mlx_drafter import MLXDrafter

    engine = edgespec.load(bundle, progress=False)
    assert isinstance(engine.drafter, MLXDrafter)
    assert any("macOS 15" in n for n in getattr(engine, "drafter_notes", []))
    with pytest.raises(
        CoreMLUnavailable, match="needs macOS 15 or later .*MLX drafter is used instead"
    ):
        CoreMLDrafter.load(bundle / "drafter.mlpackage", engine)
    with pytest.raises(ValueError, match="compute_units must be one of"):
        CoreMLDrafter.load(bundle / "drafter.mlpackage", engine, compute_units="GPU")


def test_load_refuses_other_vocabulary(bundle):
    from conftest import make_tiny_engine

    from edgespec.drafters.coreml import CoreMLDrafter

    other = make_tiny_engine(vocab_size=48)
    with pytest.raises(
        VocabularyMismatchError,
        match="Core ML drafter has a vocabulary of 64 tokens, the verifier 48",
    ):
        CoreMLDrafter.load(bundle / "drafter.mlpackage", other)


def test_edited_package_in_bundle_is_refused(bundle, tmp_path):
    import shutil

    import edgespec

    copy = tmp_path / "b"
    shutil.copytree(bundle, copy)
    w = copy / "drafter.mlpackage" / "Data" / "com.apple.CoreML" / "weights" / "weight.bin"
    data = bytearray(w.read_bytes())
    data[-10] ^= 0xFF
    w.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match="weight.bin: checksum differs"):
        edgespec.load(copy, progress=False)
    w.write_bytes(bytes(data[:-100]))
    with pytest.raises(ModelLoadError, match=r"weight.bin: size .*\(truncated"):
        edgespec.load(copy, progress=False)


def test_convert_refuses_drafter_with_other_vocabulary(tmp_path):
    from edgespec.converters.convert import convert

    verifier = write_tiny_hf_folder(tmp_path / "v", seed=0)
    drafter = write_tiny_hf_folder(tmp_path / "d", seed=1, vocab_size=32)
    with pytest.raises(VocabularyMismatchError, match="vocabulary of 32 tokens, the verifier 64"):
        convert(
            verifier,
            tmp_path / "out",
            quantize="none",
            dtype="float32",
            progress=False,
            drafter=drafter,
        )
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]
    with pytest.raises(ValueError, match="cannot be used with --no-coreml"):
        convert(verifier, tmp_path / "out", quantize="none", dtype="float32", progress=False, drafter=verifier,
                drafter_options={"coreml": False, "compress": "int8"})  # fmt: skip


def test_interrupted_export_leaves_nothing(tmp_path, monkeypatch):
    from edgespec.converters import coreml_export
    from edgespec.converters.convert import convert

    verifier = write_tiny_hf_folder(tmp_path / "v", seed=0)
    calls = []

    def interrupted(*a, **k):
        calls.append(1)
        raise KeyboardInterrupt

    monkeypatch.setattr(coreml_export, "build_function", interrupted)
    with pytest.raises(KeyboardInterrupt):
        convert(
            verifier,
            tmp_path / "out",
            quantize="none",
            dtype="float32",
            progress=False,
            drafter=verifier,
        )
    assert calls and not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


# ---- `edgespec convert BUNDLE --add-drafter DRAFTER`: adding a drafter to an existing bundle ----


@pytest.fixture
def plain_bundle(tmp_path):
    from conftest import write_tiny_bundle

    return write_tiny_bundle(tmp_path / "plain", seed=0)


def _add_argv(bundle, drafter, *extra):
    return ["convert", str(bundle), "--add-drafter", str(drafter), "--drafter-context", "32",
            "--drafter-chunk", "8", "--quiet", *extra]  # fmt: skip


def _temp_folders(parent):
    return [p for p in parent.iterdir() if p.name.startswith((".plain.tmp-", ".plain.old-"))]


def _snapshot(folder):
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_add_drafter_to_existing_bundle(plain_bundle, tmp_path):
    import edgespec
    from edgespec.cli import main
    from edgespec.drafters.mlx_drafter import MLXDrafter
    from edgespec.weights.bundle import read_manifest

    before = read_manifest(plain_bundle)
    drafter = write_tiny_hf_folder(tmp_path / "d", seed=1, num_hidden_layers=1)
    assert main(_add_argv(plain_bundle, drafter)) == 0
    after = read_manifest(plain_bundle, verify_hashes=True)  # every checksum right, new files included
    assert after["drafter"]["coreml"]["package"] == "drafter.mlpackage"
    assert after["drafter"]["num_layers"] == 1 and after["vocab_hash"] == before["vocab_hash"]
    for name, entry in before["files"].items():  # the verifier's files carried over unchanged
        assert after["files"][name] == entry
    assert any(n.startswith("drafter.mlpackage/") for n in after["files"])
    assert "drafter/model.safetensors" in after["files"]
    assert not _temp_folders(tmp_path)
    engine = edgespec.load(plain_bundle, progress=False)
    assert isinstance(engine.drafter, MLXDrafter)  # off macOS: the MLX copy
    # A second drafter is refused unless --force, which replaces the first.
    assert main(_add_argv(plain_bundle, drafter)) == 1
    other = write_tiny_hf_folder(tmp_path / "d2", seed=2, num_hidden_layers=2)
    assert main(_add_argv(plain_bundle, other, "--force", "--no-coreml")) == 0
    replaced = read_manifest(plain_bundle, verify_hashes=True)
    assert replaced["drafter"]["num_layers"] == 2 and replaced["drafter"]["coreml"] is None
    assert not any(n.startswith("drafter.mlpackage/") for n in replaced["files"])
    assert not (plain_bundle / "drafter.mlpackage").exists()


def test_add_drafter_refuses_other_vocabulary(plain_bundle, tmp_path, capsys):
    from edgespec.converters.convert import add_drafter

    from edgespec.cli import main

    before = _snapshot(plain_bundle)
    drafter = write_tiny_hf_folder(tmp_path / "d", seed=1, vocab_size=32)
    with pytest.raises(VocabularyMismatchError, match="vocabulary of 32 tokens, the verifier 64"):
        add_drafter(plain_bundle, drafter, progress=False)
    assert main(_add_argv(plain_bundle, drafter)) == 1
    assert "a drafter must use the verifier's tokenizer" in capsys.readouterr().err
    assert _snapshot(plain_bundle) == before
    assert not _temp_folders(tmp_path)


def test_interrupted_add_drafter_leaves_the_bundle_as_it_was(plain_bundle, tmp_path, monkeypatch):
    from edgespec.converters import coreml_export
    from edgespec.converters.convert import add_drafter

    before = _snapshot(plain_bundle)
    drafter = write_tiny_hf_folder(tmp_path / "d", seed=1, num_hidden_layers=1)

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(coreml_export, "build_function", interrupted)
    with pytest.raises(KeyboardInterrupt):
        add_drafter(plain_bundle, drafter, progress=False, drafter_options={"context_length": 32, "prefill_chunk": 8})
    assert _snapshot(plain_bundle) == before  # drafter/ was already written in the temp copy: gone
    assert not _temp_folders(tmp_path)


def test_add_feature_drafter_goes_in_as_mlx(plain_bundle, tmp_path):
    """A feature drafter is added as its MLX folder (no Core ML package: it reads the GPU verifier's
    hidden states every round); the loaded bundle drafts with it, greedy output equal to plain."""
    from edgespec.converters.convert import add_drafter
    from edgespec.converters.distill.feature_pipeline import (
        feature_config,
        init_feature_model,
        write_feature_folder,
    )

    import edgespec
    from edgespec.drafters.distilled import VocabMap
    from edgespec.drafters.feature import FeatureDrafter
    from edgespec.weights.bundle import read_manifest

    engine = edgespec.load(plain_bundle, progress=False)
    fcfg = feature_config(engine.model.args, 1)
    write_feature_folder(tmp_path / "feat", init_feature_model(fcfg, engine.model), fcfg,
                         VocabMap([-1] + list(range(40)), 64), None)
    before = _snapshot(plain_bundle)
    with pytest.raises(ValueError, match="Core ML"):
        add_drafter(plain_bundle, tmp_path / "feat", progress=False, drafter_options={"compress": "int8"})
    assert _snapshot(plain_bundle) == before
    add_drafter(plain_bundle, tmp_path / "feat", progress=False)
    m = read_manifest(plain_bundle, verify_hashes=True)
    assert m["drafter"]["kind"] == "feature" and m["drafter"]["coreml"] is None and "hidden states" in m["drafter"]["coreml_note"]
    assert "drafter/drafter.json" in m["files"] and not any(n.startswith("drafter.mlpackage/") for n in m["files"])
    engine = edgespec.load(plain_bundle, progress=False)
    assert isinstance(engine.drafter, FeatureDrafter)
    plain = engine.generate([3, 4, 5, 6], max_tokens=12, temperature=0, mode="plain").tokens
    spec = engine.generate([3, 4, 5, 6], max_tokens=12, temperature=0, mode="speculative", draft_tokens=3)
    assert spec.tokens == plain and spec.stats.drafted > 0
