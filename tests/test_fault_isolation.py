"""One bad request never takes the engine down (#34).

Every generation of an engine shares one batch worker, so an exception raised while
serving one request (its callbacks, its decoding mode and sources, its stop strings, its
detokenizer) must end that request alone: the request's caller gets the error, every other
request streams on to its reference output, and the engine serves the next request.
"""

from __future__ import annotations

import threading

import pytest
from conftest import make_tiny_engine

from edgespec.engine import make_options
from edgespec.errors import CallbackError, EngineError

PROMPTS = ["abcabcabc", "hello world", "the cat sat", "xyz xyz"]
MARK_TOKENS = 13  # max_tokens of the faulty request: how the injected faults find it
TOKENS = 24


@pytest.fixture(scope="module")
def engine():
    return make_tiny_engine(seed=3)


@pytest.fixture(scope="module")
def reference(engine):
    """Each prompt's reply alone, before any fault."""
    return {p: engine.generate(p, max_tokens=TOKENS, mode="auto").tokens for p in PROMPTS[:3]}


def _others_stream(engine, results, errors, started, go):
    """Three streams from threads, each recording its tokens (or its error). Each holds its
    second chunk until `go` is set: the stream waits for its reader, so all three are still
    live in the batch while the faulty request runs."""
    threads = []
    for p in PROMPTS[:3]:
        def run(p=p):
            try:
                toks = []
                for i, chunk in enumerate(engine.stream(p, max_tokens=TOKENS, mode="auto")):
                    toks.extend(chunk.tokens)
                    if i == 0:
                        started.release()
                        go.wait(60)
                results[p] = toks
            except BaseException as e:  # recorded: the test fails on it
                errors[p] = e
                started.release()

        t = threading.Thread(target=run, daemon=True)
        t.start()
        threads.append(t)
    return threads


def _check_isolated(engine, reference, faulty, expect=Exception):
    """Run `faulty()` (which must raise `expect`) while three other streams run; those
    finish with their reference replies, and a fifth request afterwards succeeds."""
    results, errors = {}, {}
    started, go = threading.Semaphore(0), threading.Event()
    threads = _others_stream(engine, results, errors, started, go)
    for _ in threads:
        assert started.acquire(timeout=60), "the other streams did not start"
    assert engine.batcher.counts()[0] == 3, "the other streams are not live in the batch"
    raised = []

    def bad():
        try:
            faulty()
        except BaseException as e:
            raised.append(e)

    t = threading.Thread(target=bad, daemon=True)
    t.start()
    t.join(60)
    go.set()
    assert not t.is_alive(), "the faulty request never returned (the engine hangs)"
    for th in threads:
        th.join(60)
        assert not th.is_alive(), "another request never finished"
    assert raised, "the faulty request did not raise"
    assert isinstance(raised[0], expect), f"raised {type(raised[0]).__name__}: {raised[0]}"
    assert not errors, f"other requests failed: {errors}"
    assert results == reference
    after = engine.generate(PROMPTS[0], max_tokens=TOKENS, mode="auto")
    assert after.tokens == reference[PROMPTS[0]]
    return raised[0]


def _within(fn, timeout: float = 60.0):
    """fn() on a thread: its result, or its exception re-raised; fails (not hangs) past `timeout`."""
    box = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as e:
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), "the call never returned (the engine hangs)"
    if "error" in box:
        raise box["error"]
    return box["value"]


@pytest.mark.parametrize("cancel", [5, "yes", object()])
def test_a_cancel_that_is_neither_callable_nor_an_event_is_refused_at_once(engine, cancel):
    with pytest.raises(ValueError, match="cancel"):
        _within(lambda: engine.generate("Hi", cancel=cancel))
    with pytest.raises(ValueError, match="cancel"):
        _within(lambda: engine.stream("Hi", cancel=cancel))
    assert _within(lambda: engine.generate("abc", max_tokens=4)).finish_reason == "length"  # still serving


def test_an_event_is_accepted_as_cancel(engine, reference):
    ev = threading.Event()
    out = _within(lambda: engine.generate(PROMPTS[0], max_tokens=TOKENS, mode="auto", cancel=ev))
    assert out.tokens == reference[PROMPTS[0]]
    ev.set()
    assert _within(lambda: engine.generate(PROMPTS[0], max_tokens=TOKENS, cancel=ev)).finish_reason == "cancelled"


def test_a_cancel_callback_that_raises_fails_only_its_request(engine, reference):
    calls = [0]

    def cancel():
        calls[0] += 1
        if calls[0] > 2:
            raise ZeroDivisionError("boom in cancel")
        return False

    err = _check_isolated(engine, reference,
                          lambda: engine.generate(PROMPTS[3], max_tokens=TOKENS, cancel=cancel),
                          expect=CallbackError)
    assert "cancel" in str(err) and "ZeroDivisionError" in str(err)
    assert isinstance(err.__cause__, ZeroDivisionError)


