"""The tokenizer stored in GGUF metadata, rebuilt with the Hugging Face `tokenizers` library.

Two GGUF tokenizer models:
- "gpt2": byte-level BPE (tokens + merges), as in Llama 3, Qwen, SmolLM;
- "llama": SentencePiece BPE (pieces + scores + token types), as in Llama 2, Gemma,
  Mistral, Phi-3. SentencePiece merges the adjacent pair whose merged piece has the
  highest score; `tokenizers`' BPE merges the pair of lowest rank, so the merges are
  every split of a piece into two pieces, ranked by the merged piece's score.
  Characters outside the vocabulary fall back to the <0xNN> byte pieces.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
)

from edgespec.errors import ModelLoadError

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED = CONTROL, USER_DEFINED  # older names
SPACE = "\u2581"  # SentencePiece's visible space


def _field(reader, key: str, default=None):
    value = reader.fields.get(key)
    return default if value is None else value


# tokenizer.ggml.pre -> the splits applied before byte-level BPE (llama.cpp's llama-vocab.cpp
# names; the regexes are the models' own tokenizer.json ones). None = GPT-2's, which
# tokenizers' ByteLevel applies itself.
_GPT2 = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
_QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_LLAMA3 = _QWEN2.replace(r"|\p{N}|", r"|\p{N}{1,3}|")
PRE_SPLITS: dict[str, list[str] | None] = {
    "default": None, "gpt2": None, "mpt": None, "olmo": None, "jais": None,
    "llama3": [_LLAMA3], "llama-bpe": [_LLAMA3], "llama-v3": [_LLAMA3], "dbrx": [_LLAMA3], "smaug-bpe": [_LLAMA3],
    "qwen2": [_QWEN2], "stablelm2": [_QWEN2],
    # digits one by one first (SmolLM, StarCoder), then GPT-2's regex
    "smollm": [r"\p{N}", _GPT2], "starcoder": [r"\p{N}", _GPT2], "refact": [r"\p{N}", _GPT2],
    "command-r": [r"\p{N}", _GPT2], "codeshell": [r"\p{N}", _GPT2], "exaone": [r"\p{N}", _GPT2],
}  # fmt: skip


def _byte_level(tokens, types, merges, pre: str | None, path):
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    if (pre or "default") not in PRE_SPLITS:
        raise ModelLoadError(f"{path}: GGUF byte-level BPE pre-tokenizer {pre!r} is not supported "
                             f"(supported: {', '.join(sorted(PRE_SPLITS))}); convert from the Hugging Face folder")
    splits = PRE_SPLITS[pre or "default"]
    if splits is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        steps = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in splits]
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [*steps, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def sentencepiece_merges(tokens: list[str], types: list[int], scores: list[float]) -> list[tuple[str, str]]:
    """BPE merges equivalent to SentencePiece's score-driven merging.

    A piece p with score s is reachable by merging any split (l, r) of p with both halves
    in the vocabulary; all such merges get p's priority. Sorted by score, highest first
    (ties: lower id first, as SentencePiece breaks them by position in the model).
    """
    ids = {t: i for i, t in enumerate(tokens) if types[i] in (NORMAL, USER_DEFINED)}
    ranked = []
    for piece, i in ids.items():
        for k in range(1, len(piece)):
            left, right = piece[:k], piece[k:]
            if left in ids and right in ids:
                ranked.append((-scores[i], i, ids[left], ids[right], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _sentencepiece(tokens, types, scores, unk: str | None, add_space_prefix: bool):
    vocab = {tok: i for i, tok in enumerate(tokens)}
    merges = sentencepiece_merges(tokens, types, scores)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    # SentencePiece's own normalization (identity for these models) is not stored; what is:
    # spaces become U+2581 and, unless add_space_prefix is false (Gemma), one is prepended.
    steps = ([normalizers.Prepend(SPACE)] if add_space_prefix else []) + [normalizers.Replace(" ", SPACE)]
    tok.normalizer = normalizers.Sequence(steps)
    dec = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        dec.append(decoders.Strip(content=" ", left=1, right=0))
    tok.decoder = decoders.Sequence(dec)
    return tok


def build_tokenizer(reader, path: Path):
    """Hugging Face `tokenizers` object and tokenizer_config dict from GGUF metadata."""
    kind = _field(reader, "tokenizer.ggml.model")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    if not tokens:
        raise ModelLoadError(f"{path}: GGUF carries no tokenizer")
    types = list(_field(reader, "tokenizer.ggml.token_type") or [NORMAL] * len(tokens))
    if len(types) != len(tokens):
        raise ModelLoadError(f"{path}: GGUF has {len(tokens)} tokens but {len(types)} token types")

    def tok_of(key):
        i = _field(reader, f"tokenizer.ggml.{key}")
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    if kind == "gpt2":
        merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges") or []]
        tok = _byte_level(tokens, types, merges, _field(reader, "tokenizer.ggml.pre"), path)
        add_bos_default = False
        added = [(t, True) for t, ty in zip(tokens, types, strict=True) if ty in (CONTROL, USER_DEFINED)]
    elif kind == "llama":
        scores = _field(reader, "tokenizer.ggml.scores")
        if scores is None or len(scores) != len(tokens):
            raise ModelLoadError(f"{path}: SentencePiece GGUF tokenizer without one score per token")
        space = bool(_field(reader, "tokenizer.ggml.add_space_prefix", True))
        tok = _sentencepiece(tokens, types, [float(s) for s in scores], tok_of("unknown_token_id"), space)
        add_bos_default = True  # llama.cpp's default for SentencePiece vocabularies
        # Control tokens (<s>, </s>, <start_of_turn>) are special; user-defined ones are always
        # cut out of the text as whole pieces (SentencePiece's rule) but decode as text.
        added = [(t, ty == CONTROL) for t, ty in zip(tokens, types, strict=True) if ty in (CONTROL, USER_DEFINED)]
    else:
        raise ModelLoadError(
            f"{path}: GGUF tokenizer model {kind!r} is not supported (supported: 'gpt2' byte-level BPE, "
            "'llama' SentencePiece); convert from the Hugging Face folder instead"
        )
    # Added pieces are cut out of the raw text first; each text fragment between them is then
    # encoded alone (with its own space prefix): llama.cpp's rule for SentencePiece vocabularies.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, s in added if s])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, s in added if not s])
    config = {
        "bos_token": tok_of("bos_token_id"),
        "eos_token": tok_of("eos_token_id"),
        "unk_token": tok_of("unknown_token_id"),
        "pad_token": tok_of("padding_token_id"),
        "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", add_bos_default)),
        "chat_template": _field(reader, "tokenizer.chat_template"),
    }
    eot = _field(reader, "tokenizer.ggml.eot_token_id")
    if eot is not None:
        config["extra_eos_token_ids"] = [int(eot)]
    return tok, config
