"""Drafter pairing: any small model that shares the verifier's tokenizer drafts for it, whatever
size its embedding table is padded to; a different tokenizer is refused by the first differing id."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest
from conftest import make_tiny_model, make_tiny_tokenizer
from mlx.utils import tree_flatten

from edgespec.drafters import attach_drafter
from edgespec.drafters.mlx_drafter import MLXDrafter
from edgespec.engine import Engine
from edgespec.errors import VocabularyMismatchError
from edgespec.weights.loader import LoadedModel

TOKENS = 64  # the shared tokenizer's size; embedding tables are padded past it


def _verifier(rows: int) -> Engine:
    model = make_tiny_model(0, vocab_size=rows, num_hidden_layers=3, scale=3.0)
    return Engine(LoadedModel(model, make_tiny_tokenizer(TOKENS), None, {}))


def _drafter_folder(folder, rows: int, tokenizer=None, seed: int = 5):
    folder.mkdir()
    model = make_tiny_model(seed, vocab_size=rows, num_hidden_layers=1, scale=3.0)
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (folder / "config.json").write_text(json.dumps(model.args.to_dict()))
    (tokenizer or make_tiny_tokenizer(TOKENS)).save(folder)
    return folder


@pytest.mark.parametrize(("v_rows", "d_rows"), [(72, 80), (80, 72), (64, 96)])
def test_padded_tables_draft_losslessly(tmp_path, v_rows, d_rows):
    engine = _verifier(v_rows)
    prompts = [[1, 2, 3], [5, 9, 5, 9, 5, 9, 12]]
    plain = [engine.generate(p, max_tokens=24, mode="plain").tokens for p in prompts]
    d = attach_drafter(engine, _drafter_folder(tmp_path / "d", d_rows))
    assert isinstance(d, MLXDrafter) and d.vocab_size == v_rows and d.rows == d_rows
    for p, ref in zip(prompts, plain, strict=True):
        res = engine.generate(p, max_tokens=24, mode="speculative", draft_tokens=3)
        assert res.tokens == ref and res.stats.mode == "speculative" and res.stats.drafted > 0
    # sampled: the draft distribution has the verifier's width (rejection sampling needs it)
    res = engine.generate([1, 2, 3], max_tokens=12, mode="speculative", temperature=0.8, seed=1)
    assert len(res.tokens) > 0 and all(0 <= t < v_rows for t in res.tokens)


def test_drafter_logits_are_cut_or_padded_to_the_verifier():
    model = make_tiny_model(1, vocab_size=80, num_hidden_layers=1)
    d = MLXDrafter(model, vocab_size=72)
    d.begin([1, 2, 79])
    draft = d.draft(2, _greedy_sampler())
    assert draft.logprobs.shape == (2, 72)
    wide = MLXDrafter(make_tiny_model(1, vocab_size=64, num_hidden_layers=1), vocab_size=70)
    wide.begin([1, 2, 69])  # 69 is past the drafter's table: clamped when fed
    q = wide.draft(2, _greedy_sampler()).logprobs
    assert q.shape == (2, 70) and bool(mx.all(q[:, 64:] == -mx.inf))


def _greedy_sampler():
    from edgespec.logits.sampling import Sampler, SamplingParams

    return Sampler(SamplingParams(temperature=0.0))


def test_a_different_tokenizer_is_refused_by_its_first_differing_id(tmp_path):
    engine = _verifier(72)
    src = tmp_path / "tok"
    src.mkdir()
    make_tiny_tokenizer(TOKENS).save(src)
    spec = json.loads((src / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    vocab["b"], vocab["c"] = vocab["c"], vocab["b"]  # ids 2 and 3 swapped
    (src / "tokenizer.json").write_text(json.dumps(spec))
    from edgespec.tokenizer import Tokenizer

    other = Tokenizer.from_folder(src)
    folder = _drafter_folder(tmp_path / "d", 72, tokenizer=other)
    with pytest.raises(VocabularyMismatchError, match=r"at id 2: drafter 'c', verifier 'b'"):
        attach_drafter(engine, folder)


def test_a_table_smaller_than_the_tokenizer_is_refused(tmp_path):
    engine = _verifier(72)
    with pytest.raises(VocabularyMismatchError, match="vocabulary of 60 tokens, the verifier 64: its embedding table must cover"):
        attach_drafter(engine, _drafter_folder(tmp_path / "d", 60))


def test_a_drafter_without_tokenizer_still_needs_the_same_size(tmp_path):
    engine = _verifier(72)
    folder = _drafter_folder(tmp_path / "d", 80)
    (folder / "tokenizer.json").unlink()
    with pytest.raises(VocabularyMismatchError, match="80 tokens, the verifier 72"):
        attach_drafter(engine, folder)


def _hf_folder(folder, rows: int, layers: int, seed: int, tokenizer=None):
    folder.mkdir()
    model = make_tiny_model(seed, vocab_size=rows, num_hidden_layers=layers, scale=3.0)
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (folder / "config.json").write_text(json.dumps(model.args.to_dict()))
    (tokenizer or make_tiny_tokenizer(TOKENS)).save(folder)
    return folder


@pytest.mark.parametrize("d_rows", [80, 68])
def test_convert_with_a_padded_drafter(tmp_path, d_rows):
    """`edgespec convert --drafter`: the drafter's tables are fitted to the verifier's width."""
    from edgespec.converters.convert import add_drafter, convert

    import edgespec

    verifier = _hf_folder(tmp_path / "v", 72, 3, 0)
    drafter = _hf_folder(tmp_path / "d", d_rows, 1, 5)
    manifest = convert(verifier, tmp_path / "b", dtype="float32", quantize="none", progress=False,
                       drafter=drafter, drafter_options={"coreml": False})
    cfg = json.loads((tmp_path / "b" / manifest["drafter"]["config"]).read_text())
    assert cfg["vocab_size"] == 72
    engine = edgespec.load(tmp_path / "b", progress=False)
    assert isinstance(engine.drafter, MLXDrafter)
    plain = engine.generate([1, 2, 3], max_tokens=20, mode="plain").tokens
    res = engine.generate([1, 2, 3], max_tokens=20, mode="speculative", draft_tokens=3)
    assert res.tokens == plain and res.stats.drafted > 0
    add_drafter(tmp_path / "b", drafter, force=True, progress=False, drafter_options={"coreml": False})
    assert json.loads((tmp_path / "b" / "drafter" / "config.json").read_text())["vocab_size"] == 72


def test_convert_refuses_a_drafter_of_another_tokenizer(tmp_path):
    from edgespec.converters.convert import convert

    from edgespec.tokenizer import Tokenizer

    src = tmp_path / "tok"
    src.mkdir()
    make_tiny_tokenizer(TOKENS).save(src)
    spec = json.loads((src / "tokenizer.json").read_text())
    spec["model"]["vocab"]["x"], spec["model"]["vocab"]["y"] = spec["model"]["vocab"]["y"], spec["model"]["vocab"]["x"]
    (src / "tokenizer.json").write_text(json.dumps(spec))
    verifier = _hf_folder(tmp_path / "v", 72, 2, 0)
    drafter = _hf_folder(tmp_path / "d", 72, 1, 5, tokenizer=Tokenizer.from_folder(src))
    with pytest.raises(VocabularyMismatchError, match=r"at id 24: drafter 'y', verifier 'x'"):
        convert(verifier, tmp_path / "b", progress=False, drafter=drafter, drafter_options={"coreml": False})
    assert not (tmp_path / "b").exists()
