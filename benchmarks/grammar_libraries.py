"""Which grammar library: llguidance vs xgrammar on the default model's tokenizer.

    python benchmarks/grammar_libraries.py [--model PATH]

Both are given the vocabulary as bytes read from edgespec's own tokenizer
(edgespec.logits.structured.tokens: the default model is a GGUF, no HF fast tokenizer
is assumed). For one extraction schema, times: building the library's
tokenizer, compiling the schema, and computing the token mask at every
position of a valid reply (median, mean, max). xgrammar is optional (it pulls
torch and triton); without it only llguidance is measured. The machine may be
shared: the figures are indicative. See docs/structured.md for the choice.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 3},
    "city": {"type": "string"}}, "required": ["name", "age", "tags", "city"], "additionalProperties": False}
REPLY = {"name": "Alice Smith", "age": 42, "tags": ["red", "blue"], "city": "Paris, the capital of France"}


def stats(ts) -> str:
    us = np.array(ts) * 1e6
    return f"median {np.median(us):.1f} us, mean {us.mean():.1f} us, max {us.max():.1f} us"


def main() -> int:
    import edgespec
    from edgespec.logits.structured import JSON_OPTIONS, ll_tokenizer
    from edgespec.logits.structured.tokens import token_bytes

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    args = ap.parse_args()
    engine = edgespec.load(args.model, drafter="none", progress=False, history="off")
    tok, V = engine.tokenizer, engine.model.args.vocab_size
    ids = tok.encode(json.dumps(REPLY), add_special_tokens=False)
    print(f"reply: {len(ids)} tokens, vocabulary {V}")

    import llguidance as llg

    t0 = time.perf_counter()
    lt = ll_tokenizer(tok, V)
    print(f"llguidance {llg.__version__ if hasattr(llg, '__version__') else ''}: tokenizer "
          f"{1e3 * (time.perf_counter() - t0):.0f} ms")
    t0 = time.perf_counter()
    m = llg.LLMatcher(lt, llg.LLMatcher.grammar_from_json_schema(SCHEMA, defaults=dict(JSON_OPTIONS)))
    print(f"  compile {1e3 * (time.perf_counter() - t0):.1f} ms")
    ts = []
    for t in ids:
        t0 = time.perf_counter()
        m.compute_bitmask()
        ts.append(time.perf_counter() - t0)
        assert m.consume_token(t), m.get_error()
    print("  mask", stats(ts))
    try:
        import xgrammar as xgr
    except ImportError:
        print("xgrammar: not installed (pip install xgrammar) - skipped")
        return 0
    tb, _ = token_bytes(tok, V)
    t0 = time.perf_counter()
    info = xgr.TokenizerInfo(tb, xgr.VocabType.RAW, vocab_size=V, stop_token_ids=sorted(tok.eos_token_ids))
    comp = xgr.GrammarCompiler(info)
    print(f"xgrammar: tokenizer {1e3 * (time.perf_counter() - t0):.0f} ms")
    t0 = time.perf_counter()
    cg = comp.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False, separators=(", ", ": "))
    print(f"  compile {1e3 * (time.perf_counter() - t0):.1f} ms")
    mt = xgr.GrammarMatcher(cg)
    bm = xgr.allocate_token_bitmask(1, V)
    ts = []
    for t in ids:
        t0 = time.perf_counter()
        mt.fill_next_token_bitmask(bm)
        ts.append(time.perf_counter() - t0)
        assert mt.accept_token(t)
    print("  mask", stats(ts))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