def test_a_raising_cancel_before_admission_fails_only_its_request(engine, reference):
    def cancel():
        raise RuntimeError("raised at once")

    err = _check_isolated(engine, reference,
                          lambda: engine.generate(PROMPTS[3], max_tokens=TOKENS, cancel=cancel),
                          expect=CallbackError)
    assert "raised at once" in str(err)


def _submit_and_wait(engine, emit_fault=None, ready_fault=None):
    """engine.submit with callbacks that may raise; returns once the request ended and
    raises its error (as Engine.stream would)."""
    ids = engine.encode_prompt(PROMPTS[3])
    options = make_options(max_tokens=TOKENS)
    ended = threading.Event()
    box = {}
    n = [0]

    def emit(kind, payload):
        if kind in ("done", "error"):
            box[kind] = payload
            ended.set()
            return
        if kind == "chunk":
            n[0] += 1
            if emit_fault is not None and n[0] == 2:
                raise emit_fault

    def ready():
        if ready_fault is not None and n[0] >= 1:
            raise ready_fault
        return True

    engine.submit(ids, options, engine.resolve_mode(options), emit, ready=ready)
    assert ended.wait(60), "the request never ended"
    if "error" in box:
        raise box["error"]
    return box["done"]


def test_an_emit_callback_that_raises_fails_only_its_request(engine, reference):
    err = _check_isolated(engine, reference, lambda: _submit_and_wait(engine, emit_fault=KeyError("emit")),
                          expect=CallbackError)
    assert "KeyError" in str(err)


def test_a_ready_callback_that_raises_fails_only_its_request(engine, reference):
    err = _check_isolated(engine, reference, lambda: _submit_and_wait(engine, ready_fault=OSError("ready")),
                          expect=CallbackError)
    assert "ready" in str(err)


class _Boom(Exception):
    pass


def _inject(monkeypatch, engine, stage):
    """Make the request whose max_tokens is MARK_TOKENS fail in `stage`."""
    import edgespec.batch.batcher as batcher_mod

    if stage in ("mode", "source"):
        real_build = type(engine).build_mode

        def build_mode(self, options, mode_name, stats):
            mode = real_build(self, options, mode_name, stats)
            if options.max_tokens != MARK_TOKENS:
                return mode
            if stage == "source":
                # the adaptive decoder's first source raises when asked for candidates
                src = mode.sources[0]

                def propose(*a, **k):
                    raise _Boom("source")

                for name in ("propose", "candidates", "lookup"):
                    if hasattr(src, name):
                        monkeypatch.setattr(src, name, propose)
                        break
                else:
                    raise AssertionError(f"no candidate method on {type(src).__name__}")
                return mode
            real_steps = mode.steps

            def steps(*a, **k):
                for i, tok in enumerate(real_steps(*a, **k)):
                    if i == 3:
                        raise _Boom("mode")
                    yield tok

            mode.steps = steps
            return mode

        monkeypatch.setattr(type(engine), "build_mode", build_mode)
        return
    real_stream = batcher_mod.stream_tokens

    def stream_tokens(steps, tokenizer, stats, max_tokens, stop=None, **kw):
        if max_tokens == MARK_TOKENS:
            if stage == "stop":
                class Stop(str):
                    def __getitem__(self, i):
                        raise _Boom("stop")

                stop = [Stop("qqq")]
            elif stage == "detokenizer":
                class Tok:
                    def __init__(self, t):
                        self._t = t

                    def __getattr__(self, n):
                        return getattr(self._t, n)

                    def decode(self, *a, **k):
                        raise _Boom("detokenizer")

                tokenizer = Tok(tokenizer)
        return real_stream(steps, tokenizer, stats, max_tokens, stop, **kw)

    monkeypatch.setattr(batcher_mod, "stream_tokens", stream_tokens)


@pytest.mark.parametrize("stage", ["mode", "source", "stop", "detokenizer"])
def test_a_fault_in_any_stage_fails_only_its_request(engine, reference, monkeypatch, stage):
    _inject(monkeypatch, engine, stage)
    err = _check_isolated(engine, reference,
                          lambda: engine.generate(PROMPTS[3], max_tokens=MARK_TOKENS, mode="auto"),
                          expect=_Boom)
    assert str(err) == stage


def test_a_worker_crash_fails_every_request_and_the_next_one_is_served(engine, reference, monkeypatch):
    """A bug in the batcher itself (not a request's) ends the requests it held with the error
    instead of leaving their callers waiting forever; the next request gets a new worker."""
    b = engine.batcher
    real = type(b)._step_body
    hit = [0]

    def step_body(self):
        hit[0] += 1
        if hit[0] == 2:
            raise _Boom("worker")
        return real(self)

    monkeypatch.setattr(type(b), "_step_body", step_body)
    with pytest.raises(EngineError, match="worker"):
        _within(lambda: engine.generate(PROMPTS[0], max_tokens=TOKENS, mode="auto"))
    monkeypatch.setattr(type(b), "_step_body", real)
    after = _within(lambda: engine.generate(PROMPTS[0], max_tokens=TOKENS, mode="auto"))
    assert after.tokens == reference[PROMPTS[0]]
