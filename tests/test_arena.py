"""The batch's shared KV arena (edgespec.batch.arena) and the joint choice of speculation
(edgespec.batch.cost.joint_sizes).

Rows of one arena must behave exactly like caches of their own: alone, in one batched
pass at different offsets and widths, after trims and tree commits, and when the arena
grows under them; a batched pass over arena rows must not gather (that is its point).
"""

from __future__ import annotations

import threading

import mlx.core as mx
import numpy as np
import pytest
from conftest import make_tiny_engine, make_tiny_model

import edgespec.batch.batcher as batcher_mod
import edgespec.batch.forward as forward_mod
import edgespec.batch.policy as policy_mod
from edgespec.batch import Row, batched_forward
from edgespec.batch.arena import KVArena, SlotCache
from edgespec.batch.cost import PassCost, Peer, StepCost, joint_sizes
from edgespec.engine import make_options
from edgespec.kernels import commit_kv, tree_mask


def _arena_caches(model, arena):
    row = arena.acquire()
    return [SlotCache(arena, i, row) for i in range(len(model.layers))]


def _prefill(model, cache, prompt):
    mx.eval(model(mx.array(prompt, dtype=mx.int32)[None], cache))


def _state(cache) -> list[np.ndarray]:
    return [np.array(c.state[0]) for c in cache] + [np.array(c.state[1]) for c in cache]


def test_arena_rows_in_passes_equal_caches_of_their_own(monkeypatch):
    """Three sequences, prefilled alone, then batched passes: one token each; a tree (own
    mask) beside single tokens and a 3-token chunk (padding); a tree commit and a trim; one
    more pass. Logits and cache contents equal the same calls on caches of their own, and
    the arena passes never gather."""
    model = make_tiny_model(2, scale=1.3)
    prompts = [[1, 2, 3], list(range(5, 30)), [9] * 7]
    arena = KVArena()
    arena.step = 16  # so the passes below grow it
    own = [model.make_cache() for _ in prompts]
    rows_ = [_arena_caches(model, arena) for _ in prompts]
    for p, a, b in zip(prompts, own, rows_, strict=True):
        _prefill(model, a, p)
        _prefill(model, b, p)  # alone: in buffers of their own, the arena untouched
    assert arena.positions == 0 and not any(c.attached for r in rows_ for c in r)

    def gather_forbidden(*a, **k):
        raise AssertionError("an arena pass gathered the rows")

    monkeypatch.setattr(forward_mod, "_GatherCache", gather_forbidden)
    parents = [-1, 0, 0, 1]

    def calls(caches):
        mask, pos = tree_mask(mx.array(parents, dtype=mx.int32), caches[1][0].offset)
        return [
            [Row(mx.array([[11]]), caches[0]), Row(mx.array([[12]]), caches[1]), Row(mx.array([[13]]), caches[2])],
            [Row(mx.array([[14, 15, 16]]), caches[0]), Row(mx.array([[4, 5, 6, 7]]), caches[1], mask, pos),
             Row(mx.array([[17]]), caches[2])],
        ]

    for step in range(2):
        want = [model(r.inputs, r.cache, mask=r.mask, positions=r.positions) for r in calls(own)[step]]
        got = batched_forward(model, calls(rows_)[step])
        assert all(c.attached for r in rows_ for c in r)  # a shared pass moved them into their rows
        for w, g in zip(want, got, strict=True):
            np.testing.assert_allclose(np.array(g), np.array(w), atol=1e-4)
    for caches in (own, rows_):
        commit_kv(caches[1], caches[1][0].offset - 4, [0, 2])  # keep the root and node 2
        for c in caches[0]:
            c.trim(2)
    want = [model(mx.array([[t]]), c) for t, c in zip([21, 22, 23], own, strict=True)]
    got = batched_forward(model, [Row(mx.array([[t]]), c) for t, c in zip([21, 22, 23], rows_, strict=True)])
    for w, g in zip(want, got, strict=True):
        np.testing.assert_allclose(np.array(g), np.array(w), atol=1e-4)
    for a, b in zip(own, rows_, strict=True):
        assert a[0].offset == b[0].offset
        for x, y in zip(_state(a), _state(b), strict=True):
            np.testing.assert_allclose(y, x, atol=1e-5)
    assert arena.positions >= max(c[0].offset for c in rows_) and arena.allocations >= 1


