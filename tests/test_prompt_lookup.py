"""Prompt lookup: the drafter's look-ups and greedy equality of mode prompt_lookup with plain."""

from __future__ import annotations

import random

import pytest
from conftest import make_tiny_engine

from edgespec.drafters.base import Drafter
from edgespec.drafters.prompt_lookup import PromptLookupDrafter


def test_drafter_copies_after_the_latest_longest_match():
    d = PromptLookupDrafter(ngram_max=3)
    assert isinstance(d, Drafter)
    d.begin([5, 1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 4, 2, 3])
    # suffix "2 3": latest earlier occurrence ends at index 8, followed by 7 8 4
    dr = d.draft(3)
    assert dr.tokens == [7, 8, 4] and dr.logprobs is None
    d.accept(1, 6)  # kept 7, then the verifier said 6
    assert d.seq[-2:] == [7, 6]
    assert d.draft(4).tokens == []  # neither "3 7 6", "7 6" nor "6" occurred before
    d.begin([1, 2, 3])
    assert d.draft(4).tokens == []  # nothing repeats yet
    d.accept(0, 1)
    assert d.draft(4).tokens == [2, 3, 1]  # "1" occurred at 0, followed by 2 3 1


def test_drafter_sync_rewinds_history():
    d = PromptLookupDrafter()
    d.begin([4, 5, 6, 4])
    assert d.draft(2).tokens == [5, 6]
    d.sync([4, 5, 6, 4, 5, 6])
    assert d.draft(1).tokens == [4]
    d.sync([4, 5, 7])  # diverged: re-indexed from scratch
    assert d.seq == [4, 5, 7] and d.draft(3).tokens == []
    with pytest.raises(ValueError):
        PromptLookupDrafter(ngram_max=0)


def test_prompt_lookup_mode_greedy_equals_plain():
    engine = make_tiny_engine(2)
    rng = random.Random(5)
    fewer = 0
    for i in range(6):
        body = [rng.randrange(1, 64) for _ in range(rng.randrange(3, 12))]
        prompt = body * 3 if i % 2 == 0 else body
        ref = engine.generate(prompt, max_tokens=24, mode="plain")
        got = engine.generate(prompt, max_tokens=24, mode="prompt_lookup", draft_tokens=4)
        assert got.tokens == ref.tokens, prompt
        assert got.stats.mode == "prompt_lookup"
        fewer += got.stats.verifier_passes < ref.stats.verifier_passes
    assert fewer >= 2


def test_prompt_lookup_mode_validates_options():
    engine = make_tiny_engine(0)
    with pytest.raises(ValueError, match="ngram_max"):
        engine.generate([1, 2, 3], max_tokens=2, mode="prompt_lookup", ngram_max=0)
