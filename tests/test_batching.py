"""Continuous batching (edgespec.batch): every request's output is its own.

Tiny random models: a batched pass must give each row what the row gets alone
(logits and caches), and whole generations run together (threads, generate_many)
must equal each request run alone, greedy and seeded sampling, plain and auto,
with cancellation, chunked prompts, per-request options and memory limits.
"""

from __future__ import annotations

import threading

import mlx.core as mx
import numpy as np
import pytest
from conftest import make_tiny_engine, make_tiny_model
from stats_support import chisq_pvalue, continuation_law

import edgespec.batch.batcher as batcher_mod
import edgespec.batch.seq as seq_mod
from edgespec.batch import MemoryBudgetError, Row, batched_forward, group_rows
from edgespec.engine import make_options
from edgespec.kernels import tree_mask
from edgespec.logits.sampling import SamplingParams

PROMPTS = [[(7 * i + 3 * j) % 60 + 1 for j in range(3 + 23 * i)] for i in range(4)]


@pytest.fixture
def engine():
    return make_tiny_engine(3, scale=1.3)


def alone(engine, prompt, **kw):
    """The request run by itself (a batch of one is the mode's own model call)."""
    return engine.generate(prompt, **kw)


# ------------------------------------------------------------------ one batched pass
def _filled(model, prompt):
    cache = model.make_cache()
    mx.eval(model(mx.array(prompt, dtype=mx.int32)[None], cache))
    return cache


def test_batched_pass_equals_each_row_alone():
    """Rows at different offsets, a causal chunk, a single token and a tree with its own mask:
    logits and the caches after the pass equal each row run alone."""
    model = make_tiny_model(1)
    prompts = [[1, 2, 3], list(range(5, 25)), [9] * 7]
    tree_tokens, parents = [4, 5, 6, 7], [-1, 0, 0, 1]

    def rows(caches):
        mask, pos = tree_mask(mx.array(parents, dtype=mx.int32), caches[2][0].offset)
        return [Row(mx.array([[11, 12, 13, 14, 15]]), caches[0]),
                Row(mx.array([[17]]), caches[1]),
                Row(mx.array([tree_tokens]), caches[2], mask, pos)]

    solo_caches = [_filled(model, p) for p in prompts]
    solo = [batched_forward(model, [r])[0] for r in rows(solo_caches)]
    batch_caches = [_filled(model, p) for p in prompts]
    together = batched_forward(model, rows(batch_caches))
    for a, b in zip(solo, together, strict=True):
        assert a.shape == b.shape
        np.testing.assert_allclose(np.array(a), np.array(b), atol=1e-4)
    for ca, cb in zip(solo_caches, batch_caches, strict=True):
        assert ca[0].offset == cb[0].offset
        for la, lb in zip(ca, cb, strict=True):
            np.testing.assert_allclose(np.array(la.state[0]), np.array(lb.state[0]), atol=1e-5)


def test_a_last_only_row_gets_its_own_last_position():
    """A prompt row asks for its last position's logits only (a prefill): alone and in a padded
    batch it gets exactly that row of the full logits, (1, 1, V), not a padding position's."""
    model = make_tiny_model(1)
    full = model(mx.array([list(range(1, 6))]), model.make_cache())
    alone = model(mx.array([list(range(1, 6))]), model.make_cache(), last_only=True)
    assert alone.shape == (1, 1, full.shape[-1])
    np.testing.assert_allclose(np.array(alone[0, 0]), np.array(full[0, -1]), atol=1e-5)
    short, long_ = _filled(model, [3, 4]), _filled(model, [8, 9, 10])
    out = batched_forward(model, [Row(mx.array([list(range(1, 6))]), model.make_cache(), last_only=True),
                                  Row(mx.array([list(range(20, 29))]), long_), Row(mx.array([[7]]), short)])
    assert out[0].shape == (1, 1, full.shape[-1]) and out[1].shape[1] == 9
    np.testing.assert_allclose(np.array(out[0][0, 0]), np.array(full[0, -1]), atol=1e-4)


def test_group_rows_pads_small_rows_together_and_keeps_a_prompt_chunk_apart():
    cpu = lambda n: 1.0 + n / 20.0  # noqa: E731  (8 tokens ~1.4x one, as measured on CPUs)
    assert group_rows([1, 1, 4, 1], cpu) == [[0, 1, 3, 2]]  # 4 rows x 4 tokens: one pass
    groups = group_rows([1, 128, 1, 1], cpu)
    assert sorted(map(sorted, groups)) == [[0, 2, 3], [1]]
    flat = lambda n: 1.0  # noqa: E731  (a pass costs the same at any size: pad everything)
    assert len(group_rows([1, 128, 1], flat)) == 1


