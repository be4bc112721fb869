"""The drafter's own cache reused between requests (edgespec.drafters.base.DrafterReuse, the
engine's `drafter_prefix_cache` joined to its prefix cache): exact, bounded with the
verifier's store, and each request of a batch drafting with a state of its own.

Tiny random models with small blocks (4 tokens), as tests/test_prefix_cache.py.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from conftest import make_tiny_engine, make_tiny_model, run_at_once

from edgespec.caches.prefix import PrefixCache
from edgespec.drafters.base import DrafterReuse, ModelDrafter
from edgespec.drafters.mlx_drafter import MLXDrafter
from edgespec.drafters.self_spec import SelfSpecDrafter

BLOCK = 4


def engine_with(cache_bytes: int = 1 << 30, drafter_reuse: bool = True, self_spec: bool = False):
    e = make_tiny_engine(3, scale=1.3, max_position_embeddings=512)
    e.drafter = SelfSpecDrafter(e.model, [0]) if self_spec else MLXDrafter(make_tiny_model(4, num_hidden_layers=2))
    e.__dict__["_prefix_cache"] = PrefixCache(cache_bytes, block=BLOCK)
    e.drafter_prefix_reuse = drafter_reuse
    return e


def prompt(n: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(1, 64, n)]


class Ran:
    """Counts the positions ModelDrafter.begin runs through the drafter's model, per call."""

    def __init__(self, monkeypatch):
        self.begins: list[int] = []
        self._in = None
        real_begin, real_forward = ModelDrafter.begin, MLXDrafter._forward
        ran = self

        def begin(d, p):
            ran._in = 0
            try:
                real_begin(d, p)
            finally:
                ran.begins.append(ran._in)
                ran._in = None

        def forward(d, x, last_only=False):
            if ran._in is not None:
                ran._in += x.shape[1]
            return real_forward(d, x, last_only)

        monkeypatch.setattr(ModelDrafter, "begin", begin)
        monkeypatch.setattr(MLXDrafter, "_forward", forward)


@pytest.mark.parametrize("mode", ["speculative", "auto"])
def test_multi_turn_output_equals_drafter_reuse_off(mode):
    """A growing conversation, greedy and seeded (speculative at a fixed draft length): the
    same tokens with the drafter's cache reused as without (and as with no reuse at all)."""
    on, off, none = engine_with(), engine_with(drafter_reuse=False), engine_with(cache_bytes=0)
    samplings = [{}, {"temperature": 0.8, "seed": 7, **({"draft_tokens": 3} if mode == "speculative" else {})}]
    for sampling in samplings:
        on.prefix_cache.clear()
        convo = last = prompt(10, 2)
        for turn in range(4):
            a = on.generate(convo, max_tokens=12, mode=mode, **sampling)
            b = off.generate(convo, max_tokens=12, mode=mode, **sampling)
            c = none.generate(convo, max_tokens=12, mode=mode, **sampling)
            assert a.tokens == b.tokens == c.tokens, (turn, sampling)
            assert b.stats.drafter_cached_tokens == c.stats.drafter_cached_tokens == 0
            if turn and mode == "speculative":  # it begins at every request: at least the last prompt's blocks
                assert a.stats.drafter_cached_tokens >= (len(last) - 1) // BLOCK * BLOCK
            last, convo = convo, convo + a.tokens + prompt(5, 10 + turn)
    assert off.drafter_prefix_cache is None and off.prefix_cache.blocks > 0


def test_self_speculative_drafter_reuse_is_exact():
    """A layer subset of the verifier (the self-speculative drafter): only its layers' caches
    are stored and restored; the output is unchanged."""
    on, off = engine_with(self_spec=True), engine_with(self_spec=True, drafter_reuse=False)
    convo = prompt(11, 5)
    for turn in range(3):
        a = on.generate(convo, max_tokens=10, mode="speculative")
        b = off.generate(convo, max_tokens=10, mode="speculative")
        assert a.tokens == b.tokens, turn
        if turn:
            assert a.stats.drafter_cached_tokens > 0
        convo = convo + a.tokens + prompt(4, 30 + turn)
    assert on.drafter_prefix_cache.stats().blocks > 0


def tiny_lfm2(seed: int = 5):
    """A drafter model with a convolution (state) layer and an attention layer."""
    from edgespec.models.lfm2 import Model, ModelArgs

    mx.random.seed(seed)
    args = ModelArgs.from_dict(dict(
        model_type="lfm2", hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=64, norm_eps=1e-5, max_position_embeddings=512,
        layer_types=["conv", "full_attention"], block_auto_adjust_ff_dim=False))
    model = Model(args)
    mx.eval(model.parameters())
    return model


