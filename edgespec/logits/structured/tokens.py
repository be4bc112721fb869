"""The bytes each token stands for, read from edgespec's own tokenizer.

A grammar engine needs the vocabulary as bytes. edgespec's `Tokenizer` wraps a
`tokenizers` backend whatever the model's source (HF folder or GGUF, whose
vocabulary the runtime converts), so the bytes are derived from the backend's
own description of itself, not from a Hugging Face fast tokenizer object:

- byte-level BPE (GPT-2 style: a `ByteLevel` decoder): every character of a
  token string stands for one byte through the fixed GPT-2 byte <-> unicode table;
- SentencePiece style (`Metaspace` or a `Replace` of U+2581, `ByteFallback`):
  U+2581 is a space and `<0xNN>` pieces are single raw bytes;
- anything else (word or character level): the token string's UTF-8 bytes.

Special added tokens (chat markers, EOS) are marked special: the grammar never
allows them inside the text it matches.
"""

from __future__ import annotations

import json
import re
from functools import lru_cache

SPIECE_SPACE = "\u2581"
_BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


@lru_cache(maxsize=1)
def _bytelevel_table() -> dict[str, int]:
    """GPT-2's reversible map: printable characters standing for the 256 byte values."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars = list(keep)
    n = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(keep, chars, strict=True)}


def _decoder_types(spec) -> set[str]:
    """Every decoder type named in a tokenizer.json `decoder` entry (sequences flattened),
    plus 'ReplaceSpace' for a Replace of U+2581."""
    out: set[str] = set()
    if isinstance(spec, dict):
        kind = spec.get("type")
        if kind:
            out.add(kind)
        if kind == "Replace" and SPIECE_SPACE in json.dumps(spec.get("pattern"), ensure_ascii=False):
            out.add("ReplaceSpace")
        for d in spec.get("decoders") or []:
            out |= _decoder_types(d)
    return out


def token_style(tokenizer) -> str:
    """'bytelevel', 'sentencepiece' or 'text' (see the module doc)."""
    backend = tokenizer._tok
    try:
        spec = json.loads(backend.to_str())
    except Exception:  # a backend that cannot describe itself: treat its tokens as text
        return "text"
    kinds = _decoder_types(spec.get("decoder"))
    if "ByteLevel" in kinds:
        return "bytelevel"
    if kinds & {"Metaspace", "ByteFallback", "ReplaceSpace"}:
        return "sentencepiece"
    return "text"


def token_bytes(tokenizer, vocab_size: int | None = None) -> tuple[list[bytes], list[int]]:
    """(bytes of every token id 0..vocab_size-1, the ids of special tokens).

    Special tokens get b'\\xff' + their name (llguidance's convention: never part of
    matched text). Ids the tokenizer does not know (a model vocabulary padded beyond the
    tokenizer's) are special too, so a grammar never allows them."""
    backend = tokenizer._tok
    n = vocab_size if vocab_size is not None else tokenizer.vocab_size
    style = token_style(tokenizer)
    table = _bytelevel_table() if style == "bytelevel" else None
    added = {}
    try:
        added = {i: t for i, t in backend.get_added_tokens_decoder().items()}
    except AttributeError:
        pass
    out: list[bytes] = []
    special: list[int] = []
    for i in range(n):
        a = added.get(i)
        s = backend.id_to_token(i)
        if s is None or (a is not None and a.special) or i in tokenizer.eos_token_ids:
            out.append(b"\xff" + (s or f"<unused_{i}>").encode("utf-8"))
            special.append(i)
            continue
        if a is not None:  # an added, non-special token: its text as written
            out.append(a.content.encode("utf-8"))
        elif table is not None:
            try:
                out.append(bytes(table[c] for c in s))
            except KeyError:  # not a byte-level string after all: take it as text
                out.append(s.encode("utf-8"))
        elif style == "sentencepiece":
            m = _BYTE_PIECE.match(s)
            out.append(bytes([int(m.group(1), 16)]) if m else s.replace(SPIECE_SPACE, " ").encode("utf-8"))
        else:
            out.append(s.encode("utf-8"))
    return out, special
