"""Structured output: response formats compiled to grammars (llguidance), cached.

    grammar.py    response formats checked and compiled (parse_response_format, Grammar),
                  llguidance tokenizers, the compiled-matcher cache, GrammarError
    bounds.py     bounds on grammars checked before llguidance sees them (LIMITS)
    isolated.py   compilation in worker processes with a time bound
    _worker.py    the worker process (started by file path)
    tokens.py     the bytes of each token from edgespec's tokenizer

The public names are re-exported here; the response formats accepted: grammar.py's doc.
Why llguidance: docs/structured.md.
"""

from edgespec.logits.structured.bounds import LIMITS, GrammarLimitError, GrammarLimits
from edgespec.logits.structured.grammar import (
    CACHE_SIZE,
    JSON_OPTIONS,
    KINDS,
    Grammar,
    GrammarError,
    ll_tokenizer,
    matcher_cache,
    parse_response_format,
)

__all__ = ["CACHE_SIZE", "JSON_OPTIONS", "KINDS", "LIMITS", "Grammar", "GrammarError", "GrammarLimitError",
           "GrammarLimits", "ll_tokenizer", "matcher_cache", "parse_response_format"]
