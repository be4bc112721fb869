"""Prefix reuse (edgespec.caches.prefix): what it keeps is exact, it never changes the output,
and it stays within its bytes.

Tiny random models with small blocks (4 tokens), so prompts share and split blocks often.
"""

from __future__ import annotations

import threading

import mlx.core as mx
import numpy as np
import pytest
from conftest import make_tiny_engine, make_tiny_model

from edgespec.batch.batcher import Batcher
from edgespec.caches.prefix import PrefixCache
from edgespec.drafters.mlx_drafter import MLXDrafter
from edgespec.errors import ContextLengthError
from edgespec.modes import available_modes

BLOCK = 4
MODES = [*available_modes(), "auto"]


def engine_with(cache_bytes: int = 1 << 30, block: int = BLOCK, seed: int = 3, drafter: bool = True):
    e = make_tiny_engine(seed, scale=1.3, max_position_embeddings=512)
    if drafter:
        e.drafter = MLXDrafter(make_tiny_model(seed + 1, num_hidden_layers=1))
    e.__dict__["_prefix_cache"] = PrefixCache(cache_bytes, block=block)
    return e


def fresh_kv(model, tokens: list[int]) -> list[tuple[np.ndarray, np.ndarray]]:
    cache = model.make_cache()
    model(mx.array([tokens], dtype=mx.int32), cache)
    return [(np.array(c.state[0]), np.array(c.state[1])) for c in cache]


def prompt(n: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(1, 64, n)]