# ------------------------------------------------------------------ whole generations
@pytest.mark.parametrize("mode", ["plain", "auto"])
@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.9, "top_k": 20, "seed": 7}])
def test_generate_many_equals_each_request_alone(engine, mode, sampling):
    ref = [alone(engine, p, max_tokens=24, mode=mode, **sampling).tokens for p in PROMPTS]
    many = engine.generate_many(PROMPTS, max_tokens=24, mode=mode, **sampling)
    assert [r.tokens for r in many] == ref
    assert max(engine.batcher.batch_sizes) == len(PROMPTS)  # they really ran together
    if mode == "auto" and not sampling:  # lossless: auto in a batch is plain decoding alone
        assert ref == [alone(engine, p, max_tokens=24, mode="plain").tokens for p in PROMPTS]


def test_streams_from_threads_join_one_batch(engine):
    """Engine.stream from several threads, each with its own options (max_tokens, stop, seed,
    mode): each gets exactly its reply alone, and they ran in shared passes."""
    kws = [dict(max_tokens=30, mode="plain"), dict(max_tokens=9, mode="auto"),
           dict(max_tokens=40, temperature=0.8, seed=3, mode="plain"), dict(max_tokens=25, stop=["e"], mode="auto")]
    ref = [alone(engine, p, **kw) for p, kw in zip(PROMPTS, kws, strict=True)]
    out: dict[int, tuple] = {}
    start = threading.Barrier(len(kws))

    def work(i):
        start.wait()
        chunks = list(engine.stream(PROMPTS[i], **kws[i]))
        out[i] = ("".join(c.text for c in chunks), sum((c.tokens for c in chunks), []), chunks[-1].finish_reason)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(kws))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for i, r in enumerate(ref):
        assert out[i] == (r.text, r.tokens, r.finish_reason), i
    assert max(engine.batcher.batch_sizes) >= 2
    assert engine.batcher.counts() == (0, 0)


def test_a_request_arriving_mid_batch_gets_its_first_token_in_the_same_step(engine):
    """Requests that join while another decodes: their prompt's pass runs first in the step,
    each streams its first token at once and its next call joins that step's decode pass.
    Every reply still equals the request alone (greedy and seeded sampling)."""
    kws = [dict(max_tokens=40, mode="plain"), dict(max_tokens=30, temperature=0.9, seed=5, mode="plain"),
           dict(max_tokens=30, mode="auto")]
    ref = [alone(engine, p, **kw) for p, kw in zip(PROMPTS[1:], kws, strict=True)]
    got = [[] for _ in kws]
    finished = threading.Semaphore(0)
    others_queued, decoding = threading.Event(), threading.Event()

    def emitter(i):
        def emit(kind, payload):
            if kind == "chunk":
                got[i].extend(payload.tokens)
                if i == 0 and not others_queued.is_set():
                    decoding.set()
                    others_queued.wait(10)  # the first request is mid-decode when the others arrive
            elif kind in ("done", "error"):
                finished.release()
        return emit

    early_before = engine.batcher.early_starts
    submit = [lambda i=i: engine.submit(PROMPTS[1 + i], make_options(**kws[i]),
                                        engine.resolve_mode(make_options(**kws[i])), emitter(i))
              for i in range(len(kws))]
    submit[0]()
    assert decoding.wait(30)
    submit[1]()
    submit[2]()
    others_queued.set()
    for _ in kws:
        assert finished.acquire(timeout=60)
    assert got == [r.tokens for r in ref]
    assert engine.batcher.early_starts >= early_before + 2  # both late requests started mid-step
    assert engine.batcher.counts() == (0, 0)


