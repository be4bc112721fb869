"""Side by side in one run: plain, speculative (fixed K and controller), mlx-lm speculative.

Same verifier and drafter for every method: the default model as a dense fp32
bundle and the best drafter available (a shipped distilled drafter, else
self-speculation with the searched skip set). Methods run interleaved per prompt
so load drift hits them alike. Greedy; every method's tokens are checked against
plain decoding.

    export LD_PRELOAD=$(make -s preload)
    python benchmarks/speculative.py --per-domain 2 --max-tokens 64 --k 1,2,4
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import mlx.core as mx

REPO = Path(__file__).resolve().parents[1]
DOMAINS = ("code", "chat", "summarization", "translation")


def load_prompts(per_domain: int) -> list[dict]:
    rows = [json.loads(x) for x in (REPO / "edgespec" / "data" / "bench_prompts.jsonl").read_text().splitlines() if x.strip()]
    out = []
    for d in DOMAINS:
        out += [r for r in rows if r.get("domain") == d][:per_domain]
    return out


def mlx_lm_pair(engine, drafter):
    """mlx-lm models for the verifier and (when it is a layer subset) the self-spec drafter."""
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama as lm_llama

    cfg = json.loads((Path(engine.loaded.path) / "config.json").read_text())
    weights = dict(tree_flatten(engine.model.parameters()))
    verifier = lm_llama.Model(lm_llama.ModelArgs.from_dict(cfg))
    verifier.load_weights(list(weights.items()), strict=True)
    keep = getattr(drafter, "layer_ids", None)
    if keep is None and hasattr(drafter, "model"):
        dm = drafter.model  # a standalone MLX drafter
        dcfg = dict(cfg, **dm.args.to_dict())
        draft = lm_llama.Model(lm_llama.ModelArgs.from_dict(dcfg))
        draft.load_weights(list(tree_flatten(dm.parameters())), strict=True)
        return verifier, draft
    if keep is None:
        return verifier, None
    # Self-spec as a standalone model: the kept layers renumbered 0..len(keep)-1 (weights shared).
    dcfg = dict(cfg, num_hidden_layers=len(keep))
    dweights = {}
    for name, w in weights.items():
        if name.startswith("model.layers."):
            i, rest = name[len("model.layers.") :].split(".", 1)
            if int(i) in keep:
                dweights[f"model.layers.{keep.index(int(i))}.{rest}"] = w
        else:
            dweights[name] = w
    draft = lm_llama.Model(lm_llama.ModelArgs.from_dict(dcfg))
    draft.load_weights(list(dweights.items()), strict=True)
    return verifier, draft


def run_mlx_lm(verifier, draft, tokenizer, ids, max_tokens, k):
    gen = importlib.import_module("mlx_lm.generate")
    tokens, from_draft, tps = [], 0, 0.0
    for r in gen.stream_generate(verifier, tokenizer, ids, max_tokens=max_tokens + 1, draft_model=draft, num_draft_tokens=k):
        tokens.append(int(r.token))
        from_draft += int(bool(r.from_draft))
        tps = r.generation_tps
        if len(tokens) >= max_tokens:
            break
    return tokens[:max_tokens], tps, from_draft


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="bundle (default: the default model, dense fp32 on CPU)")
    ap.add_argument("--drafter", default=None, help="drafter spec (default: shipped distilled, else 'self')")
    ap.add_argument("--keep-layers", default=None, help="self-speculation with these layers (comma-separated), no search")
    ap.add_argument("--per-domain", type=int, default=2, help="prompts per domain (code, chat, summarization, translation)")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens generated per prompt")
    ap.add_argument("--k", default="1,2,4", help="comma-separated fixed K values to run")
    ap.add_argument(
        "--pipeline",
        choices=["on", "off", "both"],
        default="both",
        help="pipelined drafting for the speculative runs; 'both' adds pipelined runs of the first K",
    )
    ap.add_argument("--no-mlx-lm", action="store_true", help="skip mlx-lm's speculative generation")
    ap.add_argument("--out", default=str(REPO / "bench-out" / "speculative.json"), help="JSON results path")
    args = ap.parse_args(argv)

    from edgespec.converters.default_model import default_bundle_path

    import edgespec
    from edgespec.drafters import attach_drafter, shipped_drafter_path

    bundle = args.model or default_bundle_path(progress=True)
    engine = edgespec.load(bundle, drafter="none", progress=False)
    spec = args.drafter or (str(shipped_drafter_path(engine)) if shipped_drafter_path(engine) else "self")
    t0 = time.perf_counter()
    if args.keep_layers:
        from edgespec.drafters.self_spec import SelfSpecDrafter

        spec = "self (--keep-layers)"
        engine.drafter = SelfSpecDrafter(engine.model, [int(i) for i in args.keep_layers.split(",")])
        drafter = engine.drafter
    else:
        drafter = attach_drafter(engine, spec)
    print(f"drafter {drafter.name} ({spec}) ready in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    ks = [int(k) for k in args.k.split(",") if k]
    pipe = args.pipeline == "on"
    methods = ["plain"] + [f"spec K={k}" for k in ks] + ["spec auto"]
    if args.pipeline == "both":
        methods += [f"spec K={ks[0]} pipe"]
    lm = None
    if not args.no_mlx_lm:
        from mlx_lm.tokenizer_utils import TokenizerWrapper
        from transformers import PreTrainedTokenizerFast

        hf_tok = PreTrainedTokenizerFast(tokenizer_file=str(Path(bundle) / "tokenizer.json"))
        lm_tok = TokenizerWrapper(hf_tok, eos_token_ids=set(engine.tokenizer.eos_token_ids))
        lm_v, lm_d = mlx_lm_pair(engine, drafter)
        lm = (lm_v, lm_d, lm_tok)
        methods += [f"mlx-lm K={k}" for k in ks]

    prompts = load_prompts(args.per_domain)
    warm = engine.tokenizer.encode_chat([{"role": "user", "content": "Hello!"}])
    engine.generate(warm, max_tokens=8, mode="speculative", draft_tokens="auto")  # calibrates the controller
    rows = []
    for pr in prompts:
        ids = engine.tokenizer.encode_chat([{"role": "user", "content": pr["prompt"]}])
        ref = None
        for m in methods:
            if m.startswith("mlx-lm"):
                k = int(m.split("=")[1])
                toks, tps, fd = run_mlx_lm(lm[0], lm[1], lm[2], ids, args.max_tokens, k)
                row = dict(tokens_per_s=tps, accepted=fd, drafted=None, passes=None, n=len(toks))
            else:
                kw = dict(mode="plain") if m == "plain" else dict(mode="speculative", pipeline=pipe or m.endswith("pipe"))
                if m.startswith("spec"):
                    kw["draft_tokens"] = "auto" if m.endswith("auto") else int(m.split("=")[1].split()[0])
                res = engine.generate(ids, max_tokens=args.max_tokens, **kw)
                st = res.stats
                toks = res.tokens
                row = dict(
                    tokens_per_s=st.tokens_per_s,
                    accepted=st.accepted,
                    drafted=st.drafted,
                    passes=st.verifier_passes,
                    n=st.generated_tokens,
                    hidden_s=st.hidden_draft_s,
                    notes=st.notes,
                )
            if m == "plain":
                ref = toks
            n = min(len(ref), len(toks))
            row.update(method=m, id=pr["id"], domain=pr["domain"], same_as_plain=toks[:n] == ref[:n])
            rows.append(row)
            print(f"{pr['id']:<16} {m:<12} {row['tokens_per_s']:7.1f} tok/s  same={row['same_as_plain']}", file=sys.stderr)

    # ---- table
    agg = defaultdict(lambda: defaultdict(float))
    for r in rows:
        a = agg[r["method"]]
        a["tps"] += r["tokens_per_s"]
        a["count"] += 1
        a["acc"] += r["accepted"] or 0
        a["drafted"] += r["drafted"] or 0
        a["passes"] += r["passes"] or 0
        a["n"] += r["n"]
        a["same"] += r["same_as_plain"]
    plain_tps = agg["plain"]["tps"] / agg["plain"]["count"]
    lines = [f"{'method':<12} {'tok/s':>7} {'vs plain':>8} {'accept':>7} {'tok/pass':>8} {'exact':>6}"]
    for m in methods:
        a = agg[m]
        tps = a["tps"] / a["count"]
        acc = f"{a['acc'] / a['drafted']:.1%}" if a["drafted"] else ("-" if not m.startswith("mlx") else f"{a['acc'] / a['n']:.0%}*")
        tpp = f"{a['n'] / a['passes']:.2f}" if a["passes"] else "-"
        lines.append(f"{m:<12} {tps:7.1f} {tps / plain_tps:7.2f}x {acc:>7} {tpp:>8} {int(a['same'])}/{int(a['count'])}")
    lines.append("(* mlx-lm: share of output tokens that came from the draft)")
    lines.append("")
    lines.append("acceptance per domain (" + ", ".join(m for m in methods if m.startswith("spec K") and not m.endswith("pipe")) + ")")
    for d in DOMAINS:
        cells = []
        for m in methods:
            if not m.startswith("spec K") or m.endswith("pipe"):
                continue
            sel = [r for r in rows if r["method"] == m and r["domain"] == d]
            dr = sum(r["drafted"] for r in sel)
            cells.append(f"{sum(r['accepted'] for r in sel) / dr:.1%}" if dr else "-")
        lines.append(f"  {d:<14} " + "  ".join(cells))
    table = "\n".join(lines)
    print(table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = dict(
        model=str(bundle),
        drafter=drafter.name,
        keep_layers=getattr(drafter, "layer_ids", None),
        max_tokens=args.max_tokens,
        pipeline=pipe,
        device=str(mx.default_device()),
        costs=getattr(engine, "_speculative_costs", {}) and {
            str(k): dict(verify_s=v.verify_s, draft_s=v.draft_s) for k, v in engine._speculative_costs.items()
        },
    )
    out.write_text(json.dumps(dict(meta=meta, rows=rows, table=table), indent=1, default=str))
    print(f"saved {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
