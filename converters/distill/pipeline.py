"""`edgespec distill` end to end: data -> vocab -> student -> train -> measure -> folder.

Everything long lives in a work folder (default OUT.work) so a rerun with --resume
continues where it stopped: finished data shards are kept, training continues from
its last checkpoint. The drafter folder itself is written last and atomically.
"""

from __future__ import annotations

import json
import platform
import shlex
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import mlx.core as mx
import numpy as np
from edgespec.converters.bundle import atomic_folder, check_destination
from edgespec.converters.distill import data as D
from edgespec.converters.distill.card import _count, _params, model_card
from edgespec.converters.distill.corpus import from_examples
from edgespec.converters.distill.evaluate import acceptance_fast, draft_cost
from edgespec.converters.distill.feature_pipeline import distill_feature
from edgespec.converters.distill.prompts import BUILTIN_HELDOUT, builtin_path, read_prompts
from edgespec.converters.distill.student import init_student, student_config
from edgespec.converters.distill.train import TrainConfig, prepare, train
from edgespec.converters.distill.vocab import choose_vocab, token_counts
from mlx.utils import tree_flatten

from edgespec.adaptive.corpus import FILENAME as CORPUS_FILE
from edgespec.drafters.distilled import DistilledDrafter, VocabMap
from edgespec.weights import loader  # loader.load looked up per call (tests stand in for it)


@dataclass
class DistillConfig:
    layers: int = 2
    hidden: int | None = None  # None = the verifier's width (weights copied from it)
    vocab: int = 8192
    init_layers: list[int] | None = None
    max_new: int = 96
    topk: int = 8
    gen_batch: int = 48
    max_shards: int | None = None  # data budget: first shards of the (domain-balanced) plan
    samples: int = 1  # answers per training prompt: greedy + samples-1 near-greedy (see data.py)
    add_data: list[str] = field(default_factory=list)  # more prompt files, answered once each (greedy)
    sample_temperature: float = 0.7
    k: int = 4  # draft length for the acceptance measurement
    kind: str = "student"  # "student" (independent small model) or "feature" (reads the verifier's features)
    unroll: int = 2  # feature drafters: draft steps simulated per training position
    reg_weight: float = 0.2  # feature drafters: weight of the feature regression term
    evaluate: bool = True
    train: TrainConfig = field(default_factory=TrainConfig)


Progress = Callable[[str, int, int, str], None]  # (stage, done, total, note)


