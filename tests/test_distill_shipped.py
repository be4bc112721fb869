"""The drafters shipped for SmolLM2-135M-Instruct: the feature drafter loads by default, the
student is the fallback (cascade, Core ML); both draft and stay exact."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from edgespec.drafters import DATA, attach_drafter, shipped_drafter_path
from edgespec.drafters.distilled import DistilledDrafter

SHIPPED = DATA / "smollm2-135m-instruct"
SHIPPED_FEATURE = DATA / "smollm2-135m-instruct-feature"


def test_shipped_folder_is_complete_and_small():
    names = {p.name for p in SHIPPED.iterdir()}
    assert {"config.json", "model.safetensors", "vocab_map.json", "MODEL_CARD.md"} <= names
    size = sum(p.stat().st_size for p in SHIPPED.iterdir())
    assert size < 26e6  # the ~20 MB budget (see MODEL_CARD.md for the breakdown)
    vmap = json.loads((SHIPPED / "vocab_map.json").read_text())
    assert vmap["full_vocab_size"] == 49152 and vmap["ids"][0] == -1
    assert json.loads((SHIPPED / "config.json").read_text())["vocab_size"] == len(vmap["ids"])


def test_shipped_feature_folder_is_complete_and_small():
    names = {p.name for p in SHIPPED_FEATURE.iterdir()}
    assert {"config.json", "model.safetensors", "vocab_map.json", "drafter.json", "MODEL_CARD.md"} <= names
    assert sum(p.stat().st_size for p in SHIPPED_FEATURE.iterdir()) < 12e6  # no embedding or head of its own
    assert json.loads((SHIPPED_FEATURE / "drafter.json").read_text())["format"] == "edgespec-feature-drafter"
    card = (SHIPPED_FEATURE / "MODEL_CARD.md").read_text()
    assert "Held-out acceptance" in card and "| code |" in card and "| chat |" in card


@pytest.mark.real_model
def test_shipped_feature_drafter_is_the_default_and_greedy_exact(real_engine):
    from edgespec.drafters.feature import FeatureDrafter

    assert shipped_drafter_path(real_engine) == SHIPPED_FEATURE
    try:
        drafter = attach_drafter(real_engine, None)
        assert isinstance(drafter, FeatureDrafter) and drafter.vocab_size == 49152
        msgs = [{"role": "user", "content": "Write a Python function that adds two numbers."}]
        plain = real_engine.generate(messages=msgs, max_tokens=32, temperature=0, mode="plain")
        auto = real_engine.generate(messages=msgs, max_tokens=32, temperature=0)  # mode auto -> speculative
        spec = real_engine.generate(messages=msgs, max_tokens=32, temperature=0, mode="speculative", draft_tokens=4)
        assert auto.tokens == plain.tokens and spec.tokens == plain.tokens
        assert spec.stats.accepted >= 0.3 * spec.stats.drafted  # measured ~0.6 on held-out prompts
    finally:
        attach_drafter(real_engine, "none")


@pytest.mark.real_model
def test_shipped_student_is_found_and_greedy_exact(real_engine):
    assert shipped_drafter_path(real_engine, kinds=("",)) == SHIPPED
    try:
        drafter = attach_drafter(real_engine, str(SHIPPED))
        assert isinstance(drafter, DistilledDrafter) and drafter.vocab_size == 49152
        msgs = [{"role": "user", "content": "Write a Python function that adds two numbers."}]
        plain = real_engine.generate(messages=msgs, max_tokens=24, temperature=0, mode="plain")
        spec = real_engine.generate(messages=msgs, max_tokens=24, temperature=0, mode="speculative", draft_tokens=4)
        assert spec.tokens == plain.tokens
        assert spec.stats.accepted > 0  # the drafter predicts the verifier at least sometimes
    finally:
        attach_drafter(real_engine, "none")


def test_shipped_vocab_hash_matches_default_tokenizer():
    tok = Path(__file__).resolve().parents[1] / ".cache" / "edgespec" / "models" / "SmolLM2-135M-Instruct-f32"
    if not (tok / "tokenizer.json").is_file():
        pytest.skip("default model not converted in this checkout's cache")
    from edgespec.tokenizer import Tokenizer

    assert json.loads((SHIPPED / "vocab_map.json").read_text())["vocab_hash"] == Tokenizer.from_folder(tok).vocab_hash()