@pytest.mark.parametrize("segment", [1, 2])
def test_a_request_arriving_during_a_pass_starts_before_the_pass_ends(monkeypatch, segment):
    """A pass is evaluated a few layers at a time; requests that arrive meanwhile are started
    between two segments (their prompt's pass, their first token) in that same step, instead
    of waiting for the whole pass and the next step. Their replies equal each run alone."""
    monkeypatch.setattr(batcher_mod, "EVAL_SEGMENT", segment)
    monkeypatch.setattr(batcher_mod, "ALONE_WHOLE_TOKENS", 0)  # request 0's short passes segmented too
    engine = make_tiny_engine(3, scale=1.3, num_hidden_layers=4)  # segments of 1 or 2 layers
    kws = [dict(max_tokens=30, mode="auto"), dict(max_tokens=20, mode="plain"),
           dict(max_tokens=20, temperature=0.9, seed=4, mode="auto")]
    ref = [alone(engine, p, **kw) for p, kw in zip(PROMPTS[1:], kws, strict=True)]
    b = engine.batcher
    got = [[] for _ in kws]
    first_step: dict[int, int] = {}
    finished = threading.Semaphore(0)

    def emitter(i):
        def emit(kind, payload):
            if kind == "chunk":
                got[i].extend(payload.tokens)
                first_step.setdefault(i, b.steps)
            elif kind in ("done", "error"):
                finished.release()
        return emit

    def submit(i):
        opts = make_options(**kws[i])
        engine.submit(PROMPTS[1 + i], opts, engine.resolve_mode(opts), emitter(i))

    arrived: list[int] = []
    real = batcher_mod.Batcher._eval_part

    def eval_part(self, arrays):
        real(self, arrays)
        if len(got[0]) >= 3 and not arrived:  # request 0 is decoding: two more arrive mid-pass
            arrived.append(b.steps)
            submit(1)
            submit(2)

    monkeypatch.setattr(batcher_mod.Batcher, "_eval_part", eval_part)
    submit(0)
    assert finished.acquire(timeout=60)
    assert arrived  # the first request's passes were evaluated in segments
    for _ in kws[1:]:
        assert finished.acquire(timeout=60)
    assert got == [r.tokens for r in ref]
    assert first_step[1] == first_step[2] == arrived[0]  # their first tokens came in that same step
    assert b.counts() == (0, 0)


def test_a_request_alone_evaluates_its_short_passes_at_once(monkeypatch):
    """Alone, a pass of up to ALONE_WHOLE_TOKENS tokens is evaluated at once (each segment
    boundary is a synchronisation); its prompt's pass, wider, still in segments. The reply
    is the same either way."""
    monkeypatch.setattr(batcher_mod, "EVAL_SEGMENT", 1)
    engine = make_tiny_engine(3, scale=1.3, num_hidden_layers=4)
    parts = []
    real = batcher_mod.Batcher._eval_part
    monkeypatch.setattr(batcher_mod.Batcher, "_eval_part",
                        lambda self, a: (parts.append(self.steps), real(self, a)))
    prompt = PROMPTS[1]  # 26 tokens: the prompt's pass is wide
    assert len(prompt) > batcher_mod.ALONE_WHOLE_TOKENS
    got = alone(engine, prompt, max_tokens=12, mode="plain").tokens
    assert len(got) == 12
    assert len(set(parts)) == 1  # the prompt's pass alone was segmented (one step, 3 boundaries)
    monkeypatch.setattr(batcher_mod, "ALONE_WHOLE_TOKENS", 0)
    parts.clear()
    assert alone(engine, prompt, max_tokens=12, mode="plain").tokens == got
    assert len(set(parts)) >= 11  # every step's pass in segments


def test_a_full_batch_evaluates_its_pass_at_once(monkeypatch):
    """Segments are for requests that could start before the pass ends: with the batch full,
    a pass is evaluated at once (each segment boundary is a synchronisation)."""
    monkeypatch.setattr(batcher_mod, "EVAL_SEGMENT", 1)
    engine = make_tiny_engine(3, scale=1.3, num_hidden_layers=4)
    parts = []
    real = batcher_mod.Batcher._eval_part
    monkeypatch.setattr(batcher_mod.Batcher, "_eval_part",
                        lambda self, a: (parts.append(len(self._live)), real(self, a)))
    engine.batcher.max_batch = 2
    ref = [alone(engine, p, max_tokens=12, mode="plain").tokens for p in PROMPTS[:2]]
    parts.clear()
    assert [r.tokens for r in engine.generate_many(PROMPTS[:2], max_tokens=12, mode="plain")] == ref
    assert 2 not in parts  # (a step with the first request alone had room for the second)
    engine.batcher.max_batch = 3  # room for one more: the same passes in segments
    assert [r.tokens for r in engine.generate_many(PROMPTS[:2], max_tokens=12, mode="plain")] == ref
    assert 2 in parts


