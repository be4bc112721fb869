"""The byte-length bound on prompts (#34): a text of B bytes encodes to at least
ceil(B / L) tokens, L = Tokenizer.max_token_bytes, so one past (context - 1) * L bytes is
refused before it is tokenized. L must never be too small (that would refuse a prompt that
fits): checked on byte-level BPE, SentencePiece BPE and Unigram with byte fallback, and
folding normalizers, over random and adversarial texts; tokenizers where one token can
cover any length of input have no bound."""

from __future__ import annotations

import math
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, ByteLevelBPETokenizer, Regex, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from edgespec.errors import ContextLengthError
from edgespec.tokenizer import _UNSET, Tokenizer, max_token_bytes
from edgespec.weights.formats.gguf_tokenizer import _sentencepiece

SPACE = "\u2581"
BYTES = [f"<0x{b:02X}>" for b in range(256)]
CORPUS = ["hello world " * 50, "café naïve ünïcödé " * 10, "-" * 32, "the theory of the thing " * 20]


def _byte_level() -> HFTokenizer:
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(CORPUS, vocab_size=400, min_frequency=1, show_progress=False)
    tok = bpe._tokenizer
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    return tok


def _sentencepiece_bpe() -> HFTokenizer:
    """As edgespec builds one from a GGUF (llama, Mistral, Gemma): byte fallback, unknowns fused."""
    pieces = [SPACE, *"abcdefghijklmnopqrstuvwxyz", f"{SPACE}t", "th", "he", f"{SPACE}th", f"{SPACE}the",
              SPACE * 2, SPACE * 4, SPACE * 8, "é", "ün", "ünï"]
    tokens = ["<unk>", "<s>", "</s>", *BYTES, *pieces]
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    scores = [0.0] * (3 + 256) + [-float(i) for i in range(len(pieces))]
    return _sentencepiece(tokens, types, scores, "<unk>", add_space_prefix=True)


def _unigram() -> HFTokenizer:
    pieces = [("<unk>", 0.0), *((b, -10.0) for b in BYTES), (SPACE, -2.0), (f"{SPACE}the", -1.0), ("é", -3.0),
              *((c, -4.0) for c in "abcdefghijklmnopqrstuvwxyz"), ("hello", -1.5), (f"{SPACE}world", -1.5)]
    tok = HFTokenizer(models.Unigram(pieces, unk_id=0, byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    return tok


def _folding() -> HFTokenizer:
    """Byte-level BPE behind NFKC and lower-casing: U+1D400 (4 bytes) becomes "a" (1)."""
    tok = _byte_level()
    tok.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])
    return tok


BOUNDED = {"byte-level": _byte_level, "sentencepiece-bpe": _sentencepiece_bpe, "unigram": _unigram,
           "nfkc-lowercase": _folding}


@pytest.fixture(scope="module", params=sorted(BOUNDED))
def bounded(request) -> Tokenizer:
    return Tokenizer(BOUNDED[request.param](), {})


def _utf8(s: str) -> int:
    return len(s.encode("utf-8", "surrogatepass"))


def _bound(tok: Tokenizer, text: str) -> int:
    """The fewest tokens the byte bound promises for `text` (ASCII text: its own bound)."""
    assert tok.max_token_bytes is not None
    return math.ceil(_utf8(text) / (tok.max_token_bytes_ascii if text.isascii() else tok.max_token_bytes))


def test_byte_level_bound_is_the_longest_tokens_bytes_and_tight():
    """"Ġ" stands for one space byte, not for its own two UTF-8 bytes."""
    tok = Tokenizer(_byte_level(), {})
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    vocab = tok._tok.get_vocab()
    longest = max(vocab, key=lambda p: len(p) if set(p) <= alphabet else 0)
    assert tok.max_token_bytes == len(longest) == 32  # 32 dashes (the special tokens are 12)
    text = "-" * 32 * 500  # the longest token, 500 times: exactly the bound's count
    assert len(tok.encode(text)) == math.ceil(_utf8(text) / tok.max_token_bytes) == 500
    assert Tokenizer(_byte_level(), {}).max_token_bytes == 32  # cached per tokenizer, same each time


def test_sentencepiece_and_unigram_bounds():
    # Eight U+2581 pieces: a literal "▁" in the text is 3 bytes, so the piece may stand for 24.
    assert Tokenizer(_sentencepiece_bpe(), {}).max_token_bytes == 24
    assert Tokenizer(_unigram(), {}).max_token_bytes == len(f"{SPACE}world".encode())
    # NFKC can shrink 4 bytes to 1 and lower-casing 3 to 1 (KELVIN SIGN): the bound grows by both.
    folding = Tokenizer(_folding(), {})
    assert folding.max_token_bytes == 32 * 5 * 4
    assert folding.max_token_bytes_ascii == 32  # ASCII comes out of NFKC and lower-casing as long
    assert Tokenizer(_byte_level(), {}).max_token_bytes_ascii == 32


