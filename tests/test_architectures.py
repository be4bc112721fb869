"""Architectures: the model contract, every registered architecture against transformers."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from conftest import make_tiny_model
from edgespec.models import get_architecture, model_from_config, supported_model_types

from edgespec.errors import ModelLoadError

# ---------------------------------------------------------------- the model contract


def _batch_mask(valid: np.ndarray, T: int) -> mx.array:
    """(B, S) key validity -> (B, 1, T, S) bool: causal over the last T slots, padding masked.

    A padded query row still sees itself so no row is all-False (softmax of nothing is NaN)."""
    B, S = valid.shape
    q = np.arange(S - T, S)[:, None]  # slot of each new token
    k = np.arange(S)[None, :]
    causal = k <= q  # (T, S)
    m = causal[None] & (valid[:, None, :] | (k == q)[None])
    return mx.array(m[:, None])


def _run_alone(model, ids: list[int], steps: list[int]) -> list[np.ndarray]:
    cache = model.make_cache()
    outs = [np.array(model(mx.array([ids]), cache)[0, -1])]
    for t in steps:
        outs.append(np.array(model(mx.array([[t]]), cache)[0, -1]))
    return outs


def test_batched_rows_at_different_offsets_equal_each_row_alone():
    """(B, T) positions + per-row masks: two left-padded prompts in one batch, prefill and
    three decode steps, give each row's logits as if it ran alone."""
    model = make_tiny_model(3)
    a, b = [5, 9, 2, 7, 1], [3, 8, 8, 4, 6, 2, 9, 11]
    steps_a, steps_b = [12, 13, 14], [21, 22, 23]
    alone_a, alone_b = _run_alone(model, a, steps_a), _run_alone(model, b, steps_b)

    S = max(len(a), len(b))
    pad = [S - len(a), S - len(b)]
    ids = mx.array([[0] * pad[0] + a, [0] * pad[1] + b])
    valid = np.array([[j >= p for j in range(S)] for p in pad])
    positions = mx.array([[max(j - p, 0) for j in range(S)] for p in pad])
    cache = model.make_cache()
    out = model(ids, cache, mask=_batch_mask(valid, S), positions=positions)
    got = [[np.array(out[0, -1])], [np.array(out[1, -1])]]
    for i in range(3):
        valid = np.concatenate([valid, np.ones((2, 1), bool)], axis=1)
        pos = mx.array([[len(a) + i], [len(b) + i]])
        step = mx.array([[steps_a[i]], [steps_b[i]]])
        out = model(step, cache, mask=_batch_mask(valid, 1), positions=pos)
        got[0].append(np.array(out[0, -1]))
        got[1].append(np.array(out[1, -1]))
    for g, want in ((got[0], alone_a), (got[1], alone_b)):
        for x, y in zip(g, want, strict=True):
            np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-4)


def test_positions_1d_and_2d_agree_and_embed_head_compose():
    model = make_tiny_model(4)
    ids = mx.array([[4, 5, 6, 7]])
    pos = mx.array([3, 4, 5, 6])
    one = model(ids, positions=pos)
    two = model(ids, positions=pos[None])
    np.testing.assert_allclose(np.array(one), np.array(two), rtol=1e-6, atol=1e-6)
    # shifting every position by a constant leaves a causal forward unchanged (RoPE is relative)
    np.testing.assert_allclose(np.array(one), np.array(model(ids)), rtol=1e-4, atol=1e-4)
    # embed -> layers -> head equals the forward pass
    h = model.embed(ids)
    for layer in model.layers:
        h = layer(h, "causal", None, None)
    np.testing.assert_allclose(np.array(model.head(h)), np.array(model(ids)), rtol=1e-5, atol=1e-5)


def test_registry_refuses_unknown_model_type_listing_supported():
    with pytest.raises(ModelLoadError, match="unsupported architecture.*'gpt_neox'.*llama"):
        get_architecture("gpt_neox")
    assert "llama" in supported_model_types()
    model = model_from_config(dict(model_type="mistral", hidden_size=64, num_hidden_layers=1,
                                   intermediate_size=64, num_attention_heads=4, vocab_size=32))
    assert len(model.layers) == 1 and model.args.model_type == "mistral"