def test_a_cancelled_stream_leaves_the_others_unchanged(engine):
    ref = [alone(engine, p, max_tokens=30, mode="plain").tokens for p in PROMPTS]
    streams = [engine.stream(p, max_tokens=30, mode="plain") for p in PROMPTS]
    got = [[] for _ in PROMPTS]
    for step in range(40):
        for i, s in enumerate(streams):
            if s is None:
                continue
            if i == 1 and step == 3:  # the client goes away mid-stream
                s.close()
                streams[i] = None
                continue
            try:
                got[i].extend(next(s).tokens)
            except StopIteration:
                streams[i] = None
    assert got[1] == ref[1][: len(got[1])] and len(got[1]) < len(ref[1])
    for i in (0, 2, 3):
        assert got[i] == ref[i]
    assert engine.batcher.counts() == (0, 0)  # the cancelled row was freed


def test_cancel_callback_in_a_batch_stops_only_that_request(engine):
    ref = [alone(engine, p, max_tokens=20, mode="plain").tokens for p in PROMPTS]
    results, stop_now = {}, threading.Event()
    done = threading.Semaphore(0)

    def emit_for(i):
        toks = []

        def emit(kind, payload):
            if kind == "chunk":
                toks.extend(payload.tokens)
                if i == 0 and len(toks) >= 5:
                    stop_now.set()
            elif kind in ("done", "error"):
                results[i] = (toks, kind)
                done.release()
        return emit

    options = make_options(max_tokens=20, mode="plain")
    for i, p in enumerate(PROMPTS):
        cancel = stop_now.is_set if i == 0 else None
        engine.submit(engine.encode_prompt(p), options, "plain", emit_for(i), cancel=cancel)
    for _ in PROMPTS:
        assert done.acquire(timeout=60)
    assert 5 <= len(results[0][0]) < 20 and results[0][0] == ref[0][: len(results[0][0])]
    for i in (1, 2, 3):
        assert results[i] == (ref[i], "done")


def test_a_long_prompt_is_prefilled_in_chunks_between_the_others_steps(engine, monkeypatch):
    monkeypatch.setattr(seq_mod, "PREFILL_CHUNK", 8)
    engine.prompt_cache_bytes = 0  # the prompts run twice: the second time must prefill again
    long_prompt = [(5 * j) % 60 + 1 for j in range(70)]
    prompts = PROMPTS[:3] + [long_prompt]
    ref = [alone(engine, p, max_tokens=16, mode="plain").tokens for p in prompts]
    steps_before = engine.batcher.steps
    many = engine.generate_many(prompts, max_tokens=16, mode="plain")
    assert [r.tokens for r in many] == ref
    # 70 prompt tokens in chunks of 8 take 9 steps while the others decode: more than 16+1 steps.
    assert engine.batcher.steps - steps_before >= 16 + 9


def test_max_batch_bounds_the_batch_and_queues_the_rest():
    engine = make_tiny_engine(3, scale=1.3)
    engine.max_batch = 2
    ref = [alone(engine, p, max_tokens=12, mode="plain").tokens for p in PROMPTS]
    many = engine.generate_many(PROMPTS, max_tokens=12, mode="plain")
    assert [r.tokens for r in many] == ref
    assert max(engine.batcher.batch_sizes) == 2


def test_memory_budget_queues_what_does_not_fit_and_refuses_what_never_fits():
    from edgespec.batch.memory import reserve_bytes
    from edgespec.lookahead.memory import tree_bytes

    engine = make_tiny_engine(3, scale=1.3)
    one = reserve_bytes(engine, len(PROMPTS[-1]), 12)
    # Room for the caches of one request at a time (plus a little): they run one after another.
    engine.memory_budget = tree_bytes(engine.model) + one + one // 2
    ref = [alone(engine, p, max_tokens=12, mode="plain").tokens for p in PROMPTS]
    many = engine.generate_many(PROMPTS, max_tokens=12, mode="plain")
    assert [r.tokens for r in many] == ref
    assert max(engine.batcher.batch_sizes) == 1
    with pytest.raises(MemoryBudgetError, match="lower max_tokens.*--memory-budget"):
        engine.generate(PROMPTS[0], max_tokens=400)