def test_a_drafter_with_state_layers_reuses_exactly():
    """A drafter with a convolution layer: its begin pauses at the last block boundary so the
    state there is stored; later turns restore it and the output is unchanged."""
    on, off = engine_with(), engine_with(drafter_reuse=False)
    for e in (on, off):
        e.drafter = MLXDrafter(tiny_lfm2())
    for sampling in ({}, {"temperature": 0.8, "seed": 3, "draft_tokens": 3}):
        on.prefix_cache.clear()
        convo = last = prompt(14, 8)
        for turn in range(3):
            a = on.generate(convo, max_tokens=10, mode="speculative", **sampling)
            b = off.generate(convo, max_tokens=10, mode="speculative", **sampling)
            assert a.tokens == b.tokens, (turn, sampling)
            if turn:
                assert a.stats.drafter_cached_tokens >= (len(last) - 1) // BLOCK * BLOCK
            last, convo = convo, convo + a.tokens + prompt(5, 60 + turn)
    assert on.drafter_prefix_cache._kinds == ["state", "positions"]  # noqa: SLF001


def fresh_drafter_kv(drafter, tokens):
    cache = drafter.model.make_cache()
    drafter.model(mx.array([tokens], dtype=mx.int32), cache)
    return [(np.array(c.state[0]), np.array(c.state[1])) for c in cache]


def test_stored_and_restored_drafter_blocks_equal_a_fresh_prefill():
    e = engine_with()
    p = prompt(23, 1) * 2
    r = e.generate(p, max_tokens=30, mode="speculative", draft_tokens=3)
    tokens = p + r.tokens
    store = e.drafter_prefix_cache
    n, nodes, kinds = store.export_prefix(tokens)
    assert kinds == ["positions"] * len(e.drafter.model.layers)
    # the prompt and the reply's committed positions the drafter's cache held
    assert n >= (len(p) + 8) // BLOCK * BLOCK
    want = fresh_drafter_kv(e.drafter, tokens[:n])
    for layer, (k, v) in enumerate(want):
        got_k = np.concatenate([np.array(node[layer][0]) for node in nodes], axis=2)
        got_v = np.concatenate([np.array(node[layer][1]) for node in nodes], axis=2)
        np.testing.assert_allclose(got_k, k, atol=1e-5, rtol=1e-4)
        np.testing.assert_allclose(got_v, v, atol=1e-5, rtol=1e-4)
    # a next turn's drafter restores those blocks and prefills the rest: its whole cache
    # equals a fresh prefill of the prompt but its last token
    nxt = tokens + prompt(6, 9)
    d = e.drafter.fork()
    d.prefix_reuse = DrafterReuse(store, d)
    d.begin(nxt)
    assert d.prefix_reuse.restored == n and d.prefilled == len(nxt) - 1 - n
    for c, (k, v) in zip(d.cache, fresh_drafter_kv(e.drafter, nxt[:-1]), strict=True):
        np.testing.assert_allclose(np.array(c.state[0]), k, atol=1e-5, rtol=1e-4)
        np.testing.assert_allclose(np.array(c.state[1]), v, atol=1e-5, rtol=1e-4)


def test_the_drafter_prefills_only_the_new_part(monkeypatch):
    """Counting the positions the drafter's model runs in begin: the whole prompt on the first
    turn, then only what follows the last whole block it kept (the new message and the tail)."""
    ran = Ran(monkeypatch)
    e = engine_with()
    convo = prompt(30, 3)
    prev = len(convo)
    for turn in range(4):
        r = e.generate(convo, max_tokens=12, mode="speculative", draft_tokens=3)
        ran_now = ran.begins[-1]
        assert ran_now == len(convo) - 1 - r.stats.drafter_cached_tokens
        if turn == 0:
            assert ran_now == len(convo) - 1
        else:
            new = len(convo) - prev  # the reply's tokens handed out and the new message
            assert ran_now < new + 2 * BLOCK + 4, (turn, ran_now, new)
            assert ran_now < len(convo) // 2
        prev = len(convo)
        convo = convo + r.tokens + prompt(7, 50 + turn)


@pytest.mark.parametrize("mode", ["speculative", "auto"])
def test_threads_sharing_a_prefix_in_one_batch_get_their_own_output(mode):
    """Four requests drafting at once in one batch (each mode drafts with its own fork of the
    engine's drafter) restore a shared prefix and still produce their own output."""
    e, off = engine_with(), engine_with(cache_bytes=0)
    system = prompt(21, 6)
    asks = [system + prompt(4 + i, 20 + i) for i in range(4)]
    want = [off.generate(a, max_tokens=16, mode=mode, draft_tokens=3).tokens for a in asks]
    e.generate(system + [1], max_tokens=1, mode="speculative")  # the shared part cached first, both stores
    got = run_at_once(lambda i: e.generate(asks[i], max_tokens=16, mode=mode, draft_tokens=3))
    assert [g.tokens for g in got] == want
    assert max(e.batcher.batch_sizes) > 1  # they did run together
    assert all(g.stats.cached_tokens == 20 for g in got)
    if mode == "speculative":
        assert all(g.stats.drafter_cached_tokens == 20 for g in got)


