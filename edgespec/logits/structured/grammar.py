"""Response formats checked and compiled to llguidance grammars, and the per-tokenizer matcher cache.

`response_format` (the engine API and the server share it) is one of:

- None, or {"type": "text"}: free text;
- {"type": "json_object"}: any JSON object;
- {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}
  (OpenAI's shape), a plain JSON-schema dict, or a Pydantic model class;
- {"type": "regex", "pattern": "..."};
- {"type": "grammar", "grammar": "...", "syntax": "lark" | "gbnf"}.

`parse_response_format` checks it and compiles it to an llguidance grammar
(without a tokenizer: it runs in make_options, before any model is touched);
bad schemas, patterns and grammars raise ValueError naming the problem, and so does a
grammar that accepts no text. Untrusted input is bounded first (bounds.py: size,
nesting, `$ref` chains, rules, alternatives, enums; GrammarLimitError names the limit),
then compiled in a worker process with a time bound (isolated.py), so a native crash or
stall of llguidance never reaches the calling process.
`Grammar.matcher(tokenizer, vocab_size)` gives a fresh matcher for one request:
the compiled matcher is cached per (grammar, tokenizer) and copied (deep_copy),
so a schema is compiled once per tokenizer (first checked in a worker: it compiles for this
tokenizer and its first step allows a token). Why llguidance: docs/structured.md.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import llguidance

import edgespec.logits.structured._worker as _worker
from edgespec.logits.structured._worker import build_ll_tokenizer
from edgespec.logits.structured.bounds import (
    LIMITS,
    GrammarLimitError,
    check_grammar,
    check_regex,
    check_schema,
)
from edgespec.logits.structured.isolated import IsolatedCompiler, on_deep_stack, tokenizer_payload
from edgespec.logits.structured.tokens import token_bytes

# JSON is written the way models usually write it, compact but with a space after ':' and ',':
# fixed separators make keys and punctuation forced (one continuation), which the forced-token
# source turns into drafts that are always accepted.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
KINDS = ("text", "json_object", "json_schema", "regex", "grammar")
JSON_TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")
CACHE_SIZE = 256


class GrammarError(RuntimeError):
    """The grammar matcher failed during generation (fails that request alone; the server
    answers it as the request's error, 400, not as its own failure)."""


def _llg():
    return llguidance


@dataclass(frozen=True)
class Grammar:
    """A response format compiled to llguidance's grammar text (hashable: the cache key)."""

    kind: str  # json_object | json_schema | regex | grammar
    text: str = field(repr=False)  # llguidance grammar (JSON or Lark)
    schema: Any = field(default=None, compare=False, hash=False, repr=False)  # the JSON schema (json kinds)
    name: str | None = field(default=None, compare=False, hash=False)

    def matcher(self, tokenizer, vocab_size: int | None = None):
        """A fresh llguidance LLMatcher for one request (a copy of the cached compiled one)."""
        return _matcher_cache.get(self, tokenizer, vocab_size)


def _schema_of(value) -> dict | None:
    """A Pydantic model class's JSON schema, else None."""
    if isinstance(value, type) and hasattr(value, "model_json_schema"):
        return value.model_json_schema()
    return None


def _json_text(schema: Any, strict: bool) -> str:
    """A JSON schema checked against the bounds, as JSON text."""
    if isinstance(schema, bool) or not isinstance(schema, dict):
        raise ValueError(f"response_format: the JSON schema must be an object (a dict), got {type(schema).__name__}")
    try:
        text = json.dumps(schema)
    except (TypeError, ValueError, RecursionError) as e:
        raise ValueError(f"response_format: the JSON schema is not serialisable as JSON ({e})") from None
    if len(text) > LIMITS.max_bytes:
        raise GrammarLimitError(f"response_format: the JSON schema's size in bytes is {len(text)}, over the limit "
                                f"of {LIMITS.max_bytes} (GrammarLimits.max_bytes)")
    check_schema(schema, strict)
    return text


_compiler = None
_compiler_lock = threading.Lock()


def _isolated():
    global _compiler
    with _compiler_lock:
        if _compiler is None:
            _compiler = IsolatedCompiler(JSON_OPTIONS)
        return _compiler


def _compile(kind: str, source: str) -> str:
    """llguidance grammar text for `source` (bounded already), checked to accept some text:
    in a worker process (LIMITS.isolate), else here on a deep stack."""
    if LIMITS.isolate:
        return _isolated().compile(kind, source)
    def run():
        text = _worker.compile_source(kind, source, JSON_OPTIONS)
        err = _worker.first_step_error(_worker.byte_tokenizer(), text, tokenized=False)
        if err:
            raise ValueError(f"response_format: {err}")
        return text

    return on_deep_stack(run)


@dataclass(frozen=True)
class _Key:
    text: str


_parse_cache: OrderedDict = OrderedDict()
_parse_lock = threading.Lock()


def parse_response_format(rf: Any) -> Grammar | None:
    """Check a response_format and compile it (see the module doc); None for free text."""
    if rf is None:
        return None
    if isinstance(rf, Grammar):
        return rf
    pyd = _schema_of(rf)
    if pyd is not None:
        return _compiled("json_schema", pyd, getattr(rf, "__name__", None))
    if not isinstance(rf, dict):
        raise ValueError(
            "response_format must be None, a dict ({'type': 'json_object'}, {'type': 'json_schema', ...}, "
            "{'type': 'regex', 'pattern': ...}, {'type': 'grammar', 'grammar': ..., 'syntax': 'lark'|'gbnf'}, "
            f"or a JSON schema) or a Pydantic model class, got {type(rf).__name__}"
        )
    kind = rf.get("type")
    if isinstance(kind, str) and kind not in KINDS and kind not in JSON_TYPES:
        raise ValueError(f"response_format type {kind!r} is not supported; use one of {', '.join(KINDS)}, "
                         "or give a JSON schema")
    if kind not in KINDS:  # a plain JSON schema ({"type": "object", ...}, {"anyOf": [...]}, ...)
        return _compiled("json_schema", rf, rf.get("title"), bool(rf.get("strict")))
    if kind == "text":
        return None
    if kind == "json_object":
        return _compiled("json_object", {"type": "object"}, None)
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if isinstance(spec, type):
            spec = {"schema": _schema_of(spec)}
        if not isinstance(spec, dict) or "schema" not in spec:
            raise ValueError("response_format {'type': 'json_schema'} needs 'json_schema': "
                             "{'name': ..., 'schema': {...}}")
        schema = spec["schema"]
        schema = _schema_of(schema) or schema
        return _compiled("json_schema", schema, spec.get("name"), spec.get("strict") is True)
    if kind == "regex":
        pattern = rf.get("pattern", rf.get("regex"))
        if not isinstance(pattern, str) or not pattern:
            raise ValueError("response_format {'type': 'regex'} needs a non-empty 'pattern' string")
        return _compiled("regex", pattern, None)
    grammar = rf.get("grammar")
    syntax = rf.get("syntax", "lark")
    if not isinstance(grammar, str) or not grammar.strip():
        raise ValueError("response_format {'type': 'grammar'} needs a non-empty 'grammar' string")
    if syntax not in ("lark", "gbnf"):
        raise ValueError(f"response_format grammar 'syntax' must be 'lark' or 'gbnf', got {syntax!r}")
    return _compiled("grammar:" + syntax, grammar, None)


def _compiled(kind: str, source: Any, name: str | None, strict: bool = False) -> Grammar:
    if kind in ("json_schema", "json_object"):
        text = _json_text(source, strict)
    elif kind == "regex":
        check_regex(source)
        text = source
    else:
        check_grammar(source, kind.split(":", 1)[1])
        text = source
    key = (kind, text, strict)
    with _parse_lock:
        hit = _parse_cache.get(key)
        if hit is not None:
            _parse_cache.move_to_end(key)
            return hit
    compiled = _compile(kind, text)
    if kind in ("json_schema", "json_object"):
        g = Grammar(kind, compiled, source, name)
    else:
        g = Grammar("regex" if kind == "regex" else "grammar", compiled)
    with _parse_lock:
        _parse_cache[key] = g
        while len(_parse_cache) > CACHE_SIZE:
            _parse_cache.popitem(last=False)
    return g


# ------------------------------------------------------------------ tokenizers and matchers
_tok_lock = threading.Lock()


def ll_tokenizer(tokenizer, vocab_size: int | None = None):
    """llguidance's tokenizer for edgespec's `tokenizer` (built once per tokenizer and size)."""
    with _tok_lock:  # built once even when the first requests arrive together
        return _ll_tokenizer(tokenizer, vocab_size)


def _ll_tokenizer(tokenizer, vocab_size: int | None):
    cache = tokenizer.__dict__.setdefault("_llg_tokenizers", {})
    n = vocab_size if vocab_size is not None else tokenizer.vocab_size
    hit = cache.get(n)
    if hit is not None:
        return hit
    tokens, special = token_bytes(tokenizer, n)
    eos = sorted(tokenizer.eos_token_ids)
    if not eos:
        raise ValueError("constrained decoding needs a tokenizer with an EOS token (it ends the reply "
                         "when the grammar is complete)")
    lt = build_ll_tokenizer(tokens, special, eos, tokenizer.bos_token_id, n,
                            lambda s: tokenizer.encode(s, add_special_tokens=False))
    cache[n] = lt
    return lt


class _MatcherCache:
    """Compiled matchers per (grammar, tokenizer, vocabulary size), least recently used dropped."""

    def __init__(self, size: int = CACHE_SIZE):
        self.size = size
        self._d: OrderedDict = OrderedDict()
        self._lock = threading.Lock()
        self.compiles = 0  # how many compilations ran (tests and the benchmark read it)

    def get(self, grammar: Grammar, tokenizer, vocab_size: int | None):
        key = (grammar, id(tokenizer), vocab_size)
        with self._lock:
            hit = self._d.get(key)
            if hit is not None and hit[0] is tokenizer:
                self._d.move_to_end(key)
                return hit[1].deep_copy()
        lt = ll_tokenizer(tokenizer, vocab_size)
        if LIMITS.isolate:  # proven harmless (and quick) for this tokenizer in a worker first
            n = vocab_size if vocab_size is not None else tokenizer.vocab_size
            _isolated().check(tokenizer_payload(tokenizer, n), grammar.text)
        else:
            err = on_deep_stack(_worker.first_step_error, lt, grammar.text, True)
            if err:
                raise ValueError(f"response_format: {err}")
        m = on_deep_stack(lambda: _llg().LLMatcher(lt, grammar.text, log_level=0, limits=_worker.limits()))
        if m.is_error():
            raise ValueError(f"response_format: the grammar does not compile for this tokenizer: "
                             f"{_worker.short(m.get_error())}")
        with self._lock:
            self.compiles += 1
            self._d[key] = (tokenizer, m)
            while len(self._d) > self.size:
                self._d.popitem(last=False)
        return m.deep_copy()


_matcher_cache = _MatcherCache()


def matcher_cache() -> _MatcherCache:
    return _matcher_cache
