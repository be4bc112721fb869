"""Real model (SmolLM2-135M): lookahead and prompt lookup reproduce plain greedy decoding."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.real_model

TEXT = (
    "The council will hold a public meeting next month. The library plan would cost two "
    "million dollars, and the hotel plan would create forty jobs."
)


def test_lookahead_and_prompt_lookup_match_plain_on_real_model(real_engine):
    messages = [{"role": "user", "content": f"Repeat this text word for word:\n\n{TEXT}"}]
    ref = real_engine.generate(messages=messages, max_tokens=24, mode="plain")
    la = real_engine.generate(messages=messages, max_tokens=24, mode="lookahead")
    pl = real_engine.generate(
        messages=messages, max_tokens=24, mode="prompt_lookup", draft_tokens=6
    )
    assert la.tokens == ref.tokens
    assert pl.tokens == ref.tokens
    # Copying its input, both need far fewer verifier passes than one per token.
    assert la.stats.tokens_per_pass > 1.5
    assert pl.stats.tokens_per_pass > 1.5