@pytest.mark.parametrize("mode", MODES)
def test_what_every_mode_leaves_cached_equals_a_fresh_prefill(mode):
    """The prompt and the reply's committed positions are stored; each stored block holds the
    keys and values a fresh prefill of the same tokens computes (not a rejected draft's)."""
    e = engine_with()
    p = prompt(23, 1) * 2  # repeats: copy sources draft, some drafts are rejected
    r = e.generate(p, max_tokens=30, mode=mode)
    tokens = p + r.tokens
    n, nodes, kinds = e.prefix_cache.export_prefix(tokens)
    assert kinds == ["positions"] * len(e.model.layers)
    assert n == (len(tokens) - 1) // BLOCK * BLOCK  # the whole reply but its last token
    want = fresh_kv(e.model, tokens[:n])
    for layer, (k, v) in enumerate(want):
        got_k = np.concatenate([np.array(node[layer][0]) for node in nodes], axis=2)
        got_v = np.concatenate([np.array(node[layer][1]) for node in nodes], axis=2)
        np.testing.assert_allclose(got_k, k, atol=1e-5, rtol=1e-4)
        np.testing.assert_allclose(got_v, v, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("mode", MODES)
def test_multi_turn_output_is_the_same_with_reuse_on_and_off(mode):
    """A growing conversation (each turn = the last prompt + its reply + new tokens) and
    requests sharing a prefix that ends mid-block: identical tokens, greedy and seeded."""
    on, off = engine_with(), engine_with(cache_bytes=0)
    # Seeded sampled output is reproducible run to run where the drafts cannot change which
    # draws are made (plain, auto; speculative at a fixed draft length); where drafts follow
    # measured timings (the copy and tree modes, speculative's adaptive length) only the law is
    # fixed (their own statistical tests), and they are compared greedy.
    samplings = [{}] + ([{"temperature": 0.8, "seed": 7}] if mode in ("plain", "adaptive", "auto") else [])
    if mode == "speculative":  # with a fixed draft length, its draws are the same run to run
        samplings.append({"temperature": 0.8, "seed": 7, "draft_tokens": 3})
    for sampling in samplings:
        on.prefix_cache.clear()
        convo = prompt(10, 2)
        for turn in range(4):
            a = on.generate(convo, max_tokens=12, mode=mode, **sampling)
            b = off.generate(convo, max_tokens=12, mode=mode, **sampling)
            assert a.tokens == b.tokens, (turn, sampling)
            if turn:
                assert a.stats.cached_tokens >= (len(convo) - 8) // BLOCK * BLOCK - BLOCK
            assert b.stats.cached_tokens == 0
            convo = convo + a.tokens + prompt(5, 10 + turn)
        shared = prompt(10, 3)  # 10 tokens: the third block is split
        for tail in (prompt(7, 4), prompt(9, 5)):
            a = on.generate(shared + tail, max_tokens=8, mode=mode, **sampling)
            b = off.generate(shared + tail, max_tokens=8, mode=mode, **sampling)
            assert a.tokens == b.tokens
        assert a.stats.cached_tokens == 8  # the two whole shared blocks


def test_threads_sharing_a_prefix_in_one_batch_get_their_own_output():
    e, off = engine_with(), engine_with(cache_bytes=0)
    system = prompt(21, 6)
    asks = [system + prompt(4 + i, 20 + i) for i in range(4)]
    want = [off.generate(a, max_tokens=10, mode="auto").tokens for a in asks]
    e.generate(system + [1], max_tokens=1)  # the shared part cached first
    got: list = [None] * 4

    def run(i):
        got[i] = e.generate(asks[i], max_tokens=10, mode="auto")

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [g.tokens for g in got] == want
    assert all(g.stats.cached_tokens == 20 for g in got)


def test_bytes_stay_within_the_bound_and_the_least_recently_used_go_first():
    e = engine_with(drafter=False)
    per_block = None
    firsts = []
    for i in range(3):
        p = prompt(9, 40 + i)
        e.generate(p, max_tokens=1, mode="plain")  # 2 blocks stored
        firsts.append(tuple(p[:BLOCK]))
        per_block = per_block or e.prefix_cache.bytes // 2
    pc = e.prefix_cache
    assert pc.blocks == 6
    e.generate(prompt(9, 40) + [5], max_tokens=1, mode="plain")  # the first prompt used again
    bound = 5 * per_block
    small = PrefixCache(bound, block=BLOCK)
    e.__dict__["_prefix_cache"] = small
    for i in (0, 1, 2):
        e.generate(prompt(9, 40 + i), max_tokens=1, mode="plain")
        assert small.bytes <= bound
    e.generate(prompt(9, 40) + [5], max_tokens=1, mode="plain")  # touch the first again
    e.generate(prompt(9, 43), max_tokens=1, mode="plain")  # needs room: the second goes first
    assert small.bytes <= bound
    assert small.evicted_blocks >= 2
    assert small.match(prompt(9, 41) + [1]) == 0  # the least recently used prompt is gone
    assert small.match(prompt(9, 40) + [1]) == 8  # the one used since stays
    assert small.match(prompt(9, 43) + [1]) == 8


def test_pinned_paths_survive_eviction_and_reset():
    e = engine_with(drafter=False)
    pc = PrefixCache(1 << 30, block=BLOCK)
    e.__dict__["_prefix_cache"] = pc
    keep = prompt(12, 50)
    e.generate(keep, max_tokens=1, mode="plain")
    n, nodes, kinds = pc.export_prefix(keep)
    pc.clear()
    pc.import_prefix(keep, nodes, kinds, pin=True)
    e.generate(prompt(12, 51), max_tokens=1, mode="plain")
    pc.max_bytes = pc.bytes - 1
    pc._evict()  # noqa: SLF001 - force the bound now
    assert pc.match(keep + [1]) == 12 and pc.match(prompt(12, 51) + [1]) < 12
    pc.max_bytes = 1 << 30
    e.generate(prompt(12, 52), max_tokens=1, mode="plain")
    pc.clear(keep_pinned=True)
    assert pc.match(keep + [1]) == 12 and pc.match(prompt(12, 52) + [1]) == 0


def test_off_keeps_nothing_and_bad_bounds_are_refused():
    e = engine_with(cache_bytes=0, drafter=False)
    r = e.generate(prompt(20, 60), max_tokens=3)
    assert r.stats.cached_tokens == 0 and e.prefix_cache.blocks == 0
    from edgespec.engine import Engine

    for bad in (-1, 1.5, "1G", True):
        with pytest.raises(ValueError, match="prompt_cache_bytes"):
            Engine(e.loaded, prompt_cache_bytes=bad)._prompt_cache_limit()


def test_truncate_oldest_drops_whole_turns_and_keeps_the_system_prompt():
    e = make_tiny_engine(3, max_position_embeddings=128)
    msgs = [{"role": "system", "content": "be brief"}]
    for i in range(6):
        msgs += [{"role": "user", "content": f"question {i} " + "ab " * 5},
                 {"role": "assistant", "content": "answer " + "cd " * 5}]
    msgs.append({"role": "user", "content": "last one"})
    with pytest.raises(ContextLengthError, match="context window"):
        e.generate(messages=msgs, max_tokens=4)
    ids, dropped = e.fit_messages(msgs, 4)
    assert dropped >= 1 and len(ids) + 4 <= e.context_length
    kept = [msgs[0]] + msgs[1 + 2 * dropped:]
    assert ids == e.encode_prompt(messages=kept)
    r = e.generate(messages=msgs, max_tokens=4, context_overflow="truncate_oldest")
    assert r.prompt_tokens == len(ids)
    with pytest.raises(ValueError, match="context_overflow"):
        e.generate(messages=msgs, max_tokens=4, context_overflow="drop")
    huge = [{"role": "user", "content": "ab " * 200}]
    with pytest.raises(ContextLengthError, match="last message alone"):
        e.generate(messages=huge, context_overflow="truncate_oldest")


def test_the_prefix_cache_gives_way_to_running_requests():
    """With a memory budget, the batch evicts cached prefixes before admitting a request, so
    the caches of running requests and the prefix cache together stay within the budget."""
    from edgespec.batch import memory

    e = engine_with(drafter=False)
    for i in range(6):
        e.generate(prompt(40, 70 + i), max_tokens=1, mode="plain")
    held = e.prefix_cache.bytes
    assert held > 0
    weights = memory.tree_bytes(e.model)
    need = memory.reserve_bytes(e, 30, 20)
    e.memory_budget = weights + need + held // 3  # room for the request and a third of the cache
    e.__dict__.pop("_batcher", None)
    seen = []
    real = Batcher._make_room

    def watch(self, req):
        real(self, req)
        seen.append((self.engine.prefix_cache.bytes + self.held_bytes(req), self.budget))

    Batcher._make_room = watch
    try:
        r = e.generate(prompt(30, 90), max_tokens=20, mode="plain")
    finally:
        Batcher._make_room = real
    assert r.stats.generated_tokens == 20
    assert seen and all(total <= budget for total, budget in seen)
    assert e.prefix_cache.evicted_blocks > 0


@pytest.mark.parametrize("mode", ["plain", "auto", "tree"])
def test_constrained_turns_reusing_a_reply_equal_reuse_off(mode):
    """A grammar's state follows the request's tokens, not the cache: a turn that restores an
    earlier prompt and reply (mid-grammar positions included) is constrained exactly as without."""
    from test_structured import ascii_engine

    rf = {"type": "json_schema", "json_schema": {"name": "p", "schema": {
        "type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "n": {"type": "integer"}},
        "required": ["name", "n"], "additionalProperties": False}}}
    on, off = ascii_engine("self"), ascii_engine("self")
    on.__dict__["_prefix_cache"] = PrefixCache(1 << 30, block=BLOCK)
    off.prompt_cache_bytes = 0
    convo = on.tokenizer.encode('Data: {"name": "ab", "n": 3} -> ')
    for turn in range(3):
        a = on.generate(convo, max_tokens=30, mode=mode, response_format=rf)
        b = off.generate(convo, max_tokens=30, mode=mode, response_format=rf)
        assert a.tokens == b.tokens, turn
        if turn:
            assert a.stats.cached_tokens > len(convo) - 2 * BLOCK - 8
        convo = convo + a.tokens + on.tokenizer.encode(" next: ")
