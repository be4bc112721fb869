"""Calibrated compression of the Core ML drafter (converters/coreml_calibrate.py): the tuning
lowers the KL to the uncompressed model and raises greedy agreement, and the exported package
computes exactly the tuned compressed weights (numpy MIL executor)."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

pytest.importorskip("coremltools")

from conftest import make_tiny_model, write_tiny_hf_folder  # noqa: E402
from coreml_support import executor_logits, export_package, fp16_weights, reference_logits, rel_err  # noqa: E402
from edgespec.converters.coreml_calibrate import compress_model, linear_weight_names  # noqa: E402
from edgespec.converters.coreml_compress import decode_packed  # noqa: E402


def sequences(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """Token sequences with structure (repeated short motifs), so the model's predictions vary."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        motif = rng.integers(0, vocab, rng.integers(2, 6)).tolist()
        noise = rng.integers(0, vocab, length).tolist()
        seq = (motif * length)[:length]
        out.append([t if rng.random() < 0.7 else r for t, r in zip(seq, noise, strict=True)])
    return out


def with_packed(model, packed):
    """`model` with its linear weights replaced by the dense form of `packed`."""
    model.load_weights([(n, mx.array(decode_packed(p))) for n, p in packed.items()], strict=False)
    return model


def agreement(model_a, model_b, seqs) -> float:
    a = np.concatenate([np.array(model_a(mx.array([s]))[0]).argmax(-1) for s in seqs])
    b = np.concatenate([np.array(model_b(mx.array([s]))[0]).argmax(-1) for s in seqs])
    return float((a == b).mean())


@pytest.mark.parametrize("method", ["int4", "palette4"])
def test_calibration_lowers_kl_and_raises_agreement(method):
    def make():
        return make_tiny_model(
            seed=3, scale=2.0, hidden_size=64, intermediate_size=128, vocab_size=96
        )

    # Enough text that the tuning cannot just memorise it (measured: KL 0.075 -> 0.059 for
    # int4 and 0.057 -> 0.035 for palette4 after 150 steps; agreement +4 points each).
    calib, held = sequences(256, 32, 96, seed=1), sequences(16, 32, 96, seed=2)
    plain, none_stats = compress_model(make(), method)
    tuned, stats = compress_model(make(), method, calib, steps=150)
    assert none_stats is None and set(tuned) == set(linear_weight_names(make()))
    assert stats["steps"] == 150 and stats["held_back_tokens"] > 0
    assert stats["held_back_kl_after"] < 0.9 * stats["held_back_kl_before"], stats
    before = agreement(make(), with_packed(make(), plain), held)
    after = agreement(make(), with_packed(make(), tuned), held)
    assert after > before, (before, after)
    weights = dict(tree_flatten(make().parameters()))
    for name, p in tuned.items():  # codes stay valid for the constexpr ops
        codes = p["indices"] if method == "palette4" else p["data"]
        assert codes.min() >= 0 and codes.max() <= 15, name
        assert codes.shape[:2] == weights[name].shape, name


@pytest.mark.parametrize("method", ["int8", "int4", "palette4"])
def test_calibrated_package_computes_the_tuned_weights(tmp_path, method):
    """Traditional RoPE and an untied head: the exporter permutes and scales the q/k rows of the
    compressed forms (codes move with their rows, palettes and scales take the 1/sqrt(D))."""

    def make():
        return make_tiny_model(seed=5, scale=2.0, rope_traditional=True, tie_word_embeddings=False)

    calib = sequences(24, 24, 64, seed=4)
    packed, stats = compress_model(make(), method, calib, steps=4)
    assert "lm_head.weight" in packed
    path, info = export_package(tmp_path, make(), method, context_length=32, prefill_chunk=8,
                                compress=method, calibration=calib, calibrate_steps=4)  # fmt: skip
    assert info["compression"] == method and info["calibration"] == stats
    tokens = sequences(1, 20, 64, seed=9)[0]
    from edgespec.converters.mil_executor import MILExecutor

    # fp32 executor vs MLX with the package's weights: the rest rounded through fp16 as stored,
    # the linear layers the tuned compressed forms (their palettes and scales are fp16 already).
    ref = reference_logits(with_packed(fp16_weights(make()), packed), tokens)[7:]
    got = executor_logits(MILExecutor(path, fp16=False), tokens, 8)
    assert rel_err(got, ref) < 1e-4
    assert (got.argmax(-1) == ref.argmax(-1)).all()


def test_convert_records_calibration_and_checks_the_option(tmp_path):
    from edgespec.cli import main

    verifier = write_tiny_hf_folder(tmp_path / "verifier", seed=0)
    drafter = write_tiny_hf_folder(tmp_path / "drafter-src", seed=1, num_hidden_layers=1)
    base = ["convert", str(verifier), "--drafter", str(drafter), "--quantize", "none", "--dtype", "float32",
            "--drafter-context", "32", "--drafter-chunk", "8", "--quiet"]  # fmt: skip
    out = tmp_path / "b"
    assert (
        main(
            base[:2]
            + [str(out)]
            + base[2:]
            + ["--drafter-compress", "palette4", "--drafter-calibrate", "3"]
        )
        == 0
    )
    cal = json.loads((out / "manifest.json").read_text())["drafter"]["coreml"]["calibration"]
    assert cal["steps"] == 3 and cal["calibration_tokens"] > 0
    assert cal["held_back_kl_after"] >= 0 and cal["text"].startswith("built-in")
    plain = tmp_path / "p"
    assert (
        main(
            base[:2]
            + [str(plain)]
            + base[2:]
            + ["--drafter-compress", "int8", "--drafter-calibrate", "0"]
        )
        == 0
    )
    assert (
        json.loads((plain / "manifest.json").read_text())["drafter"]["coreml"]["calibration"]
        is None
    )
    bad = tmp_path / "bad"
    assert (
        main(
            base[:2]
            + [str(bad)]
            + base[2:]
            + ["--drafter-compress", "int4", "--drafter-calibrate", "-2"]
        )
        != 0
    )
    assert not bad.exists()