def test_both_stores_stay_within_one_bound():
    """The drafter's store joins the verifier's: the bound is on their bytes together, least
    recently used blocks of either go first, and the batch's room-making shrinks both."""
    e = engine_with()
    e.generate(prompt(13, 40), max_tokens=2, mode="speculative")
    pc, dpc = e.prefix_cache, e.drafter_prefix_cache
    assert pc.bytes > 0 and dpc.bytes > 0 and dpc.max_bytes == pc.max_bytes
    one_turn = pc.group_bytes
    bound = int(one_turn * 2.5)
    small = PrefixCache(bound, block=BLOCK)
    e.__dict__["_prefix_cache"] = small
    assert e.drafter_prefix_cache is not dpc  # a new store, joined to the new cache
    for i in range(5):
        e.generate(prompt(13, 40 + i), max_tokens=2, mode="speculative")
        assert small.group_bytes <= bound
    d = e.drafter_prefix_cache
    assert small.evicted_blocks > 0 and d.evicted_blocks > 0
    assert small.match(prompt(13, 40) + [1]) == 0  # the oldest turns went, from both stores
    assert d.match(prompt(13, 40) + [1]) == 0
    assert small.match(prompt(13, 44) + [1]) == 12 and d.match(prompt(13, 44) + [1]) == 12
    small.shrink_to(0)  # what the batch does when a running request needs the room
    assert small.group_bytes == 0 and d.bytes == 0
    small.max_bytes = 0
    r = e.generate(prompt(13, 44), max_tokens=2, mode="speculative")
    assert r.stats.drafter_cached_tokens == 0 and e.drafter_prefix_cache is None


def test_joined_stores_evict_in_one_least_recently_used_order():
    a = PrefixCache(1 << 20, block=2)
    b = PrefixCache(joins=a)
    assert b.block == 2 and b.max_bytes == a.max_bytes
    model = make_tiny_model(1, num_hidden_layers=1)

    def fill(store, toks):
        cache = model.make_cache()
        model(mx.array([toks], dtype=mx.int32), cache)
        store.store(toks, cache, len(toks))

    fill(a, [1, 2, 3, 4])
    fill(b, [5, 6, 7, 8])
    fill(a, [9, 10, 11, 12])
    a.restore([1, 2, 3, 4, 0], model.make_cache())  # a's first path used again
    per_block = b.bytes // 2
    a.shrink_to(a.group_bytes - 2 * per_block)  # two blocks go: b's (the least recently used)
    assert b.bytes == 0 and a.blocks == 4
    a.clear()
    assert a.group_bytes == 0
    b.leave()
    assert a._group == [a]  # noqa: SLF001


def test_drafter_reuse_switch_is_checked(monkeypatch):
    e = engine_with(drafter_reuse=None)
    monkeypatch.setenv("EDGESPEC_DRAFTER_REUSE", "off")
    assert e.drafter_prefix_cache is None
    monkeypatch.setenv("EDGESPEC_DRAFTER_REUSE", "on")
    assert e.drafter_prefix_cache is not None
    monkeypatch.setenv("EDGESPEC_DRAFTER_REUSE", "maybe")
    with pytest.raises(ValueError, match="EDGESPEC_DRAFTER_REUSE"):
        e.drafter_prefix_cache  # noqa: B018
    e.drafter_prefix_reuse = "yes"
    with pytest.raises(ValueError, match="drafter_prefix_reuse"):
        e.drafter_prefix_cache  # noqa: B018


def test_an_assistant_drafter_forks_per_request():
    """Gemma 4's assistant owns no cache (nothing to reuse) but binds the request's verifier
    cache and follows its committed sequence: each request gets a fork of its own."""
    from edgespec.drafters.assistant import AssistantDrafter
    from edgespec.drafters.base import request_drafter

    d = AssistantDrafter.__new__(AssistantDrafter)  # the state only: no weights needed here
    d.cache, d.seq, d._last_draft, d.assistant = None, [], [], object()
    a, b = request_drafter(d), request_drafter(d)
    a.begin([1, 2, 3])
    a.bind_verifier_cache(["a's cache"])
    b.begin([4, 5])
    b.sync([4, 5, 6])
    assert (a.seq, a.cache, b.seq, b.cache) == ([1, 2, 3], ["a's cache"], [4, 5, 6], None)
    assert a.assistant is b.assistant is d.assistant and d.seq == [] and d.cache is None
    assert engine_with().drafter_prefix_cache is not None
    e = engine_with()
    e.drafter = d
    assert e.drafter_prefix_cache is None  # no store for a drafter without a cache of its own


@pytest.mark.parametrize("mode,opts", [("cascade", {"draft_tokens": 3}), ("tree", {}),
                                       ("speculative", {"draft_tokens": 3})])
def test_concurrent_requests_draft_with_states_of_their_own(mode, opts):
    """Four requests drafting at once in one batch, each mode's drafter (the cascade's two
    levels too) forked per request: each gets its solo output (a shared drafter state failed
    3 of 4 with a draft/accept mismatch)."""
    e = engine_with(cache_bytes=0)
    asks = [prompt(12 + i, 20 + i) for i in range(4)]
    want = [e.generate(a, max_tokens=16, mode=mode, **opts).tokens for a in asks]
    got = run_at_once(lambda i: e.generate(asks[i], max_tokens=16, mode=mode, **opts).tokens)
    assert got == want
    assert max(e.batcher.batch_sizes) > 1
