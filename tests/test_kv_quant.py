"""KV-cache quantization (edgespec.caches.kv_quant): opt-in, exact for every mode with respect to plain
decoding under the same quantized cache, in the batch and the prefix cache; smaller."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from conftest import make_tiny_engine, make_tiny_model

from edgespec.caches import sessions
from edgespec.caches.kv import KVCache
from edgespec.caches.kv_quant import QuantizedKVCache
from edgespec.caches.prefix import PrefixCache
from edgespec.drafters.mlx_drafter import MLXDrafter
from edgespec.engine import Engine
from edgespec.modes import available_modes

HEADS = {"num_attention_heads": 2, "num_key_value_heads": 1}  # head size 32: one group of 32


def engine(bits=8, start=0, cache_bytes=0, block=4):
    e = make_tiny_engine(3, scale=1.3, **HEADS)
    e.kv_bits, e.kv_group_size, e.quantized_kv_start = bits, 32, start
    e.drafter = MLXDrafter(make_tiny_model(4, num_hidden_layers=1))
    e.__dict__["_prefix_cache"] = PrefixCache(cache_bytes, block=block)
    return e


PROMPT = [int(t) for t in np.random.default_rng(1).integers(1, 64, 23)] * 2


@pytest.mark.parametrize("bits,start", [(8, 0), (4, 0), (4, 13)])
def test_every_mode_equals_plain_under_the_same_quantized_cache(bits, start):
    e = engine(bits, start)
    ref = e.generate(PROMPT, max_tokens=30, mode="plain")
    full = make_tiny_engine(3, scale=1.3, **HEADS).generate(PROMPT, max_tokens=30, mode="plain")
    for mode in [*available_modes(), "auto"]:
        r = e.generate(PROMPT, max_tokens=30, mode=mode)
        assert r.tokens == ref.tokens, mode
    assert e.generate_many([PROMPT, PROMPT[:20]], max_tokens=30, mode="auto")[0].tokens == ref.tokens
    # it is a different cache: at 4 bits this random model's logits move (the output may too)
    if bits == 4:
        assert not np.allclose(*_last_logits(e, full.tokens))


def _last_logits(e, reply):
    out = []
    for bits in (e.kv_bits, None):
        caches = Engine.make_cache(type("E", (), {"model": e.model, "kv_bits": bits, "kv_group_size": 32,
                                                  "quantized_kv_start": e.quantized_kv_start})())
        logits = e.model(mx.array([PROMPT + reply], dtype=mx.int32), caches)
        logits = e.model(mx.array([[reply[-1]]], dtype=mx.int32), caches)
        out.append(np.array(logits[0, -1]))
    return out


def test_the_prefix_cache_and_saved_sessions_keep_the_quantized_form(tmp_path):
    e = engine(4, start=13, cache_bytes=1 << 30)
    ref = e.generate(PROMPT, max_tokens=20, mode="plain").tokens
    again = e.generate(PROMPT, max_tokens=20, mode="auto")
    assert again.tokens == ref and again.stats.cached_tokens == 12  # blocks up to the full-precision split
    e2 = engine(4, start=0, cache_bytes=1 << 30)
    r = e2.generate(PROMPT, max_tokens=20, mode="plain")
    again = e2.generate(PROMPT, max_tokens=20, mode="tree")
    assert again.tokens == r.tokens and again.stats.cached_tokens >= 40
    path = tmp_path / "q.session"
    sessions.save(e2, path, PROMPT + r.tokens)
    other = engine(8, start=0, cache_bytes=1 << 30)
    with pytest.raises(sessions.SessionFileError, match="KV cache settings"):
        sessions.load(other, path)
    e3 = engine(4, start=0, cache_bytes=1 << 30)
    sessions.load(e3, path)
    r3 = e3.generate(PROMPT, max_tokens=20, mode="plain")
    assert r3.tokens == r.tokens and r3.stats.cached_tokens >= 40


def test_quantized_cache_is_smaller_and_reads_back_close():
    k = mx.random.normal((1, 2, 300, 64))
    v = mx.random.normal((1, 2, 300, 64))
    full = KVCache()
    full.update_and_fetch(k, v)
    for bits, ratio, tol in ((8, 0.30, 0.02), (4, 0.17, 0.15)):
        q = QuantizedKVCache(bits, 64)
        kk, vv = q.update_and_fetch(k, v)
        mx.eval(kk, vv)
        assert q.nbytes < ratio * full.nbytes, (bits, q.nbytes / full.nbytes)
        assert float(mx.abs(kk - k).max()) < tol * 4 and float(mx.abs(kk - k).mean()) < tol
        q.trim(100)
        assert q.offset == 200 and q.state[0].shape[2] == 200


def test_bad_settings_are_refused_up_front():
    with pytest.raises(ValueError, match="kv_bits"):
        Engine(make_tiny_engine(3, **HEADS).loaded, kv_bits=3)
    with pytest.raises(ValueError, match="head size 16"):
        Engine(make_tiny_engine(3).loaded, kv_bits=8, kv_group_size=32)
    with pytest.raises(ValueError, match="quantized_kv_start"):
        Engine(make_tiny_engine(3, **HEADS).loaded, kv_bits=8, kv_group_size=32, quantized_kv_start=-1)


def test_blocks_past_the_full_precision_split_are_not_kept():
    """A block across quantized_kv_start cannot be exported: it and the blocks after it are
    not stored (they could never be restored), so they cost the cache nothing."""
    e = engine(4, start=13, cache_bytes=1 << 30)
    e.generate(PROMPT, max_tokens=20, mode="plain")
    pc = e.prefix_cache
    assert pc.match(PROMPT + [1]) == 12 and pc.blocks == 3
    per_block = pc.bytes // 3
    assert per_block > 0