def _adversarial_texts(tok: Tokenizer) -> list[str]:
    vocab = list(tok._tok.get_vocab())
    longest = sorted(vocab, key=len)[-20:]
    return [
        "".join(longest) * 20, " " * 5000, SPACE * 3000, "<|im_start|>" * 100, "\U0001d400" * 700,
        "\u212a" * 700, "\u1fbe\u0308\u0301" * 300, "e\u0301" * 900, "\ud800" * 50 + "x", "한국어" * 300,
        "\u1100\u1161\u11a8" * 300, "🙂" * 400, "\x00\x01\t\n\r" * 200, "hello world " * 300, "ΐ" * 500,
    ]


def test_bound_holds_on_adversarial_texts(bounded):
    for text in _adversarial_texts(bounded) + ["ABC-" * 4000, "-" * 32000, "THE THEORY " * 900]:
        n = len(bounded.encode(text, add_special_tokens=False))
        assert n >= _bound(bounded, text), (text[:40], n, _utf8(text), _bound(bounded, text))


@settings(max_examples=200, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(parts=st.lists(st.one_of(
    st.text(max_size=40),
    st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=40),
    st.sampled_from(["-" * 32, " " * 17, SPACE * 8, "<|im_start|>", "\U0001d400", "\u212a", "the", "ünï", "é"]),
    st.text(alphabet=st.characters(max_codepoint=127), max_size=60),
    st.sampled_from(["-" * 32, "HELLO WORLD ", "The Theory", "<|im_end|>"]),
), max_size=30), which=st.sampled_from(sorted(BOUNDED)))
def test_bound_holds_on_random_texts(parts, which):
    tok = _TOKENIZERS[which]
    text = "".join(parts)
    n = len(tok.encode(text, add_special_tokens=False))
    assert n >= _bound(tok, text)


_TOKENIZERS = {name: Tokenizer(make(), {}) for name, make in BOUNDED.items()}


def _with(tok: HFTokenizer, **parts) -> HFTokenizer:
    for k, v in parts.items():
        setattr(tok, k, v)
    return tok


@pytest.mark.parametrize("make", [
    lambda: HFTokenizer(models.WordLevel({"a": 0, "<unk>": 1}, unk_token="<unk>")),  # an unknown word: 1 token
    lambda: HFTokenizer(models.WordPiece({"a": 0, "[UNK]": 1}, unk_token="[UNK]")),
    lambda: HFTokenizer(models.BPE({"a": 0, "<unk>": 1}, [], unk_token="<unk>", fuse_unk=True)),  # runs fused
    lambda: HFTokenizer(models.BPE({"a": 0}, [])),  # unknown characters dropped
    lambda: HFTokenizer(models.Unigram([("<unk>", 0.0), ("a", -1.0)], 0, byte_fallback=False)),  # fused
    lambda: _with(_byte_level(), pre_tokenizer=pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.ByteLevel()])),  # whitespace dropped
    lambda: _with(_byte_level(), pre_tokenizer=pre_tokenizers.Sequence(
        [pre_tokenizers.Split(" ", "removed"), pre_tokenizers.ByteLevel()])),
    lambda: _with(_byte_level(), normalizer=normalizers.Strip()),
    lambda: _with(_byte_level(), normalizer=normalizers.Replace(Regex(" +"), " ")),  # runs collapsed
    lambda: _with(_byte_level(), normalizer=normalizers.Replace("x", "")),
    lambda: _with(_byte_level(), normalizer=normalizers.BertNormalizer()),
], ids=["wordlevel", "wordpiece", "bpe-fused-unknown", "bpe-no-unknown", "unigram-no-fallback", "whitespace-split",
        "split-removed", "strip", "regex-replace", "deletion", "bert-normalizer"])
def test_no_bound_where_one_token_can_cover_any_length(make):
    assert Tokenizer(make(), {}).max_token_bytes is None


def test_no_bound_with_whitespace_swallowing_added_tokens_or_truncation():
    tok = _byte_level()
    tok.add_special_tokens([AddedToken("<mask>", lstrip=True)])  # takes every space before it
    assert Tokenizer(tok, {}).max_token_bytes is None
    tok = _byte_level()
    tok.enable_truncation(64)
    assert Tokenizer(tok, {}).max_token_bytes is None
    assert max_token_bytes(object()) is None  # not a `tokenizers` object: nothing to go on


