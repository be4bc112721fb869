"""Drafting while verifying in `auto`: the device model's table, and this host's side by side.

    python benchmarks/pipelined.py [--rounds 60] [--scale 1] [--json out.json]
    python benchmarks/pipelined.py --host [--model PATH] [--per-domain 2] [--max-tokens 96] [--repeats 2]

Device model (the default). A tiny random verifier and its int8 drafter (the MLX one where the
int8 kernel cannot be built), both through edgespec.drafters.remote: every verifier pass lasts
`base + per_token * T` and every draft call `per_token * k` of wall time, waiting in sleeps
(no core busy), so the figures say what overlap is worth for those costs on any host, busy or
not. Three cost ratios: a Mac-like one (the pass nearly flat in width, the drafter on its own
unit), one where drafter and verifier share a CPU (each runs 2x slower beside the other), and a
slow drafter on its own unit. For each, `auto` with a chain of k = 4 every round, drafted
synchronously, drafted ahead, and drafted ahead from the runner-up premise as well, then `auto`
as the planner runs it: wall time per round
against the sum and the max of a pass and a draft alone, and the planner's choice (the share of
its drafting rounds it drafted ahead, and the slowdowns it measured). Every output is compared
with plain decoding's.

--host: this machine's default model (or --model) on the mixed prompt set, `plain`, `auto`
(drafting ahead allowed) and `auto:pipeline=false`, interleaved per prompt
(edgespec.benchmark.runner): tokens/s ratios and what the planner measured and chose.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

RATIOS = [
    # name, verify base s, verify s per token, draft s per token, contention factor (set well above
    # the tiny model's own compute, so that the sleeps, not a busy host, set the times)
    ("mac-like (flat pass, drafter apart)", 0.060, 0.0003, 0.0045, 1.0),
    ("one CPU shared (2x each)", 0.030, 0.0015, 0.0075, 2.0),
    ("slow drafter apart", 0.015, 0.0006, 0.009, 1.0),
]
K = 4


def tiny_engine(ratio, drafter: str = "int8"):
    """The device-model engine of one cost ratio (a tiny random Llama, peaky like a real one);
    drafter "int8" (its own weights in int8: agrees nearly always) or "model" (a smaller random
    model: seldom agrees, so premises fail and runner-ups matter)."""
    import mlx.core as mx
    from edgespec.models.llama import Model, ModelArgs
    from mlx.utils import tree_map
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, pre_tokenizers
    from tokenizers import models as tk_models

    from edgespec.drafters.base import ModelDrafter
    from edgespec.drafters.remote import Contention, PacedVerifier, RemoteDrafter
    from edgespec.engine import Engine
    from edgespec.kernels import q8
    from edgespec.tokenizer import Tokenizer
    from edgespec.weights.loader import LoadedModel

    mx.random.seed(0)
    config = dict(
        model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=64, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True,
        max_position_embeddings=4096)
    model = Model(ModelArgs.from_dict(config))
    model.update(tree_map(lambda w: w * 3.0 if w.ndim > 1 else w, model.parameters()))
    mx.eval(model.parameters())
    vocab = {"</s>": 0}
    for i in range(1, 64):
        vocab[chr(0x4E00 + i)] = i
    backend = HFTokenizer(tk_models.WordLevel(vocab=vocab, unk_token="</s>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    backend.decoder = decoders.Fuse()
    _, base, per_tok, draft_tok, factor = ratio
    cont = Contention(factor)
    eng = Engine(LoadedModel(PacedVerifier(model, base, per_tok, cont), Tokenizer(backend, {"eos_token": "</s>"}),
                             None), history="off")
    if drafter == "model":
        mx.random.seed(5)
        small = Model(ModelArgs.from_dict({**config, "num_hidden_layers": 1}))
        small.update(tree_map(lambda w: w * 3.0 if w.ndim > 1 else w, small.parameters()))
        mx.eval(small.parameters())
        inner = ModelDrafter(small)
    elif q8.library() is not None:
        from edgespec.drafters.quantized import QuantizedDrafter, quantize_model

        inner = QuantizedDrafter(model, quantize_model(model))
    else:
        inner = ModelDrafter(model)
    eng.drafter = RemoteDrafter(inner, 0.0, draft_tok, cont)
    return eng


def device_table(args) -> list[dict]:
    from edgespec.adaptive.policy import Policy, TimedPolicy

    class Fixed(Policy):
        def __init__(self, ahead, runner_up=False):
            super().__init__()
            self.ahead, self.runner = ahead, runner_up

        def choose(self, kind, default, **ctx):
            if kind == "plan" and ctx["can_draft"]:
                return ("tree", K)
            if kind == "pipeline":
                return self.ahead
            if kind == "runner_up":
                return self.runner
            return default

    class Planner(TimedPolicy):
        def pipeline(self, default):
            self.decisions.append(("pipeline", default))
            return default

        def runner_up(self, default):
            self.decisions.append(("runner_up", default))
            return default

    import random

    rows = []
    for ratio in RATIOS:
        ratio = (ratio[0], *(x * args.scale for x in ratio[1:4]), ratio[4])
        r = random.Random(1)
        prompts = [[r.randrange(1, 64) for _ in range(r.randrange(3, 9))] * 2 for _ in range(3)]
        # a round's pass (K + 1 positions), its draft synchronously (K) and ahead (K + the guess)
        row = {"ratio": ratio[0], "verify_ms": 1000 * (ratio[1] + ratio[2] * (K + 1)),
               "draft_ms": 1000 * ratio[3] * K, "draft_ahead_ms": 1000 * ratio[3] * (K + 1),
               "contention": ratio[4]}
        row["sum_ms"] = row["verify_ms"] + row["draft_ms"]
        row["max_ms"] = max(row["verify_ms"], row["draft_ahead_ms"])
        equal = True
        runs = (("sync", Fixed(False)), ("ahead", Fixed(True)), ("runner", Fixed(True, True)), ("planner", Planner()))
        for label, policy in runs:
            eng = tiny_engine(ratio, args.drafter)  # a fresh engine: each learns alone (the planner its slowdowns)
            eng.policy = policy
            passes = tokens = 0
            secs = 0.0
            for p in prompts:
                want = None
                if label == "sync":
                    eng.policy = None
                    want = eng.generate(p, max_tokens=args.rounds, mode="plain").tokens
                    eng.policy = policy
                t0 = time.perf_counter()
                got = eng.generate(p, max_tokens=args.rounds, mode="auto")
                secs += time.perf_counter() - t0 - got.stats.prefill_s
                passes += got.stats.verifier_passes
                tokens += len(got.tokens)
                if want is not None:
                    equal = equal and want == got.tokens
                else:
                    eng.policy = None
                    equal = equal and eng.generate(p, max_tokens=args.rounds, mode="plain").tokens == got.tokens
                    eng.policy = policy
            row[f"{label}_ms_per_round"] = 1000 * secs / max(passes, 1)
            row[f"{label}_tok_s"] = tokens / secs if secs else 0.0
            mem = [m for m in eng.memory.adaptive.values() if "overlap" in m]
            if label == "runner" and mem:
                row["runner_ups"] = mem[0]["overlap"].describe()["runner_ups"]
            if label == "planner":
                picks = [d[1] for d in policy.decisions if d[0] == "pipeline"]
                row["planner_ahead_share"] = (sum(picks) / len(picks)) if picks else None
                ru = [d[1] for d in policy.decisions if d[0] == "runner_up"]
                row["planner_runner_up_share"] = (sum(ru) / len(ru)) if ru else None
                row["planner_measured"] = mem[0]["overlap"].describe() if mem else None
        eng.policy = None
        row["equal_to_plain"] = equal
        rows.append(row)
        pick = row["planner_ahead_share"]
        print(f"{row['ratio']}: pass {row['verify_ms']:.1f} ms, draft {row['draft_ms']:.1f} ms "
              f"({row['draft_ahead_ms']:.1f} ahead) "
              f"(sum {row['sum_ms']:.1f}, max {row['max_ms']:.1f}); per round sync {row['sync_ms_per_round']:.1f}, "
              f"ahead {row['ahead_ms_per_round']:.1f}, ahead + runner-up {row['runner_ms_per_round']:.1f}, "
              f"planner {row['planner_ms_per_round']:.1f} ms; tok/s "
              f"sync {row['sync_tok_s']:.0f}, ahead {row['ahead_tok_s']:.0f}, runner-up {row['runner_tok_s']:.0f} "
              f"(runner-up premises {row.get('runner_ups')}), planner {row['planner_tok_s']:.0f}; "
              f"planner drafted ahead in {'-' if pick is None else f'{100 * pick:.0f}%'} of its drafting rounds, "
              f"from a runner-up too in {_pct(row['planner_runner_up_share'])} of those with one "
              f"(measured {row['planner_measured']}); "
              f"equal to plain: {equal}", flush=True)
    return rows


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def host_side_by_side(args) -> dict:
    import edgespec
    from edgespec.benchmark import build_report, load_prompts, select_prompts
    from edgespec.benchmark.runner import run_benchmark
    from edgespec.benchmark.specs import parse_mode_specs
    from edgespec.modes import available_modes

    prompts = select_prompts(load_prompts(args.prompts), per_domain=args.per_domain)
    specs = parse_mode_specs("plain,auto,auto:pipeline=false", list(available_modes()) + ["auto"])
    engine = edgespec.load(args.model, progress=True)
    run = run_benchmark(engine, prompts, specs, max_tokens=args.max_tokens, repeats=args.repeats)
    rep = build_report(run, {"loadavg_1m": os.getloadavg()[0]})
    res = rep["results"]
    a = res.get("auto", {}).get("all", {})
    b = res.get("auto:pipeline=false", {}).get("all", {})
    over = [m["overlap"].describe() for m in engine.memory.adaptive.values() if "overlap" in m]
    drafter = getattr(engine.auto_drafter or engine.drafter, "name", None)
    out = {"drafter": drafter, "auto_tok_s": a.get("tokens_per_s"), "auto_no_pipeline_tok_s": b.get("tokens_per_s"),
           "auto_speedup": a.get("speedup"), "auto_no_pipeline_speedup": b.get("speedup"),
           "equal_to_plain": {k: rep["status"].get(k) for k in ("auto", "auto:pipeline=false")},
           "overlap": over, "loadavg_1m": rep.get("meta", {}).get("loadavg_1m", os.getloadavg()[0])}
    ratio = (a.get("tokens_per_s") or 0) / (b.get("tokens_per_s") or 1)
    print(f"drafter {drafter}: auto {a.get('speedup')}x plain, auto:pipeline=false {b.get('speedup')}x plain; "
          f"allowed/forbidden {ratio:.3f}; planner measured {over}; equal to plain: {out['equal_to_plain']}")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=60, help="tokens generated per prompt (device model)")
    ap.add_argument("--scale", type=float, default=1.0,
                    help="multiply the device model's latencies (a busy host: larger, so the sleeps still dominate)")
    ap.add_argument("--drafter", choices=["int8", "model"], default="int8",
                    help="device model's drafter: the verifier in int8 (agrees nearly always) or a smaller "
                         "random model (seldom agrees: premises fail, runner-ups matter)")
    ap.add_argument("--host", action="store_true", help="this host's model on the mixed set instead")
    ap.add_argument("--model", default=None, help="with --host: bundle, HF folder or GGUF (default model)")
    ap.add_argument("--prompts", default=None, help="with --host: a JSONL prompt set (default: the built-in one)")
    ap.add_argument("--per-domain", type=int, default=2, help="with --host: prompts per domain")
    ap.add_argument("--max-tokens", type=int, default=96, help="with --host: tokens generated per prompt")
    ap.add_argument("--repeats", type=int, default=2, help="with --host: measured repeats per prompt and mode")
    ap.add_argument("--json", default=None, help="also write the results to this file")
    args = ap.parse_args()
    if args.rounds < 1 or args.per_domain < 1 or args.max_tokens < 1 or args.repeats < 1 or args.scale <= 0:
        ap.error("--rounds, --per-domain, --max-tokens and --repeats must be >= 1, --scale > 0")
    out = host_side_by_side(args) if args.host else device_table(args)
    if args.json:  # atomic: a temporary file beside it, then renamed
        tmp = f"{args.json}.tmp-{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(out, f, indent=1, default=str)
        os.replace(tmp, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
