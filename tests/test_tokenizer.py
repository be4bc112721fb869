"""Streaming detokenizer, chat template and the GGUF tokenizer."""

import pytest
from tokenizers import ByteLevelBPETokenizer

from edgespec.tokenizer import StreamingDetokenizer, Tokenizer

TEXT = "héllo wörld, 世界 says 🙂🚀 — naïve café ünïcödé 日本語のテキスト"


@pytest.fixture(scope="module")
def bytelevel_tokenizer():
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(["hello world " * 20, "café naïve"], vocab_size=300, min_frequency=1, show_progress=False)
    return Tokenizer(bpe._tokenizer, {})


def test_multibyte_characters_split_across_tokens_stream_cleanly(bytelevel_tokenizer):
    tok = bytelevel_tokenizer
    ids = tok.encode(TEXT)
    # The tiny vocabulary cannot hold CJK or emoji: their UTF-8 bytes are separate tokens.
    assert len(ids) > len(TEXT)
    detok = StreamingDetokenizer(tok)
    pieces = [detok.add(i) for i in ids] + [detok.flush()]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == TEXT
    assert sum(1 for p in pieces if p == "") > 0  # something was held back mid-character


def test_detokenizer_flushes_incomplete_tail(bytelevel_tokenizer):
    tok = bytelevel_tokenizer
    ids = tok.encode("ok 🙂")
    detok = StreamingDetokenizer(tok)
    text = "".join(detok.add(i) for i in ids[:-1])  # stop mid-emoji
    assert "\ufffd" not in text
    assert detok.flush().endswith("\ufffd")  # what remains at the end is shown, not lost


def test_chat_template_renders_and_validates(tiny_engine):
    tok = tiny_engine.tokenizer
    tok.chat_template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == "<user>hi<assistant>"
    with pytest.raises(ValueError, match="role"):
        tok.encode_chat([{"content": "no role"}])


@pytest.mark.real_model
def test_gguf_tokenizer_matches_transformers(real_gguf):
    from transformers import AutoTokenizer

    from edgespec.weights.loader import load_gguf

    ref = AutoTokenizer.from_pretrained(str(real_gguf.parent), gguf_file=real_gguf.name)
    ours = load_gguf(real_gguf).tokenizer
    samples = [
        "Hello world! 12345 + 67 = 12412",
        "def f(x):\n    return x ** 2  # square\n\n\tprint('tab')",
        "Ünïcödé — “quotes” 日本語 🙂 <|im_start|>user\nhi<|im_end|>",
        "  leading spaces and trailing   ",
    ]
    for s in samples:
        assert ours.encode(s) == ref(s, add_special_tokens=False).input_ids, s
        ids = ours.encode(s)
        assert ours.decode(ids) == ref.decode(ids)
    msgs = [{"role": "user", "content": "What is 2+2?"}]
    want = ref.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    want = want["input_ids"] if hasattr(want, "keys") else want
    assert ours.encode_chat(msgs) == list(want)


def test_long_text_is_encoded_without_holding_the_gil(bytelevel_tokenizer):
    """A multi-megabyte prompt must not freeze other threads (the server's event loop)
    while it is tokenized, and must get the same ids as the short-text path."""
    import threading
    import time

    from edgespec.tokenizer import LONG_TEXT_CHARS

    tok = bytelevel_tokenizer
    text = ("hello world, café naïve 🙂 " * 60_000)[:1_500_000]
    assert len(text) > LONG_TEXT_CHARS
    started, finished = threading.Event(), threading.Event()
    ticks_during = []

    def ticker():
        started.wait()
        n = 0
        while not finished.is_set():
            time.sleep(0.0005)  # waking up needs the GIL: no wake-ups while encode holds it
            n += 1
        ticks_during.append(n)

    t = threading.Thread(target=ticker)
    t.start()
    started.set()
    ids = tok.encode(text)
    finished.set()
    t.join()
    assert ids == tok._tok.encode(text, add_special_tokens=False).ids
    # Held for the whole call, the GIL allows the ticker one wake-up at most.
    assert ticks_during[0] >= 5, ticks_during