def test_the_arena_grows_rows_and_positions_keeping_what_it_holds():
    arena = KVArena()
    arena.step = 8
    first = SlotCache(arena, 0, arena.acquire())
    k = mx.random.normal((1, 2, 5, 4))
    first.update_and_fetch(k, k + 1)  # detached: in its own buffer
    assert not first.attached and arena.positions == 0
    first.attach()  # moved into its row
    assert first.attached and first.offset == 5 and arena.positions == 8
    rows = [arena.acquire() for _ in range(3)]  # one row more each time: 1 -> 2 -> 3 -> 4
    assert arena.rows == 4
    rows.append(arena.acquire(8))  # asked for 8 rows: grows to 8 at once
    assert arena.rows == 8 and sorted(rows) == [1, 2, 3, 4]
    other = SlotCache(arena, 0, rows[-1])
    other.attach()
    k2 = mx.random.normal((1, 2, 20, 4))  # past 8 positions: grows to 24
    other.update_and_fetch(k2, k2 * 2)
    assert arena.positions == 24
    np.testing.assert_array_equal(np.array(first.state[0]), np.array(k))
    np.testing.assert_array_equal(np.array(first.state[1]), np.array(k + 1))
    np.testing.assert_array_equal(np.array(other.state[1]), np.array(k2 * 2))
    arena.release(rows[0])
    assert arena.used == 4 and arena.acquire() == rows[0]


def test_rows_read_in_any_order_and_with_gaps_without_a_gather(monkeypatch):
    """Rows with gaps (a sequence ended between them) and rows given out of arena order read
    what a gather would, and a batched pass over them equals each row on caches of its own,
    without mx.take (a gather of every row, every layer: the slow path on a CPU)."""
    model = make_tiny_model(4, scale=1.3)
    prompts = [[1, 2, 3], list(range(5, 18)), [9] * 7, [4, 8, 15, 16]]
    arena = KVArena()
    own = [model.make_cache() for _ in prompts]
    rows_ = [_arena_caches(model, arena) for _ in prompts]
    for p, a, b in zip(prompts, own, rows_, strict=True):
        _prefill(model, a, p)
        _prefill(model, b, p)
    mx.eval(batched_forward(model, [Row(mx.array([[5]]), c) for c in rows_]))  # all attached
    for c in own:
        mx.eval(model(mx.array([[5]]), c))
    K = arena.keys[0]
    for rows in ([0, 1, 3], [1, 3], [0, 2, 3]):
        k, v = arena.read_rows(0, rows, 9)
        np.testing.assert_array_equal(np.array(k), np.array(K[mx.array(rows)][:, :, :9]))

    def take_forbidden(*a, **k):
        raise AssertionError("rows were gathered with mx.take")

    monkeypatch.setattr(mx, "take", take_forbidden)
    pick = [3, 0, 2]  # out of order, with a gap
    want = [model(mx.array([[20 + i]]), own[i]) for i in pick]
    got = batched_forward(model, [Row(mx.array([[20 + i]]), rows_[i]) for i in pick])
    for w, g in zip(want, got, strict=True):
        np.testing.assert_allclose(np.array(g), np.array(w), atol=1e-4)


def test_moving_a_row_keeps_its_entries():
    arena = KVArena()
    rows = [arena.acquire(3) for _ in range(3)]
    caches = [SlotCache(arena, 0, r) for r in rows]
    ks = [mx.random.normal((1, 2, 4 + i, 4)) for i in range(3)]
    for c, k in zip(caches, ks, strict=True):
        c.attach()
        c.update_and_fetch(k, -k)
    arena.release(rows[0])
    arena.move(rows[2], rows[0])
    caches[2].row = rows[0]
    assert arena.free_rows() == [rows[2]] and arena.used == 2
    np.testing.assert_array_equal(np.array(caches[2].state[0]), np.array(ks[2]))
    np.testing.assert_array_equal(np.array(caches[2].state[1]), np.array(-ks[2]))
    np.testing.assert_array_equal(np.array(caches[1].state[0]), np.array(ks[1]))


