"""KV cache rollback and model invariants on tiny random models."""

import mlx.core as mx
import numpy as np
import pytest
from conftest import make_tiny_model

from edgespec.generate import prefill


def run_tokens(model, tokens, cache=None):
    cache = cache if cache is not None else model.make_cache()
    return model(mx.array(tokens)[None], cache), cache


@pytest.mark.parametrize("overrides", [{}, {"model_type": "qwen2"}, {"tie_word_embeddings": False}])
def test_incremental_decoding_equals_full_pass(overrides):
    model = make_tiny_model(1, **overrides)
    toks = [3, 7, 1, 9, 4, 4, 2, 8]
    full, _ = run_tokens(model, toks)
    cache = model.make_cache()
    steps = [run_tokens(model, [t], cache)[0][0, -1] for t in toks]
    np.testing.assert_allclose(np.array(mx.stack(steps)), np.array(full[0]), atol=1e-4)


@pytest.mark.parametrize("n_trim", [1, 3, 6])
def test_trim_then_continue_equals_fresh_prefill(n_trim):
    model = make_tiny_model(2)
    prefix = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]
    cache = model.make_cache()
    run_tokens(model, prefix, cache)
    run_tokens(model, [40, 41, 42, 43, 44, 45], cache)  # a rejected draft
    for c in cache:
        c.trim(6)
    for c in cache:
        c.trim(n_trim)  # roll back further into the accepted prefix
    kept = prefix[: len(prefix) - n_trim]
    assert cache[0].offset == len(kept)
    cont = [20, 21, 22]
    out, _ = run_tokens(model, cont, cache)
    fresh, fresh_cache = run_tokens(model, kept + cont)
    np.testing.assert_allclose(np.array(out[0]), np.array(fresh[0, -3:]), atol=1e-4)
    for a, b in zip(cache, fresh_cache, strict=True):
        np.testing.assert_allclose(np.array(a.state[0]), np.array(b.state[0]), atol=1e-5)


def test_cache_grows_past_its_step():
    model = make_tiny_model(3)
    toks = np.random.default_rng(0).integers(0, 64, 300).tolist()
    cache = model.make_cache()
    last = prefill(model, cache, toks, chunk=128)
    full, _ = run_tokens(model, toks)
    assert cache[0].offset == 300
    np.testing.assert_allclose(np.array(last), np.array(full[0, -1]), atol=1e-4)


def test_a_long_prompt_is_cached_in_one_allocation():
    """Chunked prefill reserves the prompt's room up front: no regrowth (a copy of the whole
    cache) per chunk; decoding past the reserved room grows it again, by steps."""
    model = make_tiny_model(3)
    toks = np.random.default_rng(1).integers(0, 64, 1100).tolist()
    cache = model.make_cache()
    last = prefill(model, cache, toks, chunk=128)  # 9 chunks, 1100 > 4 * KVCache.step
    assert [c.allocations for c in cache] == [1] * len(cache)
    assert cache[0].keys.shape[2] == 1280  # 1100 rounded up to the step (256)
    full, _ = run_tokens(model, toks)
    np.testing.assert_allclose(np.array(last), np.array(full[0, -1]), atol=1e-4)
    for t in range(181):  # 1100 + 181 > 1280
        run_tokens(model, [t % 64], cache)
    assert cache[0].allocations == 2 and cache[0].offset == 1281


def test_keep_packs_selected_entries():
    model = make_tiny_model(4)
    cache = model.make_cache()
    run_tokens(model, [1, 2, 3], cache)
    run_tokens(model, [10, 11, 12, 13], cache)
    before = np.array(cache[0].state[0])
    for c in cache:
        c.keep(3, [1, 3])
    after = np.array(cache[0].state[0])
    assert cache[0].offset == 5
    np.testing.assert_array_equal(after[:, :, 3], before[:, :, 4])
    np.testing.assert_array_equal(after[:, :, 4], before[:, :, 6])


def test_explicit_positions_match_contiguous_rope():
    model = make_tiny_model(5)
    toks = [4, 5, 6, 7]
    a, _ = run_tokens(model, toks)
    mask = mx.tril(mx.ones((4, 4), dtype=mx.bool_))
    b = model(mx.array(toks)[None], model.make_cache(), mask=mask, positions=mx.arange(4))
    np.testing.assert_allclose(np.array(a), np.array(b), atol=1e-5)


def test_layer_subset_changes_output():
    model = make_tiny_model(6)
    toks = mx.array([[1, 2, 3]])
    full = model(toks)
    part = model(toks, layer_ids=[0])
    assert not np.allclose(np.array(full), np.array(part))


def test_unsupported_architecture_is_refused():
    from edgespec.models.llama import ModelArgs

    with pytest.raises(ValueError, match="unsupported architecture 'gpt_neox'"):
        ModelArgs.from_dict({"model_type": "gpt_neox", "hidden_size": 8})
    with pytest.raises(ValueError, match="lacks required field"):
        ModelArgs.from_dict({"model_type": "llama", "hidden_size": 8})


def test_llama3_rope_scaling_changes_frequencies():
    from edgespec.models.llama import ModelArgs, rope_frequencies

    base = dict(model_type="llama", hidden_size=64, num_hidden_layers=1, intermediate_size=8,
                num_attention_heads=2, vocab_size=8, rope_theta=500000.0)
    scaled = ModelArgs.from_dict({**base, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}})
    f = np.array(rope_frequencies(scaled))
    plain = 500000.0 ** (np.arange(0, 32, 2) / 32)
    assert f[0] == pytest.approx(plain[0])  # high frequencies untouched
    assert f[-1] == pytest.approx(plain[-1] * 8.0)  # low frequencies stretched by `factor`
