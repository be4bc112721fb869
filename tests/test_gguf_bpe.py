"""Byte-level BPE GGUF tokenizers: the pre-tokenizer named by tokenizer.ggml.pre (llama.cpp's
names) splits the text before the merges, as the model's own tokenizer.json does."""

from __future__ import annotations

import pytest
from conftest import make_tiny_model
from gguf_support import byte_level_tokens, llama_cpp_tensors, write_gguf
from mlx.utils import tree_flatten

from edgespec.errors import ModelLoadError
from edgespec.weights.loader import load_gguf

# merges ranked: "3 4" first, then "1 2", "12 3"; no "4 5"; "' S" makes the piece "'S"
MERGES = ["3 4", "1 2", "12 3", "Ġ x", "' S"]


def _gguf(tmp_path, pre: str | None):
    import numpy as np

    tokens = byte_level_tokens() + ["34", "12", "123", "Ġx", "'S", "<|endoftext|>"]
    model = make_tiny_model(0, vocab_size=len(tokens))
    config = model.args.to_dict()
    weights = llama_cpp_tensors("llama", config, {k: np.array(v) for k, v in tree_flatten(model.parameters())})
    tok = {"model": "gpt2", "tokens": tokens, "types": [1] * (len(tokens) - 1) + [3], "merges": MERGES,
           "eos": len(tokens) - 1, "pre": pre}
    return write_gguf(tmp_path / f"{pre}.gguf", "llama", config, weights, tok)


def _pieces(tmp_path, pre, text):
    tok = load_gguf(_gguf(tmp_path, pre)).tokenizer
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    return [tok.id_to_token(i) for i in ids]


@pytest.mark.parametrize(("pre", "want"), [
    (None, ["12", "34", "5"]),            # GPT-2: the digit run is one piece, merged by rank
    ("gpt2", ["12", "34", "5"]),
    ("llama-bpe", ["123", "4", "5"]),     # Llama 3: digits in runs of at most 3: "123" | "45"
    ("qwen2", ["1", "2", "3", "4", "5"]),  # one digit per piece
    ("smollm", ["1", "2", "3", "4", "5"]),
])  # fmt: skip
def test_digit_runs_split_per_pre_tokenizer(tmp_path, pre, want):
    assert _pieces(tmp_path, pre, "12345") == want


def test_case_insensitive_contractions_for_qwen2_and_llama3(tmp_path):
    # (?i:'s|...) isolates "'S" so its merge applies; GPT-2's regex knows only "'s", so "'" and
    # "S" land in different pieces and cannot merge
    for pre in ("qwen2", "llama-bpe"):
        assert _pieces(tmp_path, pre, "x'S x") == ["x", "'S", "Ġx"]
    assert _pieces(tmp_path, "gpt2", "x'S x") == ["x", "'", "S", "Ġx"]


def test_an_unknown_pre_tokenizer_is_refused(tmp_path):
    with pytest.raises(ModelLoadError, match="pre-tokenizer 'tekken' is not supported"):
        load_gguf(_gguf(tmp_path, "tekken"))