def test_rows_stay_contiguous_when_a_sequence_in_the_middle_ends(monkeypatch):
    """Four requests, the second ends first: the batcher moves the highest row down into its
    place, so every later pass reads one slice of the arena; every reply equals it alone."""
    engine = make_tiny_engine(3, scale=1.3)
    prompts = [[(7 * i + 3 * j) % 60 + 1 for j in range(4 + 5 * i)] for i in range(4)]
    lengths = [30, 6, 24, 30]
    ref = [engine.generate(p, max_tokens=m, mode="plain").tokens for p, m in zip(prompts, lengths, strict=True)]
    reads = []
    real = KVArena.read_rows

    def read_rows(self, layer, rows, n):
        reads.append(list(rows))
        return real(self, layer, rows, n)

    monkeypatch.setattr(KVArena, "read_rows", read_rows)
    got = [[] for _ in prompts]
    finished = threading.Semaphore(0)

    def emitter(i):
        def emit(kind, payload):
            if kind == "chunk":
                got[i].extend(payload.tokens)
            elif kind in ("done", "error"):
                finished.release()
        return emit

    for i, (p, m) in enumerate(zip(prompts, lengths, strict=True)):  # admitted in this order: rows 0-3
        opts = make_options(max_tokens=m, mode="plain")
        engine.submit(p, opts, engine.resolve_mode(opts), emitter(i))
    for _ in prompts:
        assert finished.acquire(timeout=60)
    assert got == ref
    assert any(len(r) == 3 for r in reads)  # passes ran after the short one ended
    assert all(r == list(range(r[0], r[0] + len(r))) for r in reads)


LONG_SHORT = [[(5 * j) % 60 + 1 for j in range(10)], [(3 * j) % 60 + 2 for j in range(10)],
              [(7 * j) % 60 + 3 for j in range(10)]]


def test_the_arena_is_accounted_as_the_rows_it_holds(monkeypatch):
    """Every row of an arena is as long as its longest: a request of 10 + 300 tokens makes
    each row 512 positions, so three requests together hold 3 x 512 positions of K/V, not
    their own 512 + 256 + 256. After every step the arena's real size stays within what
    the batcher accounts (rows are not doubled past the requests)."""
    from edgespec.batch.memory import verifier_kv_per_token

    engine = make_tiny_engine(3, scale=1.3)
    seen = []
    real = batcher_mod.Batcher._step

    def step(self):
        real(self)
        a = self._arena
        if a is not None and a.keys:
            held = a.rows * a.positions * verifier_kv_per_token(engine)
            seen.append((held, self.held_bytes(), a.rows))

    monkeypatch.setattr(batcher_mod.Batcher, "_step", step)
    reqs = [dict(max_tokens=300), dict(max_tokens=12), dict(max_tokens=12)]
    threads_out = {}

    def run(i):
        threads_out[i] = engine.generate(LONG_SHORT[i], mode="plain", **reqs[i]).tokens

    ts = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert seen and max(r for _, _, r in seen) == 3
    assert all(held <= accounted for held, accounted, _ in seen), seen[:3]
    for i in range(3):
        assert threads_out[i] == engine.generate(LONG_SHORT[i], mode="plain", **reqs[i]).tokens


