"""The Python API from an app's point of view: load a bundle, generate, stream, chat with
history, modes and sampling, stats, and one engine shared by several threads."""

from __future__ import annotations

import threading

import pytest
from server_support import write_tiny_bundle

import edgespec
from edgespec.generate import GenerationStats

PROMPTS = ["hello world", "abc def", "the quick brown fox", "Zebra 42", "xyz", "A B C"]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    bundle = write_tiny_bundle(tmp_path_factory.mktemp("api") / "tiny-api")
    return edgespec.load(bundle, drafter="none", progress=False)


def test_generate_stream_and_stats(engine):
    r = engine.generate("hello world", max_tokens=16)
    assert isinstance(r, edgespec.GenerationResult)
    assert len(r.tokens) == 16 and r.finish_reason == "length"
    assert r.text == engine.tokenizer.decode(r.tokens, skip_special_tokens=True)
    assert r.stats.generated_tokens == 16 and r.stats.prompt_tokens == r.prompt_tokens == 11
    assert r.stats.mode == "adaptive" and r.stats.tokens_per_pass >= 1.0  # auto = the adaptive decoder
    chunks = list(engine.stream("hello world", max_tokens=16))
    assert "".join(c.text for c in chunks) == r.text
    assert [c.finish_reason for c in chunks][-1] == "length"
    assert all(c.finish_reason is None for c in chunks[:-1])
    assert engine.last_stats.generated_tokens == 16


def test_chat_with_history(engine):
    history = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    first = engine.chat(history, max_tokens=8)
    history += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "more"}]
    second = engine.chat(history, max_tokens=8)
    assert second.prompt_tokens > first.prompt_tokens + len(first.tokens)
    assert second.text == engine.generate(messages=history, max_tokens=8).text


def test_options_object_and_sampling(engine):
    opts = edgespec.make_options(max_tokens=12, temperature=0.8, top_k=10, seed=5)
    a = engine.generate("abc def", options=opts).text
    b = engine.generate("abc def", max_tokens=12, temperature=0.8, top_k=10, seed=5).text
    assert a == b
    with pytest.raises(ValueError, match="temperature"):
        engine.generate("abc", temperature=-1)
    with pytest.raises(ValueError, match="unknown decoding mode"):
        engine.generate("abc", mode="warp")
    with pytest.raises(edgespec.ContextLengthError):
        engine.generate("ab" * 400)


def test_cancel_callback_stops_a_stream(engine):
    seen: list = []
    stats = GenerationStats()
    for chunk in engine.stream("hello world", max_tokens=200, cancel=lambda: len(seen) >= 3, stats=stats):
        seen.append(chunk)
    assert seen[-1].finish_reason == "cancelled"
    # cancel() is polled before each token: nothing is generated after it fires.
    assert stats.generated_tokens == 3 and len(seen) == 4


def _sequential(engine):
    out = {}
    for i, p in enumerate(PROMPTS):
        kw = dict(max_tokens=20) if i % 2 == 0 else dict(max_tokens=20, temperature=0.7, seed=i)
        out[p] = (engine.generate(p, **kw), kw)
    return out


