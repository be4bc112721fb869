"""RoPE on the CPU from a table (models/base.py): `mx.fast.rope` has no CPU kernel, so each call
built a reference graph of 29 nodes; the contiguous path and a single sequence's tree now read
cos and sin from a table read off `mx.fast.rope`'s own output, and must give its bits exactly,
for every setting a model can have, at every offset, beside a batch's rows (2-D positions),
which still call it."""

from __future__ import annotations

import threading

import edgespec.models.base as mb
import mlx.core as mx
import numpy as np
import pytest
from conftest import make_tiny_model


def _rope(dims, traditional=False, base=10000.0, scale=1.0, freqs=None) -> mb.RoPE:
    r = mb.RoPE.__new__(mb.RoPE)
    mb.nn.Module.__init__(r)
    r.dims, r.traditional, r.base, r.scale, r._freqs = dims, traditional, base, scale, freqs
    return r


def _freqs(dims):
    return mx.array((500000.0 ** (np.arange(0, dims, 2) / dims)) * 1.7, dtype=mx.float32)


SETTINGS = [
    dict(dims=64), dict(dims=64, traditional=True), dict(dims=32, base=100000.0, scale=0.25),
    dict(dims=32, traditional=True, scale=0.5), dict(dims=128, base=None, freqs=_freqs(128)),
    dict(dims=16, base=None, freqs=_freqs(16), traditional=True),
]


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: ",".join(f"{k}={'f' if k == 'freqs' else v}" for k, v in s.items()))
def test_the_table_gives_mx_fast_ropes_bits(setting):
    rng = np.random.default_rng(0)
    r = _rope(**setting)
    D = max(64, setting["dims"])  # partial rotary dims: the rest passes through
    for offset, T in ((0, 1), (5, 4), (150, 1), (1023, 3), (1024, 1), (5000, 17)):
        x = mx.array(rng.standard_normal((2, 3, T, D)).astype(np.float32))
        want = mx.fast.rope(x, r.dims, traditional=r.traditional, base=r.base, scale=r.scale, offset=offset,
                            freqs=r._freqs)
        got = mb.rope_from_table(r, x, offset)
        assert np.array_equal(np.array(got), np.array(want)), (offset, T)
        # per-token positions: a tree's (one sequence, from the table) and a batch's rows
        # (B, T) (mx.fast.rope with one offset per entry), here a tree-like shuffle of depths
        pos = mx.array(offset + rng.permutation(T), dtype=mx.int32)
        want_pos = mx.fast.rope(x.transpose(0, 2, 1, 3).reshape(2 * T, 3, 1, D), r.dims, traditional=r.traditional,
                                base=r.base, scale=r.scale, offset=mx.concatenate([pos, pos]), freqs=r._freqs)
        want_pos = want_pos.reshape(2, T, 3, D).transpose(0, 2, 1, 3)
        assert np.array_equal(np.array(r(x[:1], offset, pos)), np.array(want_pos[:1])), (offset, T)
        assert np.array_equal(np.array(r(x, offset, mx.stack([pos, pos]))), np.array(want_pos)), (offset, T)
    assert mb.rope_table(r, 1)[0].shape[0] >= 5017  # grown past the first 1024 positions


def test_one_table_per_setting_shared_and_built_once():
    a, b = _rope(48, base=12345.0), _rope(48, base=12345.0)
    ta = mb.rope_table(a, 10)
    assert mb.rope_table(b, 10) is ta  # another layer with the same settings
    assert mb.rope_table(_rope(48, base=54321.0), 10) is not ta
    assert mb.rope_table(a, 3000) is not ta and mb.rope_table(b, 3000) is mb.rope_table(a, 3000)


def test_a_table_built_on_one_thread_serves_another():
    r = _rope(64, base=777.0)
    x = mx.array(np.random.default_rng(1).standard_normal((1, 2, 3, 64)).astype(np.float32))
    want = np.array(mx.fast.rope(x, 64, traditional=False, base=777.0, scale=1.0, offset=40))
    out = {}

    def work(name):
        with mx.stream(mx.new_stream(mx.cpu)):
            out[name] = np.array(mb.rope_from_table(r, x, 40))

    for name in ("first", "second"):
        t = threading.Thread(target=work, args=(name,))
        t.start()
        t.join()
    assert np.array_equal(out["first"], want) and np.array_equal(out["second"], want)


def test_a_model_pass_takes_the_table_on_the_cpu(monkeypatch):
    """A whole model's logits are the same with the table as with mx.fast.rope everywhere."""
    model = make_tiny_model(3)
    ids = mx.array([[5, 9, 2, 7, 1, 3]], dtype=mx.int32)
    calls = []
    real = mb.rope_from_table
    monkeypatch.setattr(mb, "rope_from_table", lambda *a: (calls.append(1), real(*a))[1])
    got = np.array(model(ids, model.make_cache()))
    assert calls  # the table path ran
    monkeypatch.setattr(mb, "rope_from_table", lambda rope, x, offset: mx.fast.rope(
        x, rope.dims, traditional=rope.traditional, base=rope.base, scale=rope.scale, offset=offset,
        freqs=rope._freqs))
    assert np.array_equal(np.array(model(ids, model.make_cache())), got)


def test_positions_past_the_table_are_refused_while_checking(monkeypatch):
    """A single sequence's per-token positions over a cache are read from the table, sized from
    offset + T (a tree's positions are below it); with EDGESPEC_CHECK_EXACT on (the suite) a
    caller passing positions past its rows is told at once instead of reading what is not there.
    Without a cache (offset 0) positions can be anything: mx.fast.rope computes them."""
    monkeypatch.setenv("EDGESPEC_CHECK_EXACT", "1")
    r = _rope(64, base=4321.0)
    x = mx.ones((1, 2, 3, 64))
    mx.eval(r(x, 10, mx.array([10, 11, 12], dtype=mx.int32)))
    with pytest.raises(ValueError, match="outside the table's 1024 rows"):
        r(x, 10, mx.array([10, 11, 5000], dtype=mx.int32))
    far = mx.array([7000, 7001, 7002], dtype=mx.int32)
    want = mx.fast.rope(x.transpose(0, 2, 1, 3).reshape(3, 2, 1, 64), 64, traditional=False, base=4321.0,
                        scale=1.0, offset=far).reshape(1, 3, 2, 64).transpose(0, 2, 1, 3)
    assert np.array_equal(np.array(r(x, 0, far)), np.array(want))
