"""Tokenizer, chat template and a streaming detokenizer.

A bundle stores `tokenizer.json` (Hugging Face `tokenizers` format) and
`tokenizer_config.json` (special tokens, chat template). The runtime needs only
the `tokenizers` package and jinja2.

About 470 lines: the tokenizer, its chat template (with tools) and the streaming
detokenizer share the special tokens and byte handling of one vocabulary.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import math
from pathlib import Path
from typing import Any

from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.pre_tokenizers import ByteLevel

import edgespec.logits.tools as tool_calls
from edgespec.errors import ContextLengthError, ModelLoadError
from edgespec.logits.structured.tokens import token_bytes
from edgespec.logits.tools import check_message_tool_calls, template_tool_variable, tool_format

# Texts longer than this are encoded without holding the GIL (see Tokenizer._encode_text).
LONG_TEXT_CHARS = 16_384

# How much a normalizer can shrink text: at most this many input bytes per byte it
# outputs. Largest ratios over every code point (unicodedata, Unicode 14), plus a margin
# for later Unicode versions: NFD 3.0 (U+1FEF GREEK VARIA -> "`"), NFC 3.5 (U+1FBE U+0308
# U+0301 -> "\u0390", 7 bytes -> 2), NFKC/NFKD 4.0 (U+1D400 MATHEMATICAL BOLD A -> "A"),
# Lowercase 3.0 (U+212A KELVIN SIGN -> "k"). Prepend only adds text.
_SHRINK = {"NFD": 4.0, "NFC": 4.5, "NFKD": 5.0, "NFKC": 5.0, "Lowercase": 4.0, "Prepend": 1.0, "ByteLevel": 1.0}
_ASCII_SAFE = {"NFD", "NFC", "NFKD", "NFKC", "Lowercase"}  # ASCII text comes out as long as it went in
# Pre-tokenizers that split text without dropping any of it (Split and Punctuation unless
# their behaviour is "Removed"); Whitespace, WhitespaceSplit, BertPreTokenizer and
# CharDelimiterSplit drop what they split on.
_KEEPS_TEXT = {"ByteLevel", "Metaspace", "Digits", "UnicodeScripts", "Split", "Punctuation", "FixedLength"}
_BYTE_TOKENS = [f"<0x{b:02X}>" for b in range(256)]  # SentencePiece's byte-fallback pieces


def _token_str(tok: Any) -> str | None:
    if tok is None:
        return None
    if isinstance(tok, dict):
        return tok.get("content")
    return str(tok)



def valid_text(text: str) -> str:
    """`text` with lone surrogates replaced by U+FFFD.

    Invalid UTF-8 read from a terminal, a pipe or argv reaches Python as lone
    surrogates (surrogateescape), which the tokenizer cannot take; each bad byte
    becomes the replacement character instead, as a UTF-8 decoder would make it.
    """
    if not isinstance(text, str):
        raise ValueError(f"text must be a string, got {type(text).__name__}")
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


def _utf8_len(s: str) -> int:
    # Lone surrogates count 3 bytes, as the U+FFFD that valid_text puts in their place.
    return len(s) if s.isascii() else len(s.encode("utf-8", "surrogatepass"))


def _normalizer_shrink(spec: dict | None, ascii_only: bool = False) -> float | None:
    """Input bytes per output byte of a normalizer, at most (of ASCII input with
    `ascii_only`); None when it can drop text."""
    if spec is None:
        return 1.0
    kind = spec.get("type")
    if kind == "Sequence":
        factor = 1.0
        for step in spec.get("normalizers") or []:
            f = _normalizer_shrink(step, ascii_only)
            if f is None:
                return None
            factor *= f
        return factor
    if kind == "Replace":  # a plain string replaced everywhere by a non-empty one
        pattern, content = (spec.get("pattern") or {}).get("String"), spec.get("content") or ""
        if pattern is None or not content:
            return None  # a regex (may match runs of any length) or a deletion
        return max(1.0, _utf8_len(pattern) / _utf8_len(content))
    if ascii_only and kind in _ASCII_SAFE:
        return 1.0
    return _SHRINK.get(kind)  # Strip, StripAccents, BertNormalizer, NMT, Precompiled: None


def _pre_tokenizer_keeps_text(spec: dict | None) -> tuple[bool, bool]:
    """(drops no text, maps text to bytes (ByteLevel))."""
    if spec is None:
        return True, False
    kind = spec.get("type")
    if kind == "Sequence":
        parts = [_pre_tokenizer_keeps_text(p) for p in spec.get("pretokenizers") or []]
        return all(k for k, _ in parts), any(b for _, b in parts)
    if kind not in _KEEPS_TEXT or str(spec.get("behavior", "")).lower() == "removed":
        return False, False
    return True, kind == "ByteLevel"


def max_token_bytes(backend, ascii_only: bool = False) -> int | None:
    """The most bytes of UTF-8 input text that one token of `backend` (a `tokenizers`
    Tokenizer) can stand for, or None when no such bound holds.

    A text of B bytes then encodes to at least ceil(B / L) tokens, so a prompt past
    (context - 1) * L bytes cannot fit the context and is refused without tokenizing it.
    Byte-level BPE: a token's characters are bytes (GPT-2's byte alphabet, "Ġ" = one
    space byte). SentencePiece-style BPE or Unigram: a piece's UTF-8 length ("<0xNN>"
    byte-fallback pieces: one byte). Added tokens count their content. A normalizer
    that composes or folds characters multiplies the bound by how much it can shrink
    text (_SHRINK). No bound where one token can cover input of any length: word-level
    or WordPiece models (a whole unknown word is one token), an unknown-token fallback
    that fuses runs of unknown characters, pre-tokenizers or normalizers that drop
    text (whitespace splitting, stripping, regex replacements), added tokens that
    swallow neighbouring whitespace (lstrip/rstrip), truncation. `ascii_only`: the bound
    for ASCII text, which Unicode normalization and lower-casing leave as long as it is.
    """
    try:
        spec = json.loads(backend.to_str())
    except Exception:  # an object that cannot describe itself: no bound
        return None
    if spec.get("truncation"):
        return None
    shrink = _normalizer_shrink(spec.get("normalizer"), ascii_only)
    keeps, byte_pre = _pre_tokenizer_keeps_text(spec.get("pre_tokenizer"))
    if shrink is None or not keeps:
        return None
    model = spec.get("model") or {}
    kind = model.get("type")
    if kind == "BPE":
        pieces = list(model.get("vocab") or {})
    elif kind == "Unigram":
        pieces = [p[0] for p in model.get("vocab") or []]
    else:  # WordLevel, WordPiece
        return None
    vocab = set(pieces)
    longest = 0
    byte_level = byte_pre or (spec.get("normalizer") or {}).get("type") == "ByteLevel"
    if byte_level:
        alphabet = set(ByteLevel.alphabet())
        if not alphabet <= vocab and not (kind == "BPE" and model.get("unk_token") and not model.get("fuse_unk")):
            return None  # a byte with no token of its own is dropped (or fused into one unknown)
        for p in pieces:
            longest = max(longest, sum(1 if ch in alphabet else _utf8_len(ch) for ch in p))
    else:
        if model.get("byte_fallback") and vocab.issuperset(_BYTE_TOKENS):
            pass  # an unknown character becomes one token per byte
        elif kind == "BPE" and model.get("unk_token") and not model.get("fuse_unk"):
            longest = 4  # one unknown token per character, 4 bytes at most
        else:
            return None  # unknown characters dropped, or a run of them fused into one token
        for p in pieces:
            longest = max(longest, 1 if p in _BYTE_TOKENS else _utf8_len(p))
    bound = longest * shrink
    for t in spec.get("added_tokens") or []:
        if t.get("lstrip") or t.get("rstrip"):
            return None
        bound = max(bound, _utf8_len(t.get("content") or "") * (shrink if t.get("normalized") else 1.0))
    return max(1, math.ceil(bound))


def context_length_error(tokens: int, context_length: int, at_least: bool = False) -> ContextLengthError:
    return ContextLengthError(
        f"the prompt has {'at least ' if at_least else ''}{tokens} tokens; the context window is "
        f"{context_length} (prompt plus reply must fit): shorten the prompt or the conversation"
    )


_UNSET = object()


class Tokenizer:
    def __init__(self, backend, config: dict[str, Any]):
        self._tok = backend
        self.config = config
        self.chat_template: str | None = config.get("chat_template")
        self.bos_token = _token_str(config.get("bos_token"))
        self.eos_token = _token_str(config.get("eos_token"))
        self.add_bos_token = bool(config.get("add_bos_token", False))
        self.bos_token_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        eos_ids = set()
        if self.eos_token is not None:
            tid = self._tok.token_to_id(self.eos_token)
            if tid is not None:
                eos_ids.add(tid)
        for extra in config.get("extra_eos_token_ids", []):
            eos_ids.add(int(extra))
        self.eos_token_ids = eos_ids
        self._template = None
        self._max_token_bytes: Any = _UNSET
        self._max_token_bytes_ascii: Any = _UNSET

    # --- loading -----------------------------------------------------------------
    @classmethod
    def from_folder(cls, folder: str | Path) -> Tokenizer:
        folder = Path(folder)
        tj = folder / "tokenizer.json"
        if not tj.is_file():
            raise ModelLoadError(f"{folder}: no tokenizer.json (a bundle or HF folder must carry one)")
        try:
            backend = HFTokenizer.from_file(str(tj))
        except Exception as e:  # tokenizers raises plain Exception subclasses
            raise ModelLoadError(f"{tj}: not a valid tokenizer.json ({e})") from None
        cfg_path = folder / "tokenizer_config.json"
        config: dict[str, Any] = {}
        if cfg_path.is_file():
            try:
                config = json.loads(cfg_path.read_text())
            except json.JSONDecodeError as e:
                raise ModelLoadError(f"{cfg_path}: invalid JSON ({e})") from None
        if not config.get("chat_template"):
            jinja = folder / "chat_template.jinja"
            if jinja.is_file():
                config["chat_template"] = jinja.read_text()
        return cls(backend, config)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def vocab_hash(self) -> str:
        """Hash of the token -> id map: two models can speculate together iff equal."""
        vocab = self._tok.get_vocab(with_added_tokens=True)
        blob = json.dumps(sorted(vocab.items(), key=lambda kv: kv[1]), ensure_ascii=False)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    # --- encode / decode ----------------------------------------------------------
    @property
    def max_token_bytes(self) -> int | None:
        """Most input bytes one token stands for (None: no bound); see max_token_bytes()."""
        if self._max_token_bytes is _UNSET:
            self._max_token_bytes = max_token_bytes(self._tok)
            self._max_token_bytes_ascii = max_token_bytes(self._tok, ascii_only=True)
        return self._max_token_bytes

    @property
    def max_token_bytes_ascii(self) -> int | None:
        """max_token_bytes for ASCII text (smaller behind Unicode normalizers or lower-casing)."""
        self.max_token_bytes  # noqa: B018 -- computes both
        return self._max_token_bytes_ascii

    def check_length(self, text: str, context_length: int) -> None:
        """Raise ContextLengthError when `text` cannot encode to fewer than `context_length`
        tokens, judged by its length alone: B bytes are at least ceil(B / max_token_bytes)
        tokens. Costs nothing for texts far from the bound either way (no tokenizing, and
        the bytes are counted only for texts within 4x of it), so it may run on an event loop.
        """
        if not isinstance(text, str) or 4 * len(text) <= context_length - 1:
            return  # at most context_length - 1 bytes: fits whatever a token stands for (no bound computed)
        if self.max_token_bytes is None:
            return
        most = self.max_token_bytes_ascii if text.isascii() else self.max_token_bytes  # isascii: O(1)
        fits = (context_length - 1) * most  # the most bytes context_length - 1 tokens can hold
        n = len(text)
        if 4 * n <= fits:  # 4 bytes a character at most
            return
        size = n if n > fits else _utf8_len(text)  # a character is 1 byte at least
        if size > fits:
            raise context_length_error(math.ceil(size / most), context_length, at_least=True)

    def encode(self, text: str, add_special_tokens: bool = True, context_length: int | None = None) -> list[int]:
        """Token ids of `text`. With `context_length`, a text that cannot fit it (fewer
        tokens than context_length) raises ContextLengthError, before it is tokenized
        when its length alone says so (check_length), else before its ids are listed."""
        if context_length is not None:
            self.check_length(text, context_length)
        ids = self._encode_text(valid_text(text), context_length)
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            if not ids or ids[0] != self.bos_token_id:
                ids = [self.bos_token_id] + ids
        return ids

    def _encode_text(self, text: str, context_length: int | None) -> list[int]:
        if len(text) > LONG_TEXT_CHARS:
            # `tokenizers` holds the GIL for the whole of `encode` (and for freeing its
            # offsets) but releases it in `encode_batch_fast`, which skips the offsets:
            # a 4 MB prompt encoded the first way froze every other thread (the
            # server's event loop answered /health after 2.2 s).
            enc = self._tok.encode_batch_fast([text], add_special_tokens=False)[0]
        else:
            enc = self._tok.encode(text, add_special_tokens=False)
        if context_length is not None and len(enc) >= context_length:
            raise context_length_error(len(enc), context_length)  # without listing the ids
        return enc.ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, i: int) -> str | None:
        return self._tok.id_to_token(i)

    def token_bytes(self, i: int) -> bytes:
        """The bytes token `i` stands for (what OpenAI's logprobs report as `bytes`), as the
        grammar engine reads the vocabulary (edgespec.logits.structured.tokens); a special token
        (EOS, chat markers) as its name."""
        table = self.__dict__.get("_token_bytes")
        if table is None:
            table = self.__dict__["_token_bytes"] = token_bytes(self)[0]
        i = int(i)
        if not 0 <= i < len(table):
            return b""
        b = table[i]
        return b[1:] if b[:1] == b"\xff" else b

    # --- chat ---------------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> str:
        """The conversation as the model's chat template writes it. `tools` (OpenAI's list,
        see edgespec.logits.tools) go to a template that renders tools as `tools` (SmolLM3:
        `xml_tools`); a template that renders none gets them described in the system
        message. Assistant `tool_calls` and `tool` messages are passed the same way."""
        fmt = tool_calls.tool_format(self.chat_template)
        var = self.tool_variable
        if any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
            messages = tool_calls.prepare_messages(messages, fmt, native=var is not None)
        if tools and var is None:
            messages = tool_calls.fallback_messages(messages, tools, fmt)
        if not self.chat_template:
            # No template: a plain transcript is the least surprising fallback.
            lines = [f"{m['role']}: {m['content']}" for m in messages]
            return "\n".join(lines) + ("\nassistant:" if add_generation_prompt else "")
        if self._template is None:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

            def raise_exception(message):
                raise ValueError(message)

            def tojson(value, indent=None, separators=None, sort_keys=False):
                # As transformers renders templates: plain JSON, not HTML-escaped.
                return json.dumps(value, ensure_ascii=False, indent=indent, separators=separators,
                                  sort_keys=sort_keys)

            def strftime_now(fmt):
                return datetime.datetime.now().strftime(fmt)

            env.globals["raise_exception"] = raise_exception
            env.globals["strftime_now"] = strftime_now
            env.filters["tojson"] = tojson
            self._template = env.from_string(self.chat_template)
        extra = {var: tools} if tools and var is not None else {}
        return self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **extra,
        )

    @property
    def tool_variable(self) -> str | None:
        """The variable the chat template renders a tool list from (None: it renders none)."""
        if "_tool_variable" not in self.__dict__:
            self.__dict__["_tool_variable"] = template_tool_variable(self.chat_template)
        return self.__dict__["_tool_variable"]

    @property
    def tool_format(self):
        """How this model writes tool calls (an edgespec.logits.tools.ToolFormat)."""
        return tool_format(self.chat_template)

    def encode_chat(self, messages: list[dict[str, str]], context_length: int | None = None,
                    tools: list[dict] | None = None) -> list[int]:
        """Token ids of the conversation rendered by the chat template; `context_length` as
        for encode (the length bound applies to the rendered text); `tools` as for
        apply_chat_template."""
        messages = chat_messages(messages)
        text = self.apply_chat_template(messages, tools=tools or None)
        if context_length is not None:
            self.check_length(text, context_length)
        ids = self._encode_text(valid_text(text), context_length)
        if self.add_bos_token and self.bos_token_id is not None and (not ids or ids[0] != self.bos_token_id):
            if not (self.bos_token and text.startswith(self.bos_token)):
                ids = [self.bos_token_id] + ids
        return ids

    def save(self, folder: str | Path) -> None:
        folder = Path(folder)
        self._tok.save(str(folder / "tokenizer.json"))
        (folder / "tokenizer_config.json").write_text(json.dumps(self.config, indent=2, ensure_ascii=False))


def chat_messages(messages) -> list[dict]:
    """Messages checked for the chat template: each a dict with a text `role` and a text
    `content` (a string, or a list of {"type": "text", "text": ...} parts, joined). An
    assistant message may carry `tool_calls` (OpenAI's shape; its content may then be
    None or absent) and a `tool` message answers one (`tool_call_id`). Anything else is a
    ValueError naming the message, never an error from inside the template."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts")
    out = []
    for i, m in enumerate(messages):
        calls = m.get("tool_calls") if isinstance(m, dict) else None
        if not isinstance(m, dict) or "role" not in m or ("content" not in m and not calls):
            raise ValueError(f"message {i}: each message needs 'role' and 'content', got {m!r:.80}")
        role, content = m["role"], m.get("content")
        if not isinstance(role, str) or not role:
            raise ValueError(f"message {i}: role must be a non-empty string, got {role!r:.40}")
        extra = {}
        if calls is not None:
            if role != "assistant":
                raise ValueError(f"message {i} ({role}): only assistant messages carry tool_calls")
            extra["tool_calls"] = check_message_tool_calls(i, calls)
            if content is None:
                content = ""
        if role == "tool" and m.get("tool_call_id") is not None and not isinstance(m["tool_call_id"], str):
            raise ValueError(f"message {i} (tool): tool_call_id must be a string")
        if isinstance(content, (list, tuple)):
            texts = []
            for p in content:
                if not (isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)):
                    raise ValueError(f"message {i} ({role}): content parts must be {{'type': 'text', 'text': str}}, "
                                     f"got {p!r:.60}")
                texts.append(p["text"])
            content = "".join(texts)
        elif not isinstance(content, str):
            raise ValueError(f"message {i} ({role}): content must be a string (or a list of text parts), "
                             f"got {type(content).__name__}: {content!r:.40}")
        out.append({**m, "role": role, "content": content, **extra})
    return out


class StreamingDetokenizer:
    """Turns a growing list of token ids into text pieces, never splitting a UTF-8 character.

    Byte-level BPE tokens can end in the middle of a multi-byte character; the
    decoder then yields U+FFFD. We hold text back until it no longer ends in an
    incomplete character, and decode from a moving offset so the cost stays
    proportional to the new tokens.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.tokens: list[int] = []
        # Decode tokens[_prefix:] and drop the text of tokens[_prefix:_read], which was
        # already emitted. Keeping one token of left context matters for decoders
        # that strip a leading space from the first token (SentencePiece).
        self._prefix = 0
        self._read = 0
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip)

    def add(self, token: int) -> str:
        """Add a token; return the newly completed text (possibly '')."""
        self.tokens.append(token)
        return self._emit(final=False)

    def flush(self) -> str:
        """Emit whatever is held back (at the end of generation)."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        done = self._decode(self.tokens[self._prefix : self._read])
        window = self._decode(self.tokens[self._prefix :])
        if not final and window.endswith("\ufffd"):
            return ""
        new = window[len(done) :]
        self.text += new
        self._prefix, self._read = self._read, len(self.tokens)
        return new
