"""The drafter shipped for SmolLM2-135M-Instruct: loads by default, drafts, stays exact."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from edgespec.drafters import DATA, attach_drafter, shipped_drafter_path
from edgespec.drafters.distilled import DistilledDrafter

SHIPPED = DATA / "smollm2-135m-instruct"


def test_shipped_folder_is_complete_and_small():
    names = {p.name for p in SHIPPED.iterdir()}
    assert {"config.json", "model.safetensors", "vocab_map.json", "MODEL_CARD.md", "corpus.bin"} <= names
    size = sum(p.stat().st_size for p in SHIPPED.iterdir() if p.name != "corpus.bin")
    assert size < 26e6  # the drafter's ~20 MB budget (see MODEL_CARD.md for the breakdown)
    assert (SHIPPED / "corpus.bin").stat().st_size < 12e6  # the corpus source's table (MODEL_CARD.md: 9.9 MB)
    from edgespec.adaptive.corpus import CorpusTable

    table = CorpusTable.load(SHIPPED / "corpus.bin")  # this format, whole, 10 bytes a context in memory
    assert table.ids == "u2" and len(table) > 900_000 and table.nbytes == 10 * len(table)
    vmap = json.loads((SHIPPED / "vocab_map.json").read_text())
    assert vmap["full_vocab_size"] == 49152 and vmap["ids"][0] == -1
    assert json.loads((SHIPPED / "config.json").read_text())["vocab_size"] == len(vmap["ids"])


@pytest.mark.real_model
def test_shipped_drafter_is_found_and_greedy_exact(real_engine):
    assert shipped_drafter_path(real_engine) == SHIPPED
    try:
        drafter = attach_drafter(real_engine, None)
        assert isinstance(drafter, DistilledDrafter) and drafter.vocab_size == 49152
        msgs = [{"role": "user", "content": "Write a Python function that adds two numbers."}]
        plain = real_engine.generate(messages=msgs, max_tokens=24, temperature=0, mode="plain")
        spec = real_engine.generate(messages=msgs, max_tokens=24, temperature=0, mode="speculative", draft_tokens=4)
        assert spec.tokens == plain.tokens
        assert spec.stats.accepted > 0  # the drafter predicts the verifier at least sometimes
    finally:
        attach_drafter(real_engine, "none")


@pytest.mark.real_model
def test_shipped_corpus_is_found_checked_and_drafts(real_engine):
    from edgespec.adaptive.corpus import CorpusTable

    table = real_engine.corpus_table
    assert isinstance(table, CorpusTable) and table.vocab_hash == real_engine.loaded.tokenizer.vocab_hash()
    # Checked against the bundle's record of the hash (computing it costs ~0.1 s of a first reply).
    assert real_engine._vocab_hash() == real_engine.loaded.tokenizer.vocab_hash()
    assert len(table.priors) >= 20  # measured on held-out answers when it was built
    ids = real_engine.loaded.tokenizer.encode("Here's a Python function that", add_special_tokens=False)
    tokens, bucket = table.chain(ids, 8)
    assert tokens and bucket is not None  # a 135M model's habit, in its own answers


def test_shipped_vocab_hash_matches_default_tokenizer():
    tok = Path(__file__).resolve().parents[1] / ".cache" / "edgespec" / "models" / "SmolLM2-135M-Instruct-f32"
    if not (tok / "tokenizer.json").is_file():
        pytest.skip("default model not converted in this checkout's cache")
    from edgespec.tokenizer import Tokenizer

    assert json.loads((SHIPPED / "vocab_map.json").read_text())["vocab_hash"] == Tokenizer.from_folder(tok).vocab_hash()
