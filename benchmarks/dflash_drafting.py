"""DFlash drafting cost on random-weight checkpoints: one block against one verifier step, in one run.

A random Llama-layout verifier (--layers, --hidden) and a random DFlash drafter (--draft-layers,
--block, 4 target layers) paired through edgespec's loader. Timed side by side (median of --reps,
after a warm-up), all relative to one plain verifier step at --context tokens of context:
  - a verifier pass over a block of --block tokens (what verifying a whole DFlash block costs);
  - edgespec's DFlash drafter filling one block (its context cache holding the context, one new
    row fed, as in a round), logits through the verifier's head included;
  - the `dflash` package's PyTorch reference filling the same block (context passed whole, no
    cache: its cached path needs a transformers cache API); torch on the CPU, so the ratio says
    how the two implementations compare on this machine, not what either costs on a GPU.
  - the `dflash` package's MLX path (dflash/model_mlx.py, needs mlx-lm) on the same weights and
    states, cached context as in its own loop (its block logits' difference from edgespec's shown).

    python benchmarks/dflash_drafting.py [--layers 16] [--hidden 512] [--draft-layers 2] [--block 16]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def timed(fn, reps: int) -> float:
    fn()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=16, help="verifier layers")
    ap.add_argument("--hidden", type=int, default=512, help="hidden size of both")
    ap.add_argument("--vocab", type=int, default=8192, help="vocabulary size")
    ap.add_argument("--draft-layers", type=int, default=2, help="drafter layers")
    ap.add_argument("--block", type=int, default=16, help="block size")
    ap.add_argument("--context", type=int, default=256, help="tokens of context")
    ap.add_argument("--reps", type=int, default=20, help="timed repetitions (median)")
    args = ap.parse_args()

    import mlx.core as mx
    import numpy as np
    from conftest import write_tiny_hf_folder
    from test_dflash import dflash_config

    import edgespec

    E, L = args.hidden, args.layers
    heads = max(E // 64, 1)
    targets = [round(1 + i * (L - 4) / 3) for i in range(4)]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        vf = write_tiny_hf_folder(tmp / "v", seed=0, hidden_size=E, num_hidden_layers=L, intermediate_size=3 * E,
                                  num_attention_heads=heads, num_key_value_heads=max(heads // 2, 1),
                                  vocab_size=args.vocab, tie_word_embeddings=False)
        cfg = dflash_config(E, "dflash", targets, args.block, mask=args.vocab - 1, layers=args.draft_layers,
                            vocab=args.vocab, num_attention_heads=heads, num_key_value_heads=max(heads // 2, 1),
                            head_dim=64, intermediate_size=3 * E, num_target_layers=L)
        df = tmp / "d"
        df.mkdir()
        from edgespec.models.dflash import Model, ModelArgs
        from mlx.utils import tree_flatten

        mx.random.seed(1)
        dm = Model(ModelArgs.from_dict(cfg))
        mx.save_safetensors(str(df / "model.safetensors"), dict(tree_flatten(dm.parameters())))
        (df / "config.json").write_text(json.dumps(cfg))
        engine = edgespec.load(vf, drafter=df, progress=False, history="off")
        model, d = engine.model, engine.drafter.fork()
        ids = [int(t) for t in np.random.RandomState(0).randint(1, args.vocab - 1, size=args.context)]
        cache = model.make_cache()
        d.bind_verifier_cache(cache)
        mx.eval(model(mx.array([ids]), cache))
        feats = cache[d.tap].hidden[:, : args.context]
        one, block = mx.array([[ids[-1]]]), mx.array([ids[-args.block :]])

        def step():
            mx.eval(model(one, cache))
            for c in cache:
                c.trim(1)

        def verify():
            mx.eval(model(block, cache))
            for c in cache:
                c.trim(args.block)

        d.begin(ids)
        d._trim_to(0)
        mx.eval(d.block(ids[-1], feats[:, :-1]))

        def draft():
            d._trim_to(args.context - 2)
            mx.eval(d.logits(d.block(ids[-1], feats[:, -2:-1])))

        t_step = timed(step, args.reps)
        rows = {"verifier step (1 token)": t_step, f"verifier pass ({args.block} tokens)": timed(verify, args.reps),
                f"edgespec DFlash block ({args.block} slots)": timed(draft, args.reps)}
        try:
            import torch
            from dflash.model import DFlashDraftModel
            from transformers.models.qwen3.modeling_qwen3 import Qwen3Config

            torch.set_num_threads(max(torch.get_num_threads(), 1))
            ref = DFlashDraftModel(Qwen3Config(**cfg)).eval()
            th = torch.tensor(np.array(feats[0, :-1].astype(mx.float32)))[None]
            head = torch.nn.Linear(E, args.vocab, bias=False)
            emb = torch.randn(1, args.block, E)
            pos = torch.arange(th.shape[1] + args.block)[None]

            def ref_draft():
                with torch.no_grad():
                    ref.compute_logits(ref(target_hidden=th, noise_embedding=emb, position_ids=pos)[:, 1:], head)

            rows[f"dflash package PyTorch block ({args.block} slots, whole context)"] = timed(ref_draft, args.reps)
        except ImportError as e:
            rows[f"dflash package PyTorch: not run ({e})"] = None
        try:
            import dflash.model_mlx as ref_mlx

            ref_mlx.snapshot_download = lambda *a, **k: str(df)  # the folder is local: no download
            rd = ref_mlx.load_draft("local").bind(model)
            rcache = rd.make_cache()
            rblock = mx.array([[ids[-1]] + [args.vocab - 1] * (args.block - 1)])
            mx.eval(rd(rblock, feats[:, :-2], rcache, logits_start=1))  # context fed once, as a round would

            def ref_mlx_draft():
                out = rd(rblock, feats[:, -2:-1], rcache, logits_start=1)
                mx.eval(out)
                ref_mlx._trim_recent_cache(rcache, 1)
                return out

            want = ref_mlx_draft()
            d._trim_to(args.context - 2)
            got = d.logits(d.block(ids[-1], feats[:, -2:-1]))
            diff = float(mx.abs(got - want[0]).max() / mx.abs(want).max())
            rows[f"dflash package MLX block ({args.block} slots, cached context; rel. diff {diff:.1e})"] = timed(
                ref_mlx_draft, args.reps)
        except ImportError as e:
            rows[f"dflash package MLX path: not run ({e})"] = None
        try:
            import dflash_mlx  # noqa: F401
        except ImportError:
            rows["dflash-mlx: not run (not installed)"] = None
        print(f"verifier: {L} layers, hidden {E}, vocab {args.vocab}; drafter: {args.draft_layers} layers, "
              f"block {args.block}, targets {targets}; context {args.context}; device {mx.default_device()}")
        for name, t in rows.items():
            print(f"  {name:70s} " + ("-" if t is None else f"{t * 1e3:8.2f} ms  {t / t_step:5.2f}x step"))


if __name__ == "__main__":
    main()