def test_sampled_stream_in_a_batch_follows_the_verifier_law():
    """Chi-square of 3-token continuations sampled inside batches of 8 (the other rows at other
    positions) against the enumerated law of plain sampling."""
    params = dict(temperature=1.0, top_k=3)
    engine = make_tiny_engine(1, scale=1.5, vocab_size=8)
    engine.tokenizer.eos_token_ids = set()  # every run gives 3 tokens
    prompt = [1, 2, 3, 4, 1, 2, 3, 5, 1, 2]
    law = continuation_law(engine.model, prompt, SamplingParams(**params), 3)
    keys = sorted(law)
    counts = np.zeros(len(keys))
    runs, width = 480, 8
    for start in range(0, runs, width):
        results, done = {}, threading.Semaphore(0)
        for seed in range(start, start + width):
            def emit(kind, payload, seed=seed, results=results, done=done):
                if kind == "chunk":
                    results.setdefault(seed, []).extend(payload.tokens)
                elif kind in ("done", "error"):
                    done.release()
            # Filler rows at other offsets share the passes.
            p = prompt if seed % 2 == 0 else prompt[: 3 + seed % 5]
            engine.submit(p, make_options(max_tokens=3, seed=seed, mode="plain", **params), "plain", emit)
        for _ in range(width):
            assert done.acquire(timeout=60)
        for seed in range(start, start + width, 2):
            counts[keys.index(tuple(results[seed]))] += 1
    assert max(engine.batcher.batch_sizes) == width
    assert chisq_pvalue(counts, np.array([law[k] for k in keys])) > 1e-3


# ------------------------------------------------------------------ batch-aware speculation
def test_speculation_is_priced_against_the_batch():
    """A tree that pays alone (8 tokens cost 1.4x one, 4 expected) does not pay when it pads
    7 plain rows to 8 tokens; with one other row at the same cost shape it still does."""
    from edgespec.adaptive.estimate import Costs, merge_candidates, plan_tree
    from edgespec.batch.cost import BatchCosts, PassCost, StepCost

    sizes = [1, 2, 4, 8, 16, 32, 64, 128]
    secs = [1.0 + n / 20.0 for n in sizes]
    alone_costs = Costs(sizes, secs)
    step = StepCost(PassCost(sizes, secs))
    # One candidate of 7 tokens, each very likely: E = 1 + sum of path probabilities.
    nodes = merge_candidates([([5, 6, 7, 8, 9, 10, 11], np.array([0.9 ** d for d in range(1, 8)]))])
    kept, _ = plan_tree(nodes, alone_costs, plain_s=alone_costs.verify(1))
    assert len(kept) == 7  # alone: verify the whole candidate
    for others, want_tree in ([1], True), ([1] * 7, False):
        bc = BatchCosts(alone_costs, others, step)
        kept, _ = plan_tree(nodes, bc, plain_s=bc.verify(1), others=float(len(others)))
        assert bool(kept) == want_tree, others
    # The step cost groups rows: a prompt chunk of 128 is its own pass, not padding for the rest.
    assert step([1, 1, 1, 128]) == pytest.approx(step([1, 1, 1]) + step([128]))


# ------------------------------------------------------------------ edgespec bench --concurrency
def test_bench_concurrency_table_names_the_guards_choice_per_batch_size():
    from edgespec.benchmark.concurrency import format_concurrency

    rows = [{"concurrency": c, "policy": p, "aggregate_tps": t, "per_request_tps": 1.0, "ttft_s": 0.1,
             "tokens_per_pass": 1.0, "requests": c, "wrong": 0}
            for c, p, t in ((1, "off", 5.0), (1, "on", 6.0), (1, "chosen", 6.0), (4, "off", 12.0), (4, "on", 8.0),
                            (4, "chosen", 11.4))]
    guard = {"4": {"spec_tps": 8.0, "plain_tps": 12.5, "spec_steps": 12, "plain_steps": 90, "best": "plain"},
             "3": {"spec_tps": 9.0, "plain_tps": None, "spec_steps": 6, "plain_steps": 0, "best": "spec"}}
    text = format_concurrency({"rows": rows, "guard": guard, "settings": {"levels": [1, 4],
                                                                          "policies": ["off", "on", "chosen"]}})
    assert "4 requests 0.95x" in text
    assert "4 rows: speculation 8.0 tok/s over 12 steps, plain 12.5 over 90, runs plain" in text
    assert "3 rows" not in text  # only sizes where both regimes were measured


