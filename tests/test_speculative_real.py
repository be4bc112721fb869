"""Speculative decoding on SmolLM2-135M-Instruct: greedy output equals plain for K 1..8, pipelined or not."""

from __future__ import annotations

import pytest

from edgespec.drafters.self_spec import SelfSpecDrafter, skip_set_for

pytestmark = pytest.mark.real_model

TOPICS = [
    "Name a fruit.",
    "What is 2 + 2?",
    "Say hello in Spanish.",
    "Write a haiku about rain.",
    "def add(a, b):",
    "List three colors.",
    "What is the capital of France?",
    "Give me a word that rhymes with cat.",
    "Translate 'thank you' into German.",
    "Summarize: the cat sat on the mat all day.",
    "Write a SQL query selecting all rows from users.",
    "Why do leaves change color?",
    "Count from one to five.",
    "What is a prime number?",
    "Suggest a name for a dog.",
    "How many legs does a spider have?",
    "Write one sentence about the sea.",
    "What does CPU stand for?",
    "Give a synonym for happy.",
    "Finish this: once upon a time",
]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def setup(real_engine):
    from edgespec.drafters import load_drafter

    prompts = [real_engine.tokenizer.encode_chat([{"role": "user", "content": t}]) for t in TOPICS]
    plain = [real_engine.generate(p, max_tokens=MAX_TOKENS, mode="plain").tokens for p in prompts]
    # The shipped distilled drafter: a real separate drafter model, and cheap (about 6% of a
    # verifier step), which keeps 10 prompts x 8 values of K affordable in CI.
    drafter = load_drafter(real_engine, None)
    assert drafter is not None, "the shipped drafter for SmolLM2-135M-Instruct was not found"
    yield real_engine, drafter, prompts, plain
    real_engine.drafter = None


@pytest.mark.parametrize("k", range(1, 9))
def test_real_greedy_equals_plain(setup, k):
    engine, drafter, prompts, plain = setup
    engine.drafter = drafter
    drafted = 0
    for i, (p, ref) in enumerate(zip(prompts, plain, strict=True)):
        if (i + k) % 2:  # half the prompts per K (CI time); each prompt meets 4 values of K
            continue
        pipeline = (i // 2 + k) % 2 == 0  # every K sees both
        res = engine.generate(p, max_tokens=MAX_TOKENS, mode="speculative", draft_tokens=k, pipeline=pipeline)
        assert res.tokens == ref, f"K={k} pipeline={pipeline} prompt {TOPICS[i]!r}"
        drafted += res.stats.drafted
    assert drafted > 0


@pytest.mark.parametrize("k", [2, 5])
def test_real_self_speculation_equals_plain(setup, k):
    """The zero-weight drafter (a subset of the verifier's own layers) on a few prompts."""
    engine, _, prompts, plain = setup
    found = skip_set_for(engine.loaded, search=False)
    # Without a cached search result use a fixed subset: exactness does not depend on it.
    keep = found["keep"] if found else [i for i in range(30) if i % 3 != 1]
    engine.drafter = SelfSpecDrafter(engine.model, keep)
    for i in range(0, len(prompts), 5):
        res = engine.generate(prompts[i], max_tokens=MAX_TOKENS, mode="speculative", draft_tokens=k, pipeline=bool(i % 2))
        assert res.tokens == plain[i], f"K={k} prompt {TOPICS[i]!r}"
        assert res.stats.drafted > 0


@pytest.mark.parametrize("k", [1, 4])
def test_real_feature_drafter_equals_plain(setup, k):
    """A feature drafter on the real verifier: prefill, verify passes and plain steps hand it the
    verifier's hidden states. Exactness does not depend on its training, so an untrained one
    (seeded) checks the plumbing at real scale; the tiny-model tests cover a trained one."""
    from edgespec.converters.distill.feature_pipeline import feature_config, init_feature_model

    from edgespec.drafters.distilled import VocabMap
    from edgespec.drafters.feature import FeatureDrafter

    engine, _, prompts, plain = setup
    model = init_feature_model(feature_config(engine.model.args, 1), engine.model, seed=k)
    vmap = VocabMap([-1] + list(range(8191)), engine.model.args.vocab_size)
    engine.drafter = FeatureDrafter(model, engine.model, vmap)
    drafted = 0
    for i, (p, ref) in enumerate(zip(prompts, plain, strict=True)):
        if (i + k) % 2:  # K=1 and K=4 split the 20 prompts between them (CI time)
            continue
        res = engine.generate(p, max_tokens=MAX_TOKENS, mode="speculative", draft_tokens=k)
        assert res.tokens == ref, f"K={k} prompt {TOPICS[i]!r}"
        drafted += res.stats.drafted
    assert drafted > 0
