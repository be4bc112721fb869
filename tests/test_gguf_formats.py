"""GGUF tensor types: every supported type reads as gguf's own dequantizer reads it; the exact
ones stay quantized bit-for-bit; the others are re-quantized with their error reported."""

from __future__ import annotations

import re

import gguf
import mlx.core as mx
import numpy as np
import pytest
from gguf_support import Q, k_blocks, permute_qk, quantized_bytes, write_llama_gguf
from mlx.utils import tree_flatten

from edgespec.errors import ModelLoadError
from edgespec.weights.formats import gguf_quants as gq
from edgespec.weights.loader import load, load_gguf

ROWS, COLS = 8, 512


def _raw(type_name: str, seed: int = 0) -> np.ndarray:
    w = np.random.default_rng(seed).standard_normal((ROWS, COLS)).astype(np.float32)
    if type_name == "F32":
        return w
    if type_name == "F16":
        return w.astype(np.float16)
    if type_name in ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"):  # gguf has no quantizer for these
        return k_blocks(type_name, ROWS, COLS, seed, scale=0.02)
    return quantized_bytes(w, Q[type_name])


def _reference(type_name: str, raw: np.ndarray) -> np.ndarray:
    return np.asarray(gguf.quants.dequantize(raw, Q[type_name]), dtype=np.float32).reshape(ROWS, COLS)


def _same_bits_but_zero_sign(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal values, and equal bit patterns everywhere except the sign of a zero: gguf computes
    Q4_0/Q5_0 as d*(q-8), giving -0.0 where d < 0 and q = 8; s*q + b gives +0.0 there."""
    return np.array_equal(a, b) and np.array_equal(a.view(np.uint32)[a != 0], b.view(np.uint32)[b != 0])


def test_the_type_lists_cover_the_issue():
    wanted = {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "F16", "BF16", "F32"}
    assert set(gq.SUPPORTED) == wanted
    assert set(gq.EXACT_BITS) | set(gq.REQUANT_BITS) | set(gq.DENSE) == wanted


@pytest.mark.parametrize("type_name", gq.SUPPORTED)
def test_every_type_dequantizes_as_gguf_does(type_name):
    raw = _raw(type_name)
    ref = _reference(type_name, raw)
    assert np.isfinite(ref).all() and np.abs(ref).max() > 0
    mine = gq.dequantize(type_name, raw, (ROWS, COLS))
    assert mine.dtype == np.float32 and _same_bits_but_zero_sign(mine, ref)


@pytest.mark.parametrize("type_name", sorted(gq.EXACT_BITS))
def test_exact_types_kept_quantized_are_bit_identical(type_name):
    raw = _raw(type_name, seed=3)
    parts, bits = gq.native(type_name, raw)
    assert bits == gq.EXACT_BITS[type_name] and parts["weight"].dtype == np.uint32
    assert parts["weight"].shape == (ROWS, COLS * bits // 32) and parts["scales"].shape == (ROWS, COLS // 32)
    w = mx.dequantize(mx.array(parts["weight"]), mx.array(parts["scales"]), mx.array(parts["biases"]),
                      group_size=32, bits=bits)
    assert _same_bits_but_zero_sign(np.array(w), _reference(type_name, raw))
    if type_name not in ("Q4_0", "Q5_0"):  # no d*(q-c) form: not even a zero's sign differs
        assert np.array_equal(np.array(w).view(np.uint32), _reference(type_name, raw).view(np.uint32))


def test_the_zero_sign_check_catches_a_real_difference():
    a = np.ones(4, np.float32)
    b = a.copy()
    b[2] = np.nextafter(np.float32(1), np.float32(2))
    assert not _same_bits_but_zero_sign(a, b)
    assert _same_bits_but_zero_sign(np.array([0.0, 1.0], np.float32), np.array([-0.0, 1.0], np.float32))


@pytest.mark.parametrize("type_name", sorted(gq.REQUANT_BITS))
def test_inexact_types_are_requantized_with_their_error(type_name):
    raw = _raw(type_name, seed=5)
    dense = gq.dequantize(type_name, raw, (ROWS, COLS))
    parts, err = gq.requantize(dense, gq.REQUANT_BITS[type_name])
    back = np.array(mx.dequantize(*(mx.array(parts[k]) for k in ("weight", "scales", "biases")),
                                  group_size=32, bits=gq.REQUANT_BITS[type_name]))
    measured = np.linalg.norm(back - dense) / np.linalg.norm(dense)
    assert err == pytest.approx(measured, rel=1e-3) and 0 < err < 0.5
    assert gq.native(type_name, raw) is None  # no exact form claimed


def test_an_unsupported_type_is_a_clear_error():
    with pytest.raises(ModelLoadError, match="IQ2_XXS is not supported"):
        gq.dequantize("IQ2_XXS", np.zeros((1, 66), np.uint8), (1, 256))


# ---------------------------------------------------------------- a whole GGUF of mixed types

MIXED = {  # HF name (layer 0 / 1) -> GGUF type; the rest F32
    "model.layers.0.self_attn.q_proj.weight": Q.Q4_K,
    "model.layers.0.self_attn.k_proj.weight": Q.Q6_K,
    "model.layers.0.self_attn.v_proj.weight": Q.Q5_K,
    "model.layers.0.self_attn.o_proj.weight": Q.Q8_0,
    "model.layers.0.mlp.gate_proj.weight": Q.Q3_K,
    "model.layers.0.mlp.up_proj.weight": Q.Q2_K,
    "model.layers.0.mlp.down_proj.weight": Q.Q4_1,
    "model.layers.1.self_attn.q_proj.weight": Q.Q5_0,
    "model.layers.1.self_attn.k_proj.weight": Q.Q5_1,
    "model.layers.1.self_attn.v_proj.weight": Q.Q4_0,
    "model.layers.1.mlp.gate_proj.weight": Q.F16,
    "model.layers.1.mlp.up_proj.weight": Q.BF16,
}
K_DIMS = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)


def _gguf_reference(path) -> dict[str, np.ndarray]:
    """HF-ordered float32 weights read back with gguf's reader and dequantizer only."""
    reader = gguf.GGUFReader(str(path))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2)
    hf_of = {names.get_name(h, try_suffixes=(".weight",)): h for h in _hf_names()}
    heads = {"q_proj": 4, "k_proj": 2}
    out = {}
    for t in reader.tensors:
        shape = tuple(int(s) for s in reversed(t.shape))
        w = np.asarray(gguf.quants.dequantize(np.asarray(t.data), t.tensor_type), np.float32).reshape(shape)
        hf = hf_of[t.name]
        for part, n in heads.items():
            if part in hf:  # undo the permutation by its index map
                w = w[np.argsort(permute_qk(np.arange(shape[0]), n))]
        out[hf] = w
    return out