def test_a_request_waits_while_the_arena_rows_would_pass_the_budget():
    """Own reserves 512 + 256 positions fit a budget of 900; the arena they would share
    (2 rows of 512) does not: the short request waits for the long one."""
    from edgespec.batch.memory import kv_per_token
    from edgespec.lookahead.memory import tree_bytes

    engine = make_tiny_engine(3, scale=1.3)
    engine.memory_budget = tree_bytes(engine.model) + 900 * kv_per_token(engine)
    engine.max_batch = 4  # the default from this budget would be 1 and decide alone
    res = {}

    def run(i, m):
        res[i] = engine.generate(LONG_SHORT[i], mode="plain", max_tokens=m).tokens

    ts = [threading.Thread(target=run, args=(0, 300)), threading.Thread(target=run, args=(1, 12))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert max(engine.batcher.batch_sizes) == 1
    assert res[1] == engine.generate(LONG_SHORT[1], mode="plain", max_tokens=12).tokens


def test_a_long_request_keeps_its_own_caches_beside_arena_rows(monkeypatch):
    """Requests that may grow past ARENA_POSITIONS keep caches of their own; passes mixing
    them with arena rows gather; every reply equals the request run alone."""
    monkeypatch.setattr(policy_mod, "ARENA_POSITIONS", 100)
    engine = make_tiny_engine(3, scale=1.3)
    prompts = [[(5 * i + j) % 50 + 1 for j in range(4 + 9 * i)] for i in range(4)]
    want = [engine.generate(p, max_tokens=20, mode=m).tokens
            for p, m in zip(prompts, ["plain", "auto"] * 2, strict=True)]
    seen = []
    orig = batcher_mod.Batcher.arena_caches

    def spy(self, seq, caches):
        out = orig(self, seq, caches)
        seen.append((len(seq.req.ids), type(out[0]).__name__))
        return out

    monkeypatch.setattr(batcher_mod.Batcher, "arena_caches", spy)
    import threading

    got = [None] * 4

    def run(i):
        got[i] = engine.generate(prompts[i], max_tokens=20 + 20 * (i == 3), mode=["plain", "auto"][i % 2]).tokens

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got[:3] == want[:3] and got[3][:20] == want[3]
    kinds = dict(seen)
    assert kinds[4] == "SlotCache" and kinds[31] == "KVCache"  # 4 + 20 + 64 <= 100 < 31 + 40 + 64
    assert engine.batcher._arena is None  # the batch emptied: its arena went with it


# ------------------------------------------------------------------ choosing together
SIZES = [1, 2, 4, 8, 16, 32, 64, 128]
# one pass over n tokens, in units of one token's: flat up to 8 tokens, then about linear
CPU = StepCost(PassCost(SIZES, [1.0, 1.06, 1.17, 1.4, 2.0, 3.0, 5.0, 9.0]))


def _curve(p: float, n: int = 8) -> np.ndarray:
    """Expected tokens of a chain of n-1 drafted tokens each accepted with probability p."""
    return np.concatenate([[1.0], 1.0 + np.cumsum(p ** np.arange(1, n))])


def _choices(curves, step):
    """Each row's own size as that row computes the joint choice (peers' keys = their index)."""
    out = []
    for i, g in enumerate(curves):
        peers = [Peer(1, h, j) for j, h in enumerate(curves) if j != i]
        out.append(joint_sizes(g, peers, step, key=i)[0])
    return out


def test_rows_that_each_would_speculate_alone_stay_plain_together():
    """8 rows whose candidates pay alone (a tree of 3 for 1.1x the time brings 1.47 tokens)
    but not when they pad the pass of 8 rows (16 tokens cost 2.0x 8): the joint choice is
    all plain, and every row comes to it. Priced one at a time against the others' sizes,
    each tree looked free once one row had padded the pass."""
    curves = [_curve(0.35)] * 8
    assert joint_sizes(curves[0], [], CPU)[0] > 1
    assert _choices(curves, CPU) == [1] * 8


def test_a_predictable_row_speculates_in_a_pass_of_its_own():
    """One row with near-certain candidates beside three with none: it verifies 8 tokens in
    a pass of its own (cheaper than padding the others to 8), the others stay plain."""
    curves = [np.ones(1)] * 3 + [_curve(0.97)]
    assert _choices(curves, CPU) == [1, 1, 1, 8]
    mine, peers, peer_tokens = joint_sizes(curves[3], [Peer(1, h, j) for j, h in enumerate(curves[:3])], CPU, key=3)
    assert (mine, peers, peer_tokens) == (8, [1, 1, 1], 3.0)


@pytest.mark.parametrize("p, n", [(0.3, 4), (0.5, 8), (0.8, 3)])
def test_every_row_sees_the_same_choice(p, n):
    """Identical curves (ties everywhere): the sizes each row assigns its peers are the sizes
    those peers choose for themselves."""
    curves = [_curve(p, 3)] * n
    choice = _choices(curves, CPU)
    for i in range(n):
        _, peers, _ = joint_sizes(curves[i], [Peer(1, h, j) for j, h in enumerate(curves) if j != i], CPU, key=i)
        assert peers == [choice[j] for j in range(n) if j != i], (i, choice)


def test_measured_shapes_replace_the_one_sequence_curve():
    step = StepCost(PassCost(SIZES, [1.0 + n / 20.0 for n in SIZES]))
    before = step([1] * 8)
    assert before == pytest.approx(1.4)
    step.observe(8, 1, 2.0)  # 8 rows of 1 measured at 2.0
    assert step([1] * 8) == pytest.approx(2.0)
    # wider, unmeasured: the measured shape scaled along the curve
    assert step([2] * 8) == pytest.approx(2.0 * (1.0 + 16 / 20.0) / 1.4)
    step.observe(8, 4, 4.0)
    assert step([2] * 8) == pytest.approx(2.0 + 2.0 / 3)  # between measured widths (1 and 4): interpolated
    # no shape of 4 rows measured: the curve times the ratio measured with the nearest count
    assert step([1] * 4) == pytest.approx((1.0 + 4 / 20.0) * step.factor[8])


def test_step_costs_follow_new_measurements_within_a_few_steps():
    """A new shape is priced at once; further measurements of a known shape reach the
    memoised step costs within MEMO_REFRESH observations (not on every pass: recomputing
    every row's joint choice each step cost more than the precision was worth)."""
    from edgespec.batch.cost import MEMO_REFRESH

    step = StepCost(PassCost(SIZES, [1.0 + n / 20.0 for n in SIZES]))
    step.observe(4, 1, 2.0)
    assert step([1] * 4) == pytest.approx(2.0)  # a new shape: at once
    seen = []
    for _ in range(MEMO_REFRESH):
        step.observe(4, 1, 3.0)
        seen.append(step([1] * 4))
    assert seen[0] == pytest.approx(2.0)  # a known shape's next measurement waits for the refresh
    assert seen[-1] == pytest.approx(step.seen[(4, 1)]) and seen[-1] > 2.9


def test_auto_adds_no_jacobi_window_to_a_tree_inside_a_batch():
    """The window controller may want the Jacobi window; inside a batch (batch-aware) the
    step's shape is the joint choice's, so no window rides on the tree; alone, or priced as
    if alone (batch_aware=0), the controller decides."""
    from edgespec.adaptive.decoder import AdaptiveDecoder
    from edgespec.adaptive.policy import TimedPolicy

    class Full:
        def choose(self):
            return "full"

    dec = AdaptiveDecoder.__new__(AdaptiveDecoder)
    dec.wctl = Full()
    dec.policy = TimedPolicy()  # the timed choices (edgespec.adaptive.policy)
    for ctx, want in ((None, True), (lambda: None, True), (lambda: ([Peer(1)], CPU, 0), False)):
        dec._batch_ctx = ctx
        assert dec._window_now() is want


def test_a_tree_rounds_host_time_is_priced():
    """A row whose candidates pay on the passes alone (4 rows: a tree of 8 in a pass of its
    own) stays plain once its tree round's host work (drawing, accepting, committing, while
    the others wait) costs more than the tokens bring."""
    curves = [np.ones(1)] * 3 + [_curve(0.97)]
    peers = [Peer(1, h, j) for j, h in enumerate(curves[:3])]
    assert joint_sizes(curves[3], peers, CPU, key=3, extra_s=0.0)[0] == 8
    assert joint_sizes(curves[3], peers, CPU, key=3, extra_s=2.0)[0] == 1
    # and a peer's host time counts the same way in every row's computation
    others = [Peer(1, np.ones(1), 0), Peer(1, np.ones(1), 1), Peer(1, curves[3], 3, extra_s=2.0)]
    assert joint_sizes(np.ones(1), others, CPU, key=2)[1] == [1, 1, 1]
