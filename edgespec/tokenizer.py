"""Tokenizer, chat template and a streaming detokenizer.

A bundle stores `tokenizer.json` (Hugging Face `tokenizers` format) and
`tokenizer_config.json` (special tokens, chat template). The runtime needs only
the `tokenizers` package and jinja2.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from edgespec.errors import ModelLoadError

# Texts longer than this are encoded without holding the GIL (see Tokenizer.encode).
LONG_TEXT_CHARS = 16_384


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

    # --- loading -----------------------------------------------------------------
    @classmethod
    def from_folder(cls, folder: str | Path) -> Tokenizer:
        from tokenizers import Tokenizer as HFTokenizer

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
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        text = valid_text(text)
        if len(text) > LONG_TEXT_CHARS:
            # `tokenizers` holds the GIL for the whole of `encode` (and for freeing its
            # offsets) but releases it in `encode_batch_fast`, which skips the offsets:
            # a 4 MB prompt encoded the first way froze every other thread (the
            # server's event loop answered /health after 2.2 s).
            ids = self._tok.encode_batch_fast([text], add_special_tokens=False)[0].ids
        else:
            ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            if not ids or ids[0] != self.bos_token_id:
                ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, i: int) -> str | None:
        return self._tok.id_to_token(i)

    # --- chat ---------------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            # No template: a plain transcript is the least surprising fallback.
            lines = [f"{m['role']}: {m['content']}" for m in messages]
            return "\n".join(lines) + ("\nassistant:" if add_generation_prompt else "")
        if self._template is None:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

            def raise_exception(message):
                raise ValueError(message)

            env.globals["raise_exception"] = raise_exception
            self._template = env.from_string(self.chat_template)
        return self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        for m in messages:
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError(f"each message needs 'role' and 'content', got {m!r}")
        text = self.apply_chat_template(messages)
        ids = self._tok.encode(valid_text(text), add_special_tokens=False).ids
        if self.add_bos_token and self.bos_token_id is not None and (not ids or ids[0] != self.bos_token_id):
            if not (self.bos_token and text.startswith(self.bos_token)):
                ids = [self.bos_token_id] + ids
        return ids

    def save(self, folder: str | Path) -> None:
        folder = Path(folder)
        self._tok.save(str(folder / "tokenizer.json"))
        (folder / "tokenizer_config.json").write_text(json.dumps(self.config, indent=2, ensure_ascii=False))


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