def _hf_names():
    from conftest import make_tiny_model

    return [k for k, _ in tree_flatten(make_tiny_model(0, vocab_size=272, **K_DIMS).parameters())]


def test_mixed_kquant_gguf_loads_dense_as_gguf_reads_it(tmp_path):
    path = write_llama_gguf(tmp_path / "mixed.gguf", seed=7, types=MIXED, **K_DIMS)
    ref = _gguf_reference(path)
    loaded = load(path)
    params = dict(tree_flatten(loaded.model.parameters()))
    assert set(params) == set(ref)
    for name, w in ref.items():
        assert _same_bits_but_zero_sign(np.array(params[name]), w), name
    assert loaded.manifest["source"]["format"] == "gguf"


def test_mixed_kquant_gguf_kept_quantized(tmp_path):
    path = write_llama_gguf(tmp_path / "mixed.gguf", seed=7, types=MIXED, **K_DIMS)
    ref = _gguf_reference(path)
    loaded = load_gguf(path, keep_quantized=True)
    layers = loaded.model.layers
    q = layers[0].self_attn.q_proj  # Q4_K: exact
    assert q.bits == 4 and q.group_size == 32
    w = mx.dequantize(q.weight, q.scales, q.biases, group_size=32, bits=4)
    assert _same_bits_but_zero_sign(np.array(w), ref["model.layers.0.self_attn.q_proj.weight"])
    k = layers[0].self_attn.k_proj  # Q6_K: re-quantized to 6 bits
    assert k.bits == 6
    assert not hasattr(layers[1].mlp.gate_proj, "bits")  # F16 stays dense


