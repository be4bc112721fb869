"""`edgespec distill --kind feature`: the stages after the data, for a feature drafter.

features (teacher-forced verifier hidden states, cached beside each data shard)
-> FeatureDraftModel (fc + decoder layer(s) + norm; embedding and head stay the
verifier's) -> unrolled training (feature_train.py) -> measured on held-out
prompts with the runtime FeatureDrafter -> folder written atomically.
"""

from __future__ import annotations

import json
import platform
import time
from dataclasses import asdict
from pathlib import Path

import mlx.core as mx
import numpy as np
from edgespec.converters.bundle import atomic_folder
from edgespec.converters.distill.card import _count, _params, feature_card
from edgespec.converters.distill.corpus import from_examples
from edgespec.converters.distill.evaluate import acceptance, draft_cost
from edgespec.converters.distill.feature_train import FeatureBatch, feature_loss, prepare_features
from edgespec.converters.distill.features import build_features, load_features
from edgespec.converters.distill.train import train
from edgespec.models.feature_drafter import FeatureDraftModel
from edgespec.models.llama import ModelArgs
from mlx.utils import tree_flatten, tree_map

from edgespec.adaptive.corpus import FILENAME as CORPUS_FILE
from edgespec.drafters.feature import DRAFTER_JSON, FORMAT, FeatureDrafter, verifier_head_rows


def feature_config(verifier_args: ModelArgs, layers: int) -> dict:
    """config.json of the drafter's decoder layers: the verifier's width and attention shape."""
    if layers < 1:
        raise ValueError(f"--layers must be >= 1, got {layers}")
    cfg = dict(verifier_args.to_dict())
    cfg.pop("use_sliding_window", None)  # a Qwen verifier's; llama reads no such field
    cfg.update(num_hidden_layers=layers, model_type="llama")
    return cfg


def init_feature_model(config: dict, verifier, seed: int = 0) -> FeatureDraftModel:
    """Random fc and layers (as EAGLE); the output norm starts as the verifier's final norm,
    so guesses start on the scale of the features they imitate. float32 for training."""
    mx.random.seed(seed)
    model = FeatureDraftModel(ModelArgs.from_dict(config))
    model.norm.weight = mx.array(verifier.model.norm.weight, dtype=mx.float32)
    model.update(tree_map(lambda p: mx.array(p, dtype=mx.float32), model.parameters()))
    mx.eval(model.parameters())
    return model


def training_objective(verifier, vmap, cfg):
    """(loss_fn, make_batch) for train(): CE to the verifier's kept-vocab distribution + feature regression."""
    head = verifier_head_rows(verifier, vmap.ids[1:]).astype(mx.float32)
    embed = verifier.model.embed_tokens.weight

    def loss_fn(model, batch):
        return feature_loss(model, batch, head, cfg.unroll, cfg.reg_weight)

    return loss_fn, lambda items: (FeatureBatch(items, embed),)


