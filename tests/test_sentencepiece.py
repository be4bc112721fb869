"""SentencePiece tokenizers from GGUF metadata (tokenizer.ggml.model == "llama").

A BPE SentencePiece model with byte fallback is trained here on a small text; its
pieces, scores and types go into a GGUF's tokenizer metadata; edgespec's tokenizer
read from that GGUF must encode id for id as `sentencepiece` itself does.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf_support import write_gguf

from edgespec.weights.loader import load_gguf

spm = pytest.importorskip("sentencepiece")

CORPUS = """The quick brown fox jumps over the lazy dog. Speculative decoding drafts tokens and verifies them.
A tokenizer splits text into pieces; byte fallback covers every character it has never seen.
Le renard brun saute par-dessus le chien paresseux. Der schnelle braune Fuchs springt.
El zorro marrón salta sobre el perro perezoso. Быстрая коричневая лиса прыгает.
def add(a, b):\n    return a + b  # numbers 0123456789 and   spaces
"""
TEXT = ("Hello world! Über naïve café — 東京タワー 🚀 emoji, Ελληνικά, עברית, हिन्दी; "
        "  two  spaces, tabs\tand\nnewlines; the fox jumps.")
# llama.cpp's token types from SentencePiece's piece kinds
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}<|assistant|>"


def _train(d, dummy_prefix: bool = True):
    (d / "corpus.txt").write_text(CORPUS * 3)
    spm.SentencePieceTrainer.train(
        input=str(d / "corpus.txt"), model_prefix=str(d / "m"), vocab_size=420, model_type="bpe",
        byte_fallback=True, character_coverage=0.9995, normalization_rule_name="identity",
        remove_extra_whitespaces=False, add_dummy_prefix=dummy_prefix,
        user_defined_symbols=["<|user|>", "<|assistant|>"], bos_id=1, eos_id=2, unk_id=0, pad_id=-1, minloglevel=2,
    )
    return spm.SentencePieceProcessor(model_file=str(d / "m.model"))


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory):
    return _train(tmp_path_factory.mktemp("spm"))


def _types(sp) -> list[int]:
    out = []
    for i in range(sp.get_piece_size()):
        if sp.is_unknown(i):
            out.append(UNKNOWN)
        elif sp.is_control(i):
            out.append(CONTROL)
        elif sp.is_byte(i):
            out.append(BYTE)
        elif sp.is_unused(i):
            out.append(UNUSED)
        elif sp.id_to_piece(i) in ("<|user|>", "<|assistant|>"):
            out.append(USER_DEFINED)
        else:
            out.append(NORMAL)
    return out


@pytest.fixture(scope="module")
def gguf_tok(sp_model, tmp_path_factory):
    return _gguf_tokenizer(sp_model, tmp_path_factory.mktemp("g"))


def _gguf_tokenizer(sp_model, folder, extra_kv=None):
    from conftest import make_tiny_model
    from gguf_support import llama_cpp_tensors
    from mlx.utils import tree_flatten

    n = sp_model.get_piece_size()
    model = make_tiny_model(0, vocab_size=n)
    config = model.args.to_dict()
    weights = llama_cpp_tensors("llama", config, {k: np.array(v) for k, v in tree_flatten(model.parameters())})
    tok = {"model": "llama", "tokens": [sp_model.id_to_piece(i) for i in range(n)], "types": _types(sp_model),
           "scores": [sp_model.get_score(i) for i in range(n)], "bos": 1, "eos": 2, "unk": 0, "add_bos": True,
           "chat_template": TEMPLATE}
    path = write_gguf(folder / "sp.gguf", "llama", config, weights, tok, extra_kv=extra_kv)
    return load_gguf(path).tokenizer


def test_the_text_needs_byte_fallback(sp_model):
    ids = sp_model.encode(TEXT)
    assert any(sp_model.is_byte(i) for i in ids)  # characters outside the vocabulary
    assert sp_model.decode(ids) == TEXT


def test_ids_equal_sentencepiece(sp_model, gguf_tok):
    for text in (TEXT, CORPUS, "x", " leading space", "trailing  ", "🚀🚀", "fox" * 20):
        assert gguf_tok.encode(text, add_special_tokens=False) == sp_model.encode(text), text


def test_round_trip(gguf_tok):
    for text in (TEXT, CORPUS, " leading space"):
        assert gguf_tok.decode(gguf_tok.encode(text, add_special_tokens=False)) == text


def test_bos_rule_and_control_tokens(sp_model, gguf_tok):
    ids = gguf_tok.encode("the fox")
    assert ids[0] == 1 and ids[1:] == sp_model.encode("the fox")  # add_bos_token from the GGUF
    assert gguf_tok.eos_token_ids == {2} and gguf_tok.bos_token == "<s>"
    assert gguf_tok.decode([1, *sp_model.encode("the fox"), 2], skip_special_tokens=True) == "the fox"


def test_user_defined_tokens_and_chat_template(sp_model, gguf_tok):
    text = gguf_tok.apply_chat_template([{"role": "user", "content": "the fox"}])
    assert text == "<|user|>the fox<|assistant|>"
    ids = gguf_tok.encode(text, add_special_tokens=False)
    # llama.cpp's rule: added pieces are cut out first, each text fragment is encoded alone
    # (with its own space prefix). sentencepiece instead prefixes the whole text once.
    user, assistant = sp_model.piece_to_id("<|user|>"), sp_model.piece_to_id("<|assistant|>")
    assert ids == [user, *sp_model.encode("the fox"), assistant]
    assert gguf_tok.decode(ids) == "<|user|> the fox<|assistant|>"




def test_a_bundle_keeps_the_sentencepiece_tokenizer(sp_model, gguf_tok, tmp_path):
    from edgespec.tokenizer import Tokenizer

    gguf_tok.save(tmp_path)  # what `edgespec convert` writes into a bundle
    again = Tokenizer.from_folder(tmp_path)
    assert again.encode(TEXT) == gguf_tok.encode(TEXT) == [1, *sp_model.encode(TEXT)]
    assert again.decode(sp_model.encode(TEXT)) == TEXT


def test_without_a_space_prefix(tmp_path):
    # Gemma's SentencePiece adds no dummy prefix; its GGUF says tokenizer.ggml.add_space_prefix = false
    sp = _train(tmp_path, dummy_prefix=False)
    tok = _gguf_tokenizer(sp, tmp_path, extra_kv={"tokenizer.ggml.add_space_prefix": False})
    for text in (TEXT, "fox", " fox"):
        assert tok.encode(text, add_special_tokens=False) == sp.encode(text), text
        assert tok.decode(sp.encode(text)) == text
    assert sp.encode("fox") != sp.encode(" fox")
