"""Put a drafter into a bundle being written: OUT/drafter/ (MLX) and OUT/drafter.mlpackage (Core ML).

Called by `convert` inside its atomic temp folder, so an interrupted export
leaves nothing behind. The drafter must share the verifier's tokenizer (checked id by id when
both have one; its tables are then fitted to the verifier's width).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import mlx.core as mx
from edgespec.converters.bundle import write_model_files
from edgespec.converters.coreml_assistant import export_assistant, function_names
from edgespec.converters.coreml_calibrate import calibration_sequences
from edgespec.converters.coreml_export import COMPRESS_CHOICES, export_drafter
from edgespec.converters.dense import _dense_params
from edgespec.converters.dflash_export import write_dflash_drafter
from edgespec.converters.eagle3_export import write_eagle3_drafter
from edgespec.converters.hf import read_safetensors
from edgespec.converters.mtp_export import write_mtp_drafter
from mlx.utils import tree_flatten

from edgespec.drafters.assistant import check_fit, is_assistant_folder, load_assistant_model
from edgespec.drafters.compat import check_compatible
from edgespec.drafters.dflash import is_dflash_folder
from edgespec.drafters.distilled import VOCAB_MAP, VocabMap, is_distilled_folder
from edgespec.drafters.eagle3 import is_eagle3_folder
from edgespec.drafters.feature import DRAFTER_JSON, is_feature_folder
from edgespec.errors import ModelLoadError
from edgespec.progress import progress_bar
from edgespec.weights.loader import LoadedModel, build_model, is_gguf, load, load_model_folder


def load_drafter_source(src: Path):
    """-> (LoadedModel-like: .model, .tokenizer or None). HF folder, GGUF, bundle, or bare MLX folder."""
    src = Path(src).expanduser()
    if not src.exists():
        raise ModelLoadError(f"drafter {src}: no such file or folder")
    bare = (
        src.is_dir()
        and (src / "model.safetensors").is_file()
        and not (src / "tokenizer.json").is_file()
    )
    if bare and not is_gguf(src):  # e.g. an existing bundle's drafter/ folder: weights only
        return LoadedModel(load_model_folder(src), None, src)
    return load(src)


def write_drafter(
    folder: Path,
    src: str | Path,
    verifier_vocab: int,
    verifier_hash: str,
    dtype,
    coreml: bool = True,
    compress: str = "none",
    context_length: int = 1024,
    prefill_chunk: int = 64,
    decode_tokens: tuple[int, ...] = (1, 2),
    calibrate: int = 0,
    tokenizer=None,
    progress: bool = False,
    verifier_tokenizer=None,
    verifier_args=None,
) -> dict[str, Any]:
    """Write the drafter into `folder` (the bundle's temp folder); returns the manifest's `drafter` entry.

    decode_tokens: 2 by default because after a fully accepted round the
    drafter has two unseen tokens (its last draft and the verifier's bonus).
    calibrate: steps of calibrated compression (converters/coreml_calibrate.py) on
    the built-in answer text, encoded by `tokenizer` (the verifier's); 0 = plain
    rounding. With a compression and a tokenizer the greedy agreement of the
    compressed package with the uncompressed drafter is measured on held-back
    answers (coreml "agreement").
    progress: show a bar for the calibration.
    verifier_tokenizer: the verifier's tokenizer for the pairing check (default: `tokenizer`).
    verifier_args: the verifier's ModelArgs (Gemma 4's assistant is checked against them and
    its Core ML package shaped by them; without them no package is made for it).
    """
    if compress not in COMPRESS_CHOICES:
        raise ValueError(
            f"--drafter-compress must be one of {', '.join(COMPRESS_CHOICES)}, got {compress!r}"
        )
    if compress != "none" and not coreml:
        raise ValueError(
            "--drafter-compress applies to the Core ML package; it cannot be used with --no-coreml"
        )
    if calibrate < 0:
        raise ValueError(f"--drafter-calibrate must be >= 0 steps, got {calibrate}")
    if calibrate and tokenizer is None:
        raise ValueError("--drafter-calibrate needs the verifier's tokenizer to encode calibration text")
    if str(src) == "mtp":  # the verifier's own MTP head (Qwen3.5), read back from the bundle being written
        return write_mtp_drafter(folder, verifier_hash, coreml=coreml, compress=compress,
                                 context_length=context_length, prefill_chunk=prefill_chunk)
    if Path(src).is_dir() and is_dflash_folder(src):  # a DFlash block drafter (converters/dflash_export.py)
        return write_dflash_drafter(folder, Path(src), verifier_args, verifier_hash, dtype, coreml, compress,
                                    context_length, prefill_chunk)
    if Path(src).is_dir() and is_eagle3_folder(src):  # an EAGLE-3 head (converters/eagle3_export.py)
        return write_eagle3_drafter(folder, Path(src), verifier_args, verifier_hash, dtype, compress, coreml,
                                    context_length, prefill_chunk)
    if Path(src).is_dir() and is_feature_folder(src):
        return write_feature_drafter(folder, Path(src), verifier_vocab, verifier_hash, coreml, compress)
    if Path(src).is_dir() and is_assistant_folder(src):
        return write_assistant_drafter(folder, Path(src), verifier_vocab, verifier_hash, dtype, coreml, compress,
                                       verifier_args, context_length, prefill_chunk, progress, calibrate)
    loaded = load_drafter_source(Path(src))
    model = loaded.model
    vmap = distilled_vocab_map(Path(src), model)
    if vmap is not None:  # reduced vocabulary: its map names the verifier's tokenizer
        d_hash = json.loads((Path(src) / VOCAB_MAP).read_text()).get("vocab_hash")
        check_compatible(vmap.full_vocab_size, verifier_vocab, d_hash, verifier_hash)
    elif (verifier_tokenizer or tokenizer) is not None and loaded.tokenizer is not None:
        # Same tokenizer, checked id by id; the table may be padded to another size. The
        # drafter is stored at the verifier's width so drafter/ and the Core ML package
        # produce the verifier's logits shape.
        check_compatible(model.args.vocab_size, verifier_vocab, drafter_tokenizer=loaded.tokenizer,
                         verifier_tokenizer=verifier_tokenizer or tokenizer)
        if model.args.vocab_size != verifier_vocab:
            model = fit_vocab(model, verifier_vocab)
    else:
        d_hash = loaded.tokenizer.vocab_hash() if loaded.tokenizer is not None else None
        check_compatible(model.args.vocab_size, verifier_vocab, d_hash, verifier_hash)
    params = {k: mx.array(v).astype(dtype) for k, v in _dense_params(model).items()}
    entry = write_model_files(folder / "drafter", model.args.to_dict(), params, None)
    out = {
        "config": "drafter/" + entry["config"],
        "weights": "drafter/" + entry["weights"],
        "num_layers": model.args.num_hidden_layers,
        "vocab_hash": verifier_hash,
        "source": {"name": Path(src).name},
        "coreml": None,
    }
    if vmap is not None:
        # The MLX copy stays a distilled folder (drafters/__init__ loads it as one).
        vmap.save(folder / "drafter", vocab_hash=verifier_hash)
        out["reduced_vocab"] = {
            "size": vmap.size,
            "map": f"drafter/{VOCAB_MAP}",
            "sha256": vmap.digest(),
        }
    if coreml:
        try:
            import coremltools  # noqa: F401
        except ImportError:
            raise ModelLoadError(
                "exporting the Core ML drafter needs coremltools (pip install 'edgespec[convert]'); "
                "or pass --no-coreml"
            ) from None
        steps = calibrate if compress != "none" else 0
        seqs = None
        if compress != "none" and tokenizer is not None:  # tuning text, and the agreement check
            seqs = calibration_sequences(tokenizer, vmap)
        with progress_bar(total=steps, desc=f"calibrating {compress}", unit="step",
                          enable=progress and steps > 0) as bar:  # fmt: skip

            def step(done: int, total: int, loss: float) -> None:
                bar.set_postfix(kl=f"{loss:.4f}", refresh=False)
                bar.update(1)

            out["coreml"] = export_drafter(
                model,
                folder / "drafter.mlpackage",
                context_length=context_length,
                prefill_chunk=prefill_chunk,
                decode_tokens=decode_tokens,
                compress=compress,
                vocab_hash=verifier_hash,
                vocab_map=vmap,
                calibration=seqs,
                calibrate_steps=steps,
                calibrate_progress=step,
            )
    return out


def fit_vocab(model, rows: int):
    """The drafter with its embedding and output tables cut or zero-padded to `rows` rows.

    Rows past the drafter's own table are ids past the shared tokenizer (padding); as zero rows
    they may be proposed and are then rejected by the verifier, so the output is unchanged."""

    params = {}
    for name, w in _dense_params(model).items():
        w = mx.array(w)
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            have = w.shape[0]
            w = w[:rows] if have >= rows else mx.concatenate([w, mx.zeros((rows - have, *w.shape[1:]), w.dtype)])
        params[name] = w
    return build_model({**model.args.to_dict(), "vocab_size": rows}, params)


def distilled_vocab_map(src: Path, model):
    """The VocabMap of a reduced-vocabulary distilled drafter folder, else None."""
    if not (src.is_dir() and is_distilled_folder(src)):
        return None
    try:
        vmap = VocabMap.load(src)
    except ValueError as e:
        raise ModelLoadError(str(e)) from None
    if vmap.size != model.args.vocab_size:
        raise ModelLoadError(
            f"{src}: the drafter model has {model.args.vocab_size} output slots but its vocab map {vmap.size}"
        )
    return vmap


FEATURE_NO_COREML = (
    "a feature drafter reads the verifier's hidden states at every round, so it runs in MLX beside the "
    "verifier; no Core ML package is made for it"
)


def write_feature_drafter(folder: Path, src: Path, verifier_vocab: int, verifier_hash: str, coreml: bool,
                          compress: str) -> dict[str, Any]:
    """A feature drafter (edgespec distill --kind feature) goes in as its MLX folder, checked first."""
    if compress != "none":
        raise ValueError(f"--drafter-compress applies to Core ML packages; {FEATURE_NO_COREML}")
    try:
        vmap = VocabMap.load(src)
    except ValueError as e:
        raise ModelLoadError(str(e)) from None
    d_hash = json.loads((src / VOCAB_MAP).read_text()).get("vocab_hash")
    check_compatible(vmap.full_vocab_size, verifier_vocab, d_hash, verifier_hash)
    config = json.loads((src / "config.json").read_text())

    read_safetensors([src / "model.safetensors"])  # a truncated or corrupt file fails here, not at load
    (folder / "drafter").mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "model.safetensors", VOCAB_MAP, DRAFTER_JSON):
        shutil.copyfile(src / name, folder / "drafter" / name)
    return {
        "config": "drafter/config.json",
        "weights": "drafter/model.safetensors",
        "num_layers": int(config.get("num_hidden_layers", 0)),
        "vocab_hash": verifier_hash,
        "source": {"name": src.name},
        "kind": "feature",
        "coreml": None,
        "coreml_note": FEATURE_NO_COREML if coreml else None,
    }


ASSISTANT_NO_ARGS = (
    "Gemma 4's assistant package is shaped by the verifier's key/value layers, which were not given; "
    "no Core ML package was made for it"
)


def write_assistant_drafter(folder: Path, src: Path, verifier_vocab: int, verifier_hash: str, dtype, coreml: bool,
                            compress: str, verifier_args=None, context_length: int = 1024, prefill_chunk: int = 64,
                            progress: bool = False, calibrate: int = 0) -> dict[str, Any]:
    """Gemma 4's assistant (a gemma4_assistant checkpoint) goes in as drafter/: its config and its
    weights in the bundle's dtype, read and checked first (against the verifier's args when
    given: vocabulary, hidden size, key/value layers), and, unless coreml is False, as
    drafter.mlpackage (converters/coreml_assistant.py) read with the verifier's keys, values
    and hidden state as inputs."""
    if compress != "none" and calibrate:
        raise ValueError("--drafter-calibrate is not implemented for Gemma 4's assistant package (its compression "
                         "is plain rounding); pass --drafter-calibrate 0")
    model = load_assistant_model(src)
    check_compatible(model.args.vocab_size, verifier_vocab, error=ModelLoadError,
                     size_message=f"the assistant's vocabulary has {model.args.vocab_size} tokens, "
                                  f"the verifier's {verifier_vocab}")
    if verifier_args is not None:
        check_fit(model.args, verifier_args)
    params = {k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v
              for k, v in tree_flatten(model.parameters())}
    entry = write_model_files(folder / "drafter", json.loads((src / "config.json").read_text()), params, None)
    out = {
        "config": "drafter/" + entry["config"],
        "weights": "drafter/" + entry["weights"],
        "num_layers": model.args.num_hidden_layers,
        "vocab_hash": verifier_hash,
        "source": {"name": src.name},
        "kind": "gemma4_assistant",
        "coreml": None,
        "coreml_note": None,
    }
    if not coreml:
        return out
    if verifier_args is None:
        out["coreml_note"] = ASSISTANT_NO_ARGS
        return out
    try:
        import coremltools  # noqa: F401
    except ImportError:
        raise ModelLoadError("exporting the assistant to Core ML needs coremltools (pip install 'edgespec[convert]'); "
                             "or pass --no-coreml") from None


    appends = tuple(s for s in sorted({1, 2, 4, 8, prefill_chunk}) if s <= context_length)
    with progress_bar(total=len(function_names(appends)), desc="exporting assistant to Core ML", unit="function",
                      enable=progress) as bar:  # fmt: skip

        def step(done: int, total: int, what: str) -> None:
            bar.n = done
            bar.set_postfix_str(what, refresh=True)

        out["coreml"] = export_assistant(model, folder / "drafter.mlpackage", verifier_args,
                                         context_length=context_length, append_tokens=appends,
                                         vocab_hash=verifier_hash, compress=compress, progress=step)
    return out
