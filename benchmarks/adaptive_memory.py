"""Peak memory of auto (adaptive decoder, history store on) vs plain at a 2k-token context.

    python benchmarks/adaptive_memory.py [--model PATH] [--context 2048] [--max-tokens 64]

Loads the model without a drafter (the comparison the brief asks for: the
weight-free sources and the history store against plain decoding), fills the
history store with the replies to the repetitive JSON prompts, then generates
from one prompt of about `--context` tokens with plain and with auto. Reports
MLX's peak memory of each generation (weights, KV cache, activations), the
history store's own size (host memory, counted by the store), and
(auto peak + store) / plain peak.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> int:
    import edgespec

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="bundle/GGUF (default: the default model)")
    ap.add_argument("--context", type=int, default=2048, help="prompt length in tokens")
    ap.add_argument("--max-tokens", type=int, default=64, help="reply length")
    args = ap.parse_args()

    engine = edgespec.load(args.model, drafter="none", progress=False, history="memory")
    rows = [json.loads(x) for x in (HERE / "prompts" / "mixed.jsonl").read_text().splitlines() if x.strip()]
    for r in (json.loads(x) for x in (HERE / "prompts" / "repetitive_json.jsonl").read_text().splitlines() if x.strip()):
        engine.generate(messages=[{"role": "user", "content": r["prompt"]}], max_tokens=64)
    # A long retrieval-style prompt: documents of the mixed set until the context is reached.
    docs = [r["prompt"] for r in rows if r.get("domain") == "rag"]
    text, i = "", 0
    while len(engine.tokenizer.encode(text)) < args.context - 64:
        text += docs[i % len(docs)] + "\n\n"
        i += 1
    ids = engine.tokenizer.encode(text)[: args.context - 32]
    ids += engine.tokenizer.encode("\nQuestion: what are the steps? Quote them.\nAnswer:")
    out = {}
    for mode in ("plain", "auto", "plain", "auto"):  # twice: the second pair is reported (warm)
        r = engine.generate(ids, max_tokens=args.max_tokens, mode=mode)
        out[mode] = (r.stats.peak_memory_bytes, r.stats.tokens_per_s, r.tokens)
    mib = 2**20
    store = engine.history.nbytes
    plain_peak, auto_peak = out["plain"][0], out["auto"][0]
    print(f"context {len(ids)} tokens, reply {args.max_tokens} tokens, no drafter")
    print(f"plain: MLX peak {plain_peak / mib:.1f} MiB, {out['plain'][1]:.1f} tok/s")
    print(f"auto:  MLX peak {auto_peak / mib:.1f} MiB, {out['auto'][1]:.1f} tok/s; history store "
          f"{engine.history.documents} documents, {store / mib:.2f} MiB (cap {engine.history.max_bytes / mib:.0f} MiB)")
    print(f"(auto peak + store) / plain peak = {(auto_peak + store) / plain_peak:.3f}; "
          f"same tokens: {out['plain'][2] == out['auto'][2]}")
    return 0 if out["plain"][2] == out["auto"][2] else 1


if __name__ == "__main__":
    sys.exit(main())