def test_bench_concurrency_reports_every_level_and_policy(tmp_path, monkeypatch, capsys):
    import json

    import edgespec.apps.common as common

    from edgespec.cli import main

    monkeypatch.setattr(common, "load_engine", lambda args, progress=True: make_tiny_engine(3, scale=1.3))
    pf = tmp_path / "p.jsonl"
    pf.write_text("\n".join(json.dumps({"prompt": t, "domain": "chat"}) for t in ("hello", "abc def", "xyz")))
    out = tmp_path / "out"
    rc = main(["bench", "--prompts", str(pf), "--max-tokens", "12", "--repeats", "1", "--raw", "--quiet",
               "--concurrency", "1,2,3", "--per-client", "2", "--out", str(out)])
    assert rc == 0
    report = json.loads((out / "concurrency.json").read_text())
    cells = {(r["concurrency"], r["policy"]) for r in report["rows"]}
    assert cells == {(c, p) for c in (1, 2, 3) for p in ("off", "on", "chosen")}
    # every client sent its 2 requests back to back
    assert all(r["requests"] == 2 * r["concurrency"] for r in report["rows"])
    assert "--per-client 2" in report["command"]
    assert all(r["wrong"] == 0 and r["aggregate_tps"] > 0 and r["ttft_s"] > 0 for r in report["rows"])
    assert all(r["tokens_per_pass"] == 1.0 for r in report["rows"] if r["policy"] == "off")
    assert "chosen / best" in (out / "concurrency.md").read_text()
    assert (out / "concurrency.png").stat().st_size > 0
    # the guard's state goes into the report: per batch size, steps measured under each regime
    assert all(set(g) >= {"spec_steps", "plain_steps", "best"} for g in report["guard"].values())
    assert any(g["spec_steps"] + g["plain_steps"] > 0 for g in report["guard"].values())
    capsys.readouterr()
    assert main(["bench", "--concurrency", "1,0", "--out", str(out)]) != 0
    assert "--concurrency takes positive integers" in capsys.readouterr().err
    assert main(["bench", "--concurrency", "2", "--per-client", "0", "--out", str(out)]) != 0
    assert "--per-client takes a positive integer" in capsys.readouterr().err


def test_the_idle_worker_thread_ends_and_a_new_one_takes_over(engine, monkeypatch):
    import time

    monkeypatch.setattr(batcher_mod, "IDLE_EXIT_S", 0.05)
    first = [engine.generate(p, max_tokens=12).tokens for p in PROMPTS[:2]]
    deadline = time.monotonic() + 10
    while engine.batcher._thread is not None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert engine.batcher._thread is None  # ended (it would hold the engine and MLX's stream)
    assert [engine.generate(p, max_tokens=12).tokens for p in PROMPTS[:2]] == first


# ------------------------------------------------------------------ tokens out before the next call
class _CountingModel:
    """The tiny model, counting its calls; `batch_context` as a batched sequence sees it."""

    def __init__(self, model, others: bool):
        self._model, self.calls, self._others = model, 0, others

    def __getattr__(self, name):
        return getattr(self._model, name)

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self._model(*args, **kwargs)

    def batch_context(self):
        return ([1], None) if self._others else None


@pytest.mark.parametrize("others", [False, True])
def test_plain_decoding_hands_out_a_token_before_its_next_call(others):
    """The first token leaves before any decode call is made; in a batch with others every
    token does (a call there waits for the batch's next pass); alone, later tokens may be
    queued one step ahead. Either way the tokens are plain decoding's own."""
    from edgespec.generate import GenerationStats, PlainMode
    from edgespec.logits.sampling import Sampler

    model = make_tiny_model(2, scale=1.3)
    prompt = PROMPTS[1]
    ref = [t.id for t, _ in zip(PlainMode(model).steps(prompt, Sampler(SamplingParams(temperature=0)),
                                                       GenerationStats()), range(6), strict=False)]
    counting = _CountingModel(model, others)
    steps = PlainMode(counting).steps(prompt, Sampler(SamplingParams(temperature=0)), GenerationStats())
    got, calls = [], []
    for tok in steps:
        got.append(tok.id)
        calls.append(counting.calls)
        if len(got) == 6:
            break
    assert got == ref
    assert calls[0] == 1  # the prompt's pass only
    if others:
        assert calls == list(range(1, 7))  # token n out after n calls: never one queued ahead
    else:
        assert calls[1:] == list(range(3, 8))  # alone: the next step is queued before each token