def test_convert_native_reports_exact_and_requantized_types(tmp_path):
    from edgespec.converters.convert import convert

    path = write_llama_gguf(tmp_path / "mixed.gguf", seed=7, types=MIXED, **K_DIMS)
    manifest = convert(path, tmp_path / "out", quantize="native", dtype="float32", progress=False)
    report = manifest["source"]["gguf_types"]
    assert report["Q4_K"]["how"] == "exact" and report["Q4_K"]["bits"] == 4
    assert report["Q5_K"]["how"] == "exact" and report["Q5_K"]["bits"] == 5
    for t, bits in (("Q2_K", 2), ("Q3_K", 3), ("Q6_K", 6)):
        assert report[t]["how"] == "requantized" and report[t]["bits"] == bits
        assert 0 < report[t]["max_rel_error"] < 0.5
    assert report["F16"]["how"] == "dense" and report["F32"]["tensors"] >= 5
    engine_loaded = load(tmp_path / "out")
    dense = load(path)
    ids = mx.array([[1, 5, 9, 200, 3]])
    a, b = engine_loaded.model(ids), dense.model(ids)
    assert a.shape == b.shape and float(mx.abs(a - b).max()) < 0.5 * float(mx.abs(b).max())


def test_convert_summary_lines(tmp_path):
    from edgespec.apps.convert import gguf_summary

    lines = gguf_summary({"Q6_K": {"how": "requantized", "tensors": 2, "bits": 6, "group_size": 32,
                                   "max_rel_error": 0.0123},
                          "Q4_K": {"how": "exact", "tensors": 3, "bits": 4, "group_size": 32}})
    assert any("Q6_K" in s and "re-quantized" in s and "1.23%" in s for s in lines)
    assert any("Q4_K" in s and "exact" in s for s in lines)


def test_the_container_parser_agrees_with_gguf_reader(tmp_path):
    from edgespec.weights.formats.gguf_file import GGUFFile

    path = write_llama_gguf(tmp_path / "mixed.gguf", seed=7, types=MIXED, **K_DIMS)
    mine, ref = GGUFFile(path), gguf.GGUFReader(str(path))
    assert set(mine.fields) == {k for k in ref.fields if not k.startswith("GGUF.")}  # reader's own
    for key, field in ref.fields.items():
        if key.startswith("GGUF."):
            continue
        want = field.contents()
        got = mine.fields[key]
        assert got == pytest.approx(want) if isinstance(want, float) else got == want, key
    assert [t.name for t in mine.tensors] == [t.name for t in ref.tensors]
    for a, b in zip(mine.tensors, ref.tensors, strict=True):
        assert a.tensor_type.name == b.tensor_type.name and tuple(a.shape) == tuple(int(s) for s in b.shape)
        assert a.data.dtype == b.data.dtype and np.array_equal(np.asarray(a.data), np.asarray(b.data)), a.name


def test_a_truncated_gguf_is_a_clear_error(tmp_path):
    path = write_llama_gguf(tmp_path / "t.gguf", seed=1)
    data = path.read_bytes()
    for cut in (10, 2000, len(data) - 100):
        bad = tmp_path / f"cut{cut}.gguf"
        bad.write_bytes(data[:cut])
        with pytest.raises(ModelLoadError, match="corrupt or truncated"):
            load(bad)


def test_convert_to_4_bit_reports_its_error_and_the_exact_alternative(tmp_path, capsys):
    from edgespec.cli import main

    path = write_llama_gguf(tmp_path / "q.gguf", seed=3, default_type=Q.Q4_0)
    assert main(["convert", str(path), str(tmp_path / "out"), "--quantize", "4", "--dtype", "float32",
                 "--quiet"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert re.search(r"Q4_0: \d+ tensors read dense", out)
    line = next(s for s in out.splitlines() if "re-quantized to 4-bit, groups of 64" in s)
    assert "--quantize native keeps Q4_0 exactly" in line
    from edgespec.weights.bundle import read_manifest

    q = read_manifest(tmp_path / "out")["quantization"]
    assert q["bits"] == 4 and 0 < q["max_rel_error"] < 0.5
    assert f"{100 * q['max_rel_error']:.2f}%" in line