def write_feature_folder(folder: Path, model, config: dict, vmap, vocab_hash: str | None) -> None:
    """config.json, model.safetensors (fp16), vocab_map.json, drafter.json into `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    weights = {k: v.astype(mx.float16) for k, v in tree_flatten(model.parameters())}
    (folder / "config.json").write_text(json.dumps({**config, "torch_dtype": "float16"}, indent=2))
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "mlx"})
    vmap.save(folder, vocab_hash=vocab_hash)
    (folder / DRAFTER_JSON).write_text(json.dumps({"format": FORMAT, "feature": "final_norm_hidden",
                                                  "verifier_hidden_size": config["hidden_size"]}, indent=2))


def distill_feature(loaded, out, work, cfg, vmap, examples, folders, held_examples, data_minutes,
                    verifier_path, prompts, heldout, force, recipe, note) -> dict:
    t0 = time.time()
    feats = []
    for folder in folders:
        build_features(loaded.model, folder, progress=lambda d, n, f=folder: note(f"features {f.name}", d, n, "shards"))
        feats += load_features(folder)
    held_feats = []
    if cfg.evaluate:
        build_features(loaded.model, work / "heldout", progress=lambda d, n: note("features heldout", d, n, "shards"))
        held_feats = load_features(work / "heldout")
    feature_minutes = (time.time() - t0) / 60

    fcfg = feature_config(loaded.model.args, cfg.layers)
    model = init_feature_model(fcfg, loaded.model, seed=cfg.train.seed)
    data = prepare_features(examples, feats, cfg.train.max_len)
    loss_fn, make_batch = training_objective(loaded.model, vmap, cfg)
    t1 = time.time()
    losses = train(model, data, cfg.train, checkpoint=work / f"feature-u{cfg.unroll}-r{cfg.reg_weight:g}.safetensors",
                   progress=lambda s, n, loss: note("train", s, n, f"loss {loss:.3f}"),
                   loss_fn=loss_fn, make_batch=make_batch)
    train_minutes = (time.time() - t1) / 60

    greedy = lambda exs: np.concatenate([e.topk_ids[:, 0] for e in exs]) if exs else np.zeros(0, int)  # noqa: E731
    info = {
        "kind": "feature",
        "verifier_name": loaded.path.name if loaded.path else str(verifier_path),
        "vocab_hash": loaded.tokenizer.vocab_hash(),
        "vocab_n": vmap.size,
        "layers": fcfg["num_hidden_layers"],
        "hidden": fcfg["hidden_size"],
        "heads": fcfg["num_attention_heads"],
        "kv_heads": fcfg["num_key_value_heads"],
        "intermediate": fcfg["intermediate_size"],
        "params": _params(model),
        "n_prompts": len({(e.domain, e.tokens[: e.start].tobytes()) for e in examples}),
        "n_sequences": len(examples),
        "n_positions": int(sum(len(d.x) - 1 for d in data)),
        "samples": cfg.samples,
        "domains": ", ".join(f"{d} {n}" for d, n in sorted(_count(e.domain for e in examples).items())),
        "prompts": " + ".join([str(prompts or "built-in edgespec/data/distill_prompts.jsonl"), *map(str, cfg.add_data)]),
        "heldout": str(heldout or "built-in edgespec/data/distill_prompts_heldout.jsonl"),
        "max_new": cfg.max_new,
        "unroll": cfg.unroll,
        "reg_weight": cfg.reg_weight,
        "coverage_train": vmap.coverage(greedy(examples)),
        "coverage_heldout": vmap.coverage(greedy(held_examples)) if held_examples else float("nan"),
        **{k: v for k, v in asdict(cfg.train).items() if k in ("lr", "warmup", "steps", "batch_size", "seed", "max_len")},
        "final_loss": float(np.mean(losses[-10:])) if losses else float("nan"),
        "train_minutes": train_minutes,
        "data_minutes": data_minutes,
        "feature_minutes": feature_minutes,
        "machine": f"{platform.machine()} {platform.system()}, MLX {mx.default_device()}",
        "k": cfg.k,
        "recipe": recipe,
    }
    with atomic_folder(out, force=force) as tmp:
        write_feature_folder(tmp, model, fcfg, vmap, info["vocab_hash"])
        # the corpus source's table
        from_examples(examples, info["vocab_hash"], loaded.model.args.vocab_size).save(tmp / CORPUS_FILE)
        info["size_mb"] = sum(p.stat().st_size for p in tmp.iterdir()) / 1e6
        if cfg.evaluate:
            drafter = FeatureDrafter.load(tmp, loaded)  # measure exactly what ships (fp16 weights)
            note("evaluate", 0, 2, "held-out acceptance")
            info["acceptance"] = acceptance(drafter, held_examples, cfg.k, features=held_feats)
            note("evaluate", 1, 2, "draft vs verifier cost")
            ctx = [int(t) for t in held_examples[0].tokens] if held_examples else [1] * 128
            info["cost_context"] = len(ctx)
            info["cost"] = draft_cost(loaded.model, drafter, ctx, cfg.k, repeats=8)
            note("evaluate", 2, 2, "done")
        (tmp / "distill.json").write_text(json.dumps(info, indent=2, default=str))
        (tmp / "MODEL_CARD.md").write_text(feature_card(info))
    return info
