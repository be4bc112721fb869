"""Tree modes and the cascade on the real default model: greedy output equals plain decoding."""

from __future__ import annotations

import pytest

from edgespec.drafters import load_drafter, shipped_drafter_path
from edgespec.drafters.self_spec import SelfSpecDrafter

pytestmark = pytest.mark.real_model

PROMPTS = ["Write a Python function that adds two numbers."]  # one short prompt: CI time


def test_tree_and_cascade_greedy_equal_plain(real_engine):
    engine = real_engine
    n = len(engine.model.layers)
    self_d = SelfSpecDrafter(
        engine.model, [i for i in range(n) if i not in (19, 7, 17, 14, 3, 16, 12)]
    )
    shipped = shipped_drafter_path(engine)
    tiny = load_drafter(engine, str(shipped)) if shipped else None
    runs = [
        ("tree", self_d, {"shape": "static", "branching": "2x2x1"}),
        (
            "tree",
            self_d,
            {"shape": "dynamic", "budget": 12, "sources": "drafter+prompt_lookup+pool"},
        ),
    ]
    if tiny is not None:
        runs.append(("cascade", tiny, {"mid_layers": "+".join(map(str, self_d.layer_ids))}))
    saved = engine.drafter
    try:
        for text in PROMPTS:
            msgs = [{"role": "user", "content": text}]
            engine.drafter = None
            ref = engine.chat(msgs, max_tokens=16, mode="plain").tokens
            for mode, drafter, opts in runs:
                engine.drafter = drafter
                res = engine.chat(msgs, max_tokens=16, mode=mode, draft_tokens=4, **opts)
                assert res.tokens == ref, (mode, opts, text)
                assert res.stats.verifier_passes < 16  # some candidates were accepted
    finally:
        engine.drafter = saved
