"""`edgespec distill`: train a small drafter that imitates a verifier."""

from __future__ import annotations

import sys

HELP = "train a small drafter for a verifier by distillation (KL to its top-k)"
DESCRIPTION = (
    "Run the verifier over prompts (built-in code/chat/summarization/translation set, or --data), "
    "record its greedy continuations and top-k log-probs, and train a small Llama-style drafter "
    "with a reduced output vocabulary to match them. Long stages show progress and ETA, "
    "checkpoint into a work folder (--resume continues), and the drafter folder (config.json, "
    "model.safetensors, vocab_map.json, MODEL_CARD.md) is written atomically at the end."
)


def _int_list(s: str) -> list[int]:
    try:
        return [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--init-layers takes comma-separated layer indices, got {s!r}") from None


def add_arguments(p) -> None:
    p.add_argument("--verifier", default=None, help="verifier bundle / HF folder / GGUF, or a hub name ORG/NAME[:QUANT] "
                   "(fetched once; default: the default model)")
    p.add_argument("--out", required=True, help="drafter folder to write")
    p.add_argument("--data", default=None, help="your prompts: JSONL with 'prompt' (answered by the verifier) or "
                   "'text' (scored as is) per line, optional 'domain'; or .txt, one prompt per line "
                   "(default: the built-in varied prompt set)")
    p.add_argument("--heldout", default=None, help="held-out prompts for the acceptance measurement (same format; "
                   "default: the built-in held-out set)")
    p.add_argument("--kind", choices=("student", "feature"), default="student",
                   help="student: an independent small model with its own embedding (drafts in every mode); "
                   "feature: EAGLE-style layers that read the verifier's hidden states and reuse its embedding "
                   "and head (cheaper per draft step; drafts in mode 'speculative' only; for SmolLM2-135M it "
                   "accepted less than the student at the same training budget, see docs/distill.md)")
    p.add_argument("--unroll", type=int, default=2, help="feature drafters: draft steps simulated per training "
                   "position (step s reads the guesses of step s-1, as at draft time)")
    p.add_argument("--reg-weight", type=float, default=0.2, help="feature drafters: weight of the smooth-L1 "
                   "loss to the verifier's next feature, next to the cross-entropy")
    p.add_argument("--layers", type=int, default=2, help="drafter decoder layers")
    p.add_argument("--hidden", type=int, default=None, help="drafter width (default: the verifier's, so its "
                   "weights can be copied; another width starts from random weights)")
    p.add_argument("--init-layers", type=_int_list, default=None, help="verifier layers to copy into the drafter's, "
                   "comma-separated (default: the first ones)")
    p.add_argument("--vocab", type=int, default=8192, help="reduced output vocabulary size (slot 0 = other tokens)")
    p.add_argument("--steps", type=int, default=600, help="training steps")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per training step")
    p.add_argument("--lr", type=float, default=3e-4, help="peak learning rate (AdamW, warmup then cosine)")
    p.add_argument("--warmup", type=int, default=20, help="learning-rate warmup steps")
    p.add_argument("--freeze-embedding", action="store_true", help="keep the verifier's embedding/head rows "
                   "fixed and train only the layers (fewer free parameters for small data)")
    p.add_argument("--seed", type=int, default=0, help="seed for initialisation and data order")
    p.add_argument("--max-new", type=int, default=96, help="tokens the verifier generates per prompt")
    p.add_argument("--topk", type=int, default=8, help="verifier log-probs recorded per position")
    p.add_argument("--add-data", action="append", default=[], metavar="FILE",
                   help="another prompt file (same format as --data), answered once each, added to the training "
                   "data (repeatable; e.g. one written by python -m edgespec.converters.distill.local_prompts)")
    p.add_argument("--samples", type=int, default=1, help="answers per training prompt: the greedy one plus "
                   "SAMPLES-1 sampled near-greedy ones (more, varied training text from the same prompts)")
    p.add_argument("--sample-temperature", type=float, default=0.7, help="temperature of those extra answers "
                   "(low: mostly the verifier's argmax, occasionally a branch)")
    p.add_argument("--gen-batch", type=int, default=48, help="prompts the verifier answers per batch")
    p.add_argument("--max-shards", type=int, default=None, help="data budget: answer only the first N batches of "
                   "prompts (each prefix of the plan is balanced across domains; default: all)")
    p.add_argument("--checkpoint-every", type=int, default=25, help="training steps between checkpoints")
    p.add_argument("--work", default=None, help="work folder for data and checkpoints (default: OUT.work)")
    p.add_argument("--resume", action="store_true", help="continue an interrupted run from its work folder")
    p.add_argument("--no-eval", action="store_true", help="skip the held-out acceptance and cost measurement")
    p.add_argument("--force", action="store_true", help="replace an existing OUT, but only a drafter folder "
                   "edgespec wrote (or a bundle) holding nothing else, or an empty folder; anything else is "
                   "refused, nothing deleted")
    p.add_argument("--quiet", action="store_true", help="no progress output")


def run(args) -> int:
    from edgespec.apps.common import resolve_model_arg  # deferred: CLI start-up
    from edgespec.converters.distill.pipeline import (  # deferred: CLI start-up
        DistillConfig,
        distill,
        recipe_line,
    )
    from edgespec.converters.distill.train import TrainConfig  # deferred: CLI start-up

    verifier = resolve_model_arg(args.verifier, progress=not args.quiet)
    if verifier is None:
        from edgespec.converters.default_model import default_bundle_path  # deferred: CLI start-up

        verifier = default_bundle_path(progress=not args.quiet)
    cfg = DistillConfig(
        layers=args.layers, hidden=args.hidden, vocab=args.vocab, init_layers=args.init_layers,
        max_new=args.max_new, topk=args.topk, gen_batch=args.gen_batch,
        max_shards=args.max_shards, evaluate=not args.no_eval,
        samples=args.samples, sample_temperature=args.sample_temperature, add_data=args.add_data,
        kind=args.kind, unroll=args.unroll, reg_weight=args.reg_weight,
        train=TrainConfig(steps=args.steps, batch_size=args.batch_size, lr=args.lr, warmup=args.warmup, seed=args.seed,
                          freeze_embedding=args.freeze_embedding,
                          checkpoint_every=args.checkpoint_every),
    )
    from tqdm import tqdm  # deferred: CLI start-up

    state: dict = {}

    def progress(stage, done, total, note):
        if args.quiet:
            return
        if state.get("stage") != stage:  # one live bar per stage; ETA counts from where it resumed
            if state.get("bar") is not None:
                state["bar"].close()
            unit = "step" if stage == "train" else "it"
            state.update(stage=stage, bar=tqdm(total=total, initial=max(0, done - 1), desc=stage, unit=unit,
                                               file=sys.stderr, dynamic_ncols=True))
        bar = state["bar"]
        bar.update(done - bar.n)
        bar.set_postfix_str(note)

    try:
        info = distill(verifier, args.out, cfg, prompts=args.data, heldout=args.heldout, work=args.work,
                       resume=args.resume, force=args.force, recipe=recipe_line(sys.argv[2:]), progress=progress)
    finally:
        if state.get("bar") is not None:
            state["bar"].close()
    print(f"wrote {args.out} ({info['size_mb']:.1f} MB, {info['params'] / 1e6:.1f} M params, vocab {info['vocab_n']})")
    for dom, a in sorted((info.get("acceptance") or {}).items()):
        print(f"  acceptance {dom}: {a['accepted']}/{a['drafted']} = {a['rate']:.3f}")
    if info.get("cost"):
        print(f"  draft step / verifier step: {info['cost']['ratio_step']:.1%}")
    return 0