def test_replace_that_shortens_text_widens_the_bound():
    tok = _with(_byte_level(), normalizer=normalizers.Replace("abcd", "z"))
    assert Tokenizer(tok, {}).max_token_bytes == 32 * 4


# ------------------------------------------------------------------ refusing before tokenizing
class _NoEncode:
    """A backend that must not be asked to tokenize."""

    def __init__(self, real):
        self.real = real

    def __getattr__(self, name):
        if name.startswith("encode"):
            raise AssertionError("tokenized a text the byte bound should have refused")
        return getattr(self.real, name)


def test_check_length_at_the_bound():
    tok = Tokenizer(_byte_level(), {})
    L, C = tok.max_token_bytes, 10
    tok.check_length("a" * ((C - 1) * L), C)  # could be C - 1 tokens: tokenize it
    tok.check_length("é" * ((C - 1) * L // 2), C)
    with pytest.raises(ContextLengthError, match=f"the prompt has at least {C} tokens; the context window is {C}"):
        tok.check_length("a" * ((C - 1) * L + 1), C)
    with pytest.raises(ContextLengthError):
        tok.check_length("é" * ((C - 1) * L // 2 + 1), C)  # 2 bytes a character
    with pytest.raises(ContextLengthError):
        tok.check_length("\ud800" * ((C - 1) * L // 3 + 1), C)  # a lone surrogate becomes 3-byte U+FFFD
    Tokenizer(HFTokenizer(models.WordLevel({"a": 0}, unk_token="a")), {}).check_length("a" * 10**6, 2)  # no bound
    folding = Tokenizer(_folding(), {})  # ASCII text is held to the ASCII bound, other text to the wider one
    with pytest.raises(ContextLengthError):
        folding.check_length("a" * ((C - 1) * 32 + 1), C)
    folding.check_length("\U0001d400" * ((C - 1) * 32 * 5 * 4 // 4), C)


def test_encode_refuses_a_hopeless_text_without_tokenizing_it():
    tok = Tokenizer(_byte_level(), {})
    L = tok.max_token_bytes
    tok._tok = _NoEncode(tok._tok)
    with pytest.raises(ContextLengthError, match="at least 62500 tokens; the context window is 4096"):
        tok.encode("x" * 2_000_000, context_length=4096)
    with pytest.raises(ContextLengthError, match="at least"):
        tok.encode_chat([{"role": "user", "content": "x" * (4095 * L)}], context_length=4096)  # + the template's


def test_encode_with_a_context_counts_exactly_past_the_bound():
    tok = Tokenizer(_byte_level(), {"bos_token": "<|im_start|>", "add_bos_token": True})
    text = "zqx " * 2000  # about 2 tokens a word
    n = len(tok.encode(text))
    assert tok.encode(text, context_length=n + 1) == tok.encode(text)
    assert len(text) < 999 * tok.max_token_bytes  # within the byte bound of a 1000-token context
    with pytest.raises(ContextLengthError, match=f"the prompt has {n - 1} tokens; the context window is 1000 "):
        tok.encode(text, context_length=1000)  # counted before the BOS and before listing the ids
    msgs = [{"role": "user", "content": text}]
    assert tok.encode_chat(msgs, context_length=10**6) == tok.encode_chat(msgs)
    with pytest.raises(ContextLengthError, match="the prompt has \\d+ tokens; the context window is 1000 "):
        tok.encode_chat(msgs, context_length=1000)


def test_long_chat_text_is_encoded_without_holding_the_gil():
    """encode_chat took the GIL-holding path whatever the length: a 2 MB chat message froze
    the server's event loop for 5 s."""
    tok = Tokenizer(_byte_level(), {})
    msgs = [{"role": "user", "content": ("hello world, café naïve 🙂 " * 60_000)[:1_500_000]}]
    finished = threading.Event()
    ticks = []

    def ticker():
        n = 0
        while not finished.is_set():
            time.sleep(0.0005)  # waking up needs the GIL
            n += 1
        ticks.append(n)

    t = threading.Thread(target=ticker)
    t.start()
    ids = tok.encode_chat(msgs)
    finished.set()
    t.join()
    assert ids == tok._tok.encode(tok.apply_chat_template(msgs), add_special_tokens=False).ids
    assert ticks[0] >= 5, ticks


def test_a_text_of_at_most_context_bytes_is_passed_without_computing_the_bound():
    tok = Tokenizer(_byte_level(), {})
    tok.check_length("hello there", 64)  # 4 * 11 bytes <= 63: fits whatever one token stands for
    assert tok._max_token_bytes is _UNSET  # not computed (~0.2 s on a real vocabulary, at first use)
    with pytest.raises(ContextLengthError):
        tok.check_length("-" * 32 * 64, 64)  # past the bound: computed, refused
    assert tok._max_token_bytes == 32