def test_threads_sharing_one_engine_get_sequential_results(engine):
    ref = _sequential(engine)
    results: dict[str, object] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(len(PROMPTS) * 2)

    def work(p, kw, streaming):
        try:
            start.wait()
            if streaming:
                stats = GenerationStats()
                text = "".join(c.text for c in engine.stream(p, stats=stats, **kw))
                results[(p, "stream")] = (text, stats.generated_tokens)
            else:
                r = engine.generate(p, **kw)
                results[(p, "generate")] = (r.text, r.stats.generated_tokens)
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(p, kw, s)) for p, (_, kw) in ref.items() for s in (False, True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    for p, (r, _) in ref.items():
        for how in ("generate", "stream"):
            # Same text, and each caller's stats are its own generation's.
            assert results[(p, how)] == (r.text, r.stats.generated_tokens), (p, how)


def test_an_open_stream_does_not_hold_the_engine(engine):
    """Generations batch: a second caller's generation runs to its end while a stream is open
    (it joins the running batch, edgespec.batch) and gets the reply it gets alone."""
    alone = engine.generate("abc", max_tokens=4).text
    stream = engine.stream("hello world", max_tokens=100)
    next(stream)  # generation started
    done = threading.Event()
    got = []
    other = threading.Thread(target=lambda: (got.append(engine.generate("abc", max_tokens=4).text), done.set()))
    other.start()
    other.join(60)
    assert done.is_set(), "a second generation waited for the open stream"
    assert got == [alone]
    stream.close()


def test_docs_api_examples_run(engine, monkeypatch, capsys):
    """Every Python block of docs/api.md's "Python API" section runs (against a tiny ASCII engine)."""
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "docs" / "api.md").read_text()
    doc = readme.split("\n## Python API\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", doc, re.S)
    assert len(blocks) >= 5
    from test_structured import ascii_engine

    # JSON-schema examples need a tokenizer that can write JSON (a grammar the model's tokens
    # cannot write is refused at compile time): the tiny bundle's, plus printable ASCII.
    ascii = ascii_engine()
    ascii.loaded.tokenizer.chat_template = engine.tokenizer.chat_template
    monkeypatch.setattr(edgespec, "load", lambda *a, **k: ascii)
    for code in blocks:
        exec(compile(code, "docs/api.md", "exec"), {"__name__": "docs_example"})
    out = capsys.readouterr().out
    assert "tokens before the deadline" in out and "plain" in out


def test_prompts_of_the_wrong_kind_are_refused_not_reinterpreted(engine):
    """bytes are not token ids, 1.7 is not a token id, and a misspelt keyword is not ignored."""
    for prompt, msg in [
        (b"hello", "prompt is bytes: decode it"),
        ([1.7, 2], "token ids must be integers"),
        ([True, 2], "token ids must be integers"),
        (5, "prompt must be text or a list of token ids"),
    ]:
        with pytest.raises(ValueError, match=msg):
            engine.generate(prompt, max_tokens=2)
    # A misspelt keyword is a TypeError (as in any Python call) that names the valid ones.
    with pytest.raises(edgespec.UnknownOptionError, match="unknown option.*'temprature'.*temperature"):
        engine.generate("hello", max_tokens=2, temprature=0.9)
    with pytest.raises(TypeError, match="'window' for mode 'plain'"):
        engine.generate("hello", max_tokens=2, mode="plain", window=3)
    import numpy as np

    assert engine.generate(list(np.array([1, 2, 3])), max_tokens=2).prompt_tokens == 3  # numpy ints are ints


def test_a_reply_stopped_early_still_reports_its_speed(engine):
    """Ctrl-C in chat closes the stream mid-reply: the stats must still time what ran (not 0 tok/s)."""
    from edgespec.generate import GenerationStats

    stats = GenerationStats()
    it = engine.stream("hello world", max_tokens=50, stats=stats, mode="plain")
    for _ in range(3):
        next(it)
    it.close()
    assert stats.generated_tokens >= 3 and stats.decode_s > 0 and stats.tokens_per_s > 0


def test_engine_lists_only_the_modes_it_can_run_and_a_bad_drafter_is_a_load_error(engine, tmp_path):
    from edgespec.drafters import attach_drafter
    from edgespec.drafters.prompt_lookup import PromptLookupDrafter

    assert engine.drafter is None
    assert "speculative" not in engine.modes and {"plain", "adaptive", "lookahead"} <= set(engine.modes)
    for m in engine.modes:  # every listed mode runs
        assert engine.generate("hello", max_tokens=3, mode=m).tokens
    with pytest.raises(edgespec.ModelLoadError, match="no such file or folder"):
        attach_drafter(engine, tmp_path / "nope")
    engine.drafter = PromptLookupDrafter()
    try:
        assert "speculative" in engine.modes
    finally:
        engine.drafter = None