def distill(
    verifier_path: str | Path,
    out: str | Path,
    cfg: DistillConfig,
    prompts: str | Path | None = None,
    heldout: str | Path | None = None,
    work: str | Path | None = None,
    resume: bool = False,
    force: bool = False,
    recipe: str = "",
    progress: Progress | None = None,
) -> dict:
    """Train a drafter for the verifier at `verifier_path` into folder `out`. Returns the card facts."""
    if cfg.kind not in ("student", "feature"):
        raise ValueError(f"drafter kind must be 'student' or 'feature', got {cfg.kind!r}")
    if cfg.unroll < 1 or not cfg.reg_weight >= 0:
        raise ValueError(f"--unroll must be >= 1 and --reg-weight >= 0, got {cfg.unroll} and {cfg.reg_weight}")
    out = Path(out).expanduser()
    # Before the work (minutes of it): never over the verifier, with force only over what edgespec wrote.
    check_destination(verifier_path, out, force, label="OUT")
    work = Path(work) if work else out.with_name(out.name + ".work")
    if work.exists() and not resume and any(work.iterdir()):
        raise FileExistsError(f"work folder {work} exists: pass --resume to continue it, or remove it")
    work.mkdir(parents=True, exist_ok=True)
    note = progress or (lambda *a: None)

    loaded = loader.load(verifier_path)
    items = read_prompts(prompts)
    t0 = time.time()
    D.build_dataset(loaded, items, work / "data", cfg.max_new, cfg.topk, cfg.gen_batch,
                    progress=lambda d, n: note("data", d, n, "prompts answered by the verifier"),
                    max_shards=cfg.max_shards, samples=cfg.samples, sample_temperature=cfg.sample_temperature)
    _, examples = D.load_dataset(work / "data")
    folders = [work / "data"]
    for extra in cfg.add_data:  # each in its own folder, so adding a file reuses everything built before
        extra_items = read_prompts(extra)
        folder = work / f"data-{Path(extra).stem}-{D.items_hash(extra_items)[:8]}"
        D.build_dataset(loaded, extra_items, folder, cfg.max_new, cfg.topk, cfg.gen_batch * max(1, cfg.samples),
                        progress=lambda d, n, e=extra: note(f"data {Path(e).name}", d, n, "prompts answered"))
        examples += D.load_dataset(folder)[1]
        folders.append(folder)
    held_examples = []
    heldout_path = Path(heldout) if heldout else builtin_path(BUILTIN_HELDOUT)
    if cfg.evaluate:
        D.build_dataset(loaded, read_prompts(heldout_path), work / "heldout", cfg.max_new, cfg.topk, cfg.gen_batch,
                        progress=lambda d, n: note("held-out data", d, n, "held-out prompts"))
        held_examples = D.load_dataset(work / "heldout")[1]
    data_minutes = (time.time() - t0) / 60

    V = loaded.model.args.vocab_size
    eos = sorted(loaded.tokenizer.eos_token_ids)
    vmap = VocabMap(choose_vocab(token_counts(examples, V), cfg.vocab, always=eos), V)
    if cfg.kind == "feature":
        return distill_feature(loaded, out, work, cfg, vmap, examples, folders, held_examples,
                               data_minutes, verifier_path, prompts, heldout, force, recipe, note)
    scfg = student_config(loaded.model.args, cfg.layers, vmap.size, cfg.hidden)
    student = init_student(scfg, loaded.model, vmap.ids, cfg.init_layers, seed=cfg.train.seed)
    data = prepare(examples, vmap, cfg.train.max_len)
    t1 = time.time()
    losses = train(student, data, cfg.train, checkpoint=work / "train.safetensors",
                   progress=lambda s, n, loss: note("train", s, n, f"loss {loss:.3f}"))
    train_minutes = (time.time() - t1) / 60

    greedy_of = lambda exs: np.concatenate([e.topk_ids[:, 0] for e in exs]) if exs else np.zeros(0, int)  # noqa: E731
    info = {
        "verifier_name": loaded.path.name if loaded.path else str(verifier_path),
        "vocab_hash": loaded.tokenizer.vocab_hash(),
        "vocab_n": vmap.size,
        "layers": scfg["num_hidden_layers"],
        "hidden": scfg["hidden_size"],
        "heads": scfg["num_attention_heads"],
        "kv_heads": scfg["num_key_value_heads"],
        "intermediate": scfg["intermediate_size"],
        "params": _params(student),
        "init_layers": cfg.init_layers or f"0..{scfg['num_hidden_layers'] - 1}",
        "n_prompts": len({(e.domain, e.tokens[: e.start].tobytes()) for e in examples}),
        "n_sequences": len(examples),
        "samples": cfg.samples,
        "sample_temperature": cfg.sample_temperature if cfg.samples > 1 else None,
        "domains": ", ".join(f"{d} {n}" for d, n in sorted(_count(e.domain for e in examples).items())),
        "prompts": " + ".join([str(prompts or "built-in edgespec/data/distill_prompts.jsonl"), *map(str, cfg.add_data)]),
        "heldout": str(heldout or "built-in edgespec/data/distill_prompts_heldout.jsonl"),
        "max_new": cfg.max_new,
        "topk": cfg.topk,
        "n_targets": int(sum(len(p.cols) for p in data)),
        "coverage_train": vmap.coverage(greedy_of(examples)),
        "coverage_heldout": vmap.coverage(greedy_of(held_examples)) if held_examples else float("nan"),
        **{k: v for k, v in asdict(cfg.train).items() if k in ("lr", "warmup", "steps", "batch_size", "seed")},
        "final_loss": float(np.mean(losses[-10:])) if losses else float("nan"),
        "train_minutes": train_minutes,
        "data_minutes": data_minutes,
        "machine": f"{platform.machine()} {platform.system()}, MLX {mx.default_device()}",
        "k": cfg.k,
        "recipe": recipe,
    }
    weights = {k: v.astype(mx.float16) for k, v in tree_flatten(student.parameters())}
    with atomic_folder(out, force=force) as tmp:
        (tmp / "config.json").write_text(json.dumps({**scfg, "torch_dtype": "float16"}, indent=2))
        mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
        vmap.save(tmp, vocab_hash=info["vocab_hash"])
        from_examples(examples, info["vocab_hash"], V).save(tmp / CORPUS_FILE)  # the corpus source's table
        info["size_mb"] = sum(p.stat().st_size for p in tmp.iterdir()) / 1e6
        emb_mb = vmap.size * scfg["hidden_size"] * 2 / 1e6
        layer_mb = (info["params"] - vmap.size * scfg["hidden_size"]) * 2 / 1e6 / scfg["num_hidden_layers"]
        info.setdefault("size_reason", f"fp16: {scfg['num_hidden_layers']} layer(s) x {layer_mb:.1f} MB + "
                        f"{vmap.size} x {scfg['hidden_size']} tied embedding/head {emb_mb:.1f} MB.")
        if cfg.evaluate:
            drafter = DistilledDrafter.load(tmp, loaded)  # measure exactly what ships (fp16)
            note("evaluate", 0, 2, "held-out acceptance")
            info["acceptance"] = acceptance_fn(drafter, held_examples, cfg.k)
            note("evaluate", 1, 2, "draft vs verifier cost")
            ctx = [int(t) for t in held_examples[0].tokens] if held_examples else [1] * 128
            info["cost_context"] = len(ctx)
            info["cost"] = cost_fn(loaded.model, drafter, ctx, cfg.k)
            note("evaluate", 2, 2, "done")
        (tmp / "distill.json").write_text(json.dumps(info, indent=2, default=str))
        (tmp / "MODEL_CARD.md").write_text(model_card(info))
    return info


def acceptance_fn(drafter, examples, k):
    return acceptance_fast(drafter.model, drafter.vocab_map, examples, k)


def cost_fn(model, drafter, ctx, k):
    return draft_cost(model, drafter, ctx, k, repeats=8)


def recipe_line(argv: list[str]) -> str:
    return "edgespec distill " + " ".join(shlex.quote(a) for a in argv)
