"""Export an MLX drafter to a stateful, multifunction Core ML package (`drafter.mlpackage`).

    export_drafter(model, "drafter.mlpackage", context_length=512, prefill_chunk=64,
                   decode_tokens=(1, 4), compress="int8") -> info dict for the manifest

Functions in the package (all share one weight file and the two KV states):
    prefill      T = prefill_chunk, outputs the last slot's logits only
    decode       T = 1
    decode_K     T = K for each extra K in `decode_tokens` (scores K drafted tokens at once)

The program itself is built in `coreml_program.py`; this module prepares the
weights, converts each function, compresses linear layers and assembles the
package atomically. coremltools is imported only here (conversion time).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
from edgespec.converters.coreml_calibrate import compress_model, greedy_agreement, split_calibration
from edgespec.converters.coreml_program import DrafterShape, build_function, rope_tables
from edgespec.converters.dense import _dense_params  # noqa: F401  (re-exported)
from edgespec.models.llama import Model

from edgespec.drafters.coreml_runtime import METADATA_KEY
from edgespec.errors import ModelLoadError
from edgespec.safe_write import (
    PID_MARKER,
    check_replaceable,
    check_writable,
    clean_stale_temps,
    describe_failure,
    install,
    temp_prefix,
)

COMPRESS_CHOICES = ("none", "int8", "int4", "palette4")
MAX_CONTEXT = 32767  # coremltools may cast gather indices to int16: positions must fit
PACKAGE_FORMAT = 1


def package_target(out, force: bool, context_length: int, prefill_chunk: int) -> Path:
    """`out` as a path, checked before any work: replaceable (with force, only a package
    edgespec wrote), writable, and a context the package can index (the prefill chunk in it)."""
    out = Path(out).expanduser()
    check_replaceable(out, force, label="package")
    check_writable(out, label="package")
    if not 1 <= prefill_chunk <= context_length <= MAX_CONTEXT:
        raise ValueError(
            f"need 1 <= prefill_chunk ({prefill_chunk}) <= context_length ({context_length}) <= {MAX_CONTEXT}"
        )
    return out


@contextmanager
def package_staging(out: Path, force: bool):
    """A work folder beside `out` (so the final rename is atomic), holding the writer's pid;
    a failure inside is described in one line (a full disk, no permission) and the folder is
    removed whatever happens. The package goes in with `finish_package`."""
    existed = os.path.lexists(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    clean_stale_temps(out)  # of exports of `out` killed outright
    work = Path(tempfile.mkdtemp(prefix=temp_prefix(out), dir=out.parent))
    (work / PID_MARKER).write_text(str(os.getpid()))
    try:
        yield work
    except BaseException as e:
        nicer = describe_failure(e, out, existed, work, label="package")
        if nicer is not None:
            raise nicer from e
        raise
    finally:
        shutil.rmtree(work, ignore_errors=True)


def add_function(ct, desc, prog, work: Path, name: str) -> None:
    """Convert one hand-built MIL program and add it to the multifunction descriptor as `name`.
    The programs are fp16 by construction with fp32 norm reductions: FLOAT32 here means "do
    not run the fp16 rewrite pass", and the default ~90 graph passes would only cost minutes
    on a big vocabulary."""
    mlmodel = ct.convert(prog, convert_to="mlprogram", minimum_deployment_target=ct.target.iOS18,
                         compute_precision=ct.precision.FLOAT32, pass_pipeline=ct.PassPipeline.EMPTY,
                         skip_model_load=True)
    path = work / f"{name}.mlpackage"
    mlmodel.save(str(path))
    desc.add_function(str(path), src_function_name="main", target_function_name=name)


def finish_package(ct, desc, default: str, work: Path, meta: dict, out: Path, force: bool) -> None:
    """Save the functions as one package describing itself (`meta` under METADATA_KEY, so a bare
    .mlpackage can be checked at load time too) and install it at `out` atomically: `out`
    appears complete or not at all."""
    desc.default_function_name = default
    combined = work / "combined.mlpackage"
    ct.utils.save_multifunction(desc, str(combined))
    package = ct.models.MLModel(str(combined), skip_model_load=True)
    package.user_defined_metadata[METADATA_KEY] = json.dumps(meta, sort_keys=True)
    staged = work / "out.mlpackage"
    package.save(str(staged))
    install(staged, out, force, label="package")


def drafter_shape(model, context_length: int) -> DrafterShape:
    if not isinstance(model, Model):
        raise ModelLoadError(
            f"cannot export {type(model).__name__} to Core ML: only edgespec's Llama-family "
            f"decoder (models/llama.py: llama, mistral, qwen2, smollm) is supported"
        )
    a = model.args
    return DrafterShape(
        n_layers=a.num_hidden_layers,
        hidden=a.hidden_size,
        n_heads=a.num_attention_heads,
        n_kv_heads=a.num_key_value_heads,
        head_dim=a.head_dim,
        intermediate=a.intermediate_size,
        vocab=a.vocab_size,
        context=context_length,
        eps=float(a.rms_norm_eps),
        tied=bool(a.tie_word_embeddings),
    )


def prepare_weights(model, shape: DrafterShape, packed: dict | None = None) -> dict[str, Any]:
    """HF-named float32 weights, rearranged for the exported graph.

    packed: name -> constexpr inputs of compressed linear weights (coreml_calibrate.
    compress_model, in the model's own layout); they replace the dense weights and
    get the same row rearrangement. Compression is per output row (a palette or
    scales per row or per block of one row), so permuting rows and scaling them
    commute with it: the scale goes into the palette or the scales.

    - q_proj rows (and bias) scaled by 1/sqrt(D): folds the attention scale in.
    - traditional (interleaved-pair) RoPE becomes rotate-half by permuting each
      head's q/k rows to [even dims, odd dims]; q.k is unchanged by a shared
      permutation, so one RoPE form serves both.
    - rope_cos / rope_sin (D/2, C) tables from the model's own frequencies.
    """
    w = _dense_params(model)
    rope = model.layers[0].self_attn.rope
    D = shape.head_dim
    if rope.dims != D:
        raise ModelLoadError(
            f"partial rotary embeddings ({rope.dims} of {D} dims) are not supported by the Core ML export"
        )
    periods = (
        np.array(rope._freqs) if rope._freqs is not None else rope.base ** (np.arange(0, D, 2) / D)
    )
    w["rope_cos"], w["rope_sin"] = rope_tables(
        D, shape.context, 1.0 / np.asarray(periods, np.float64), rope.scale
    )
    w.update(packed or {})
    perm = None
    if rope.traditional:
        perm = np.concatenate([np.arange(0, D, 2), np.arange(1, D, 2)])

    def rows(x: np.ndarray, heads: int, factor: float) -> np.ndarray:
        t = x.reshape(heads, D, *x.shape[1:])
        if perm is not None:
            t = t[:, perm]
        if factor != 1.0:
            t = (t * factor).astype(x.dtype)
        return t.reshape(x.shape)

    for i in range(shape.n_layers):
        p = f"model.layers.{i}.self_attn."
        for proj, heads in (("q_proj", shape.n_heads), ("k_proj", shape.n_kv_heads)):
            factor = D**-0.5 if proj == "q_proj" else 1.0
            for suffix in ("weight", "bias"):
                name = p + proj + "." + suffix
                if name not in w:
                    continue
                if isinstance(w[name], dict):  # compressed: codes move with their rows; values scale
                    w[name] = {k: rows(v, heads, 1.0 if k in ("indices", "data", "offset") else factor)
                               for k, v in w[name].items()}  # fmt: skip
                else:
                    w[name] = rows(w[name], heads, factor)
    return w


def function_specs(
    prefill_chunk: int, decode_tokens: tuple[int, ...]
) -> dict[str, tuple[int, bool]]:
    """name -> (T, last_only)."""
    specs = {"prefill": (prefill_chunk, True)}
    for k in decode_tokens:
        specs["decode" if k == 1 else f"decode_{k}"] = (k, False)
    return specs


def export_drafter(
    model,
    out: str | Path,
    context_length: int = 512,
    prefill_chunk: int = 64,
    decode_tokens: tuple[int, ...] = (1,),
    compress: str = "none",
    vocab_hash: str | None = None,
    vocab_map=None,
    progress=None,
    calibration: list[list[int]] | None = None,
    calibrate_steps: int = 0,
    calibrate_progress=None,
    force: bool = False,
) -> dict[str, Any]:
    """Write `out` (.mlpackage) atomically; returns the manifest's `coreml` entry.

    An existing `out` is refused before any work; with force it is replaced only when it is
    a package edgespec exported (or an empty folder: edgespec.safe_write's rule), judged again
    at the swap. The package gets the user's normal permissions (0777/0666 less the umask).

    model: edgespec Llama `Model` (MLX). context_length C: the fixed KV buffer;
    a sequence longer than C cannot be drafted for (the runtime stops drafting).
    vocab_map: the drafter's `VocabMap` when it is a reduced-vocabulary distilled
    one: the package then takes reduced ids and outputs N reduced logits (the
    runtime maps ids in and expands q out); "vocab_size" stays the verifier's V
    and "reduced_vocab" records the map (its ids are kept in the package's own
    metadata, so a bare package is self-contained; the returned entry holds
    only their size and digest).
    progress(str) is called with a short status per step.
    calibration: input id sequences (the drafter's ids) to tune the compressed
    weights on for `calibrate_steps` steps (converters/coreml_calibrate.py);
    calibrate_progress(done, total, loss) follows that run. With calibration text
    and a compression, "agreement" records how often the compressed package's
    greedy token equals the uncompressed drafter's on the held-back sequences.
    """
    out = package_target(out, force, context_length, prefill_chunk)
    compress = compress or "none"
    if compress not in COMPRESS_CHOICES:
        raise ValueError(
            f"--drafter-compress must be one of {', '.join(COMPRESS_CHOICES)}, got {compress!r}"
        )
    decode_tokens = tuple(sorted(set(decode_tokens) | {1}))
    if any(k < 1 or k > context_length for k in decode_tokens):
        raise ValueError(f"decode token counts must be in 1..{context_length}, got {decode_tokens}")
    shape = drafter_shape(model, context_length)
    if vocab_map is not None and vocab_map.size != shape.vocab:
        raise ModelLoadError(
            f"drafter model has {shape.vocab} output slots but its vocab map {vocab_map.size}"
        )
    if calibrate_steps < 0:
        raise ValueError(f"calibration steps must be >= 0, got {calibrate_steps}")
    packed, calibrated, agreement = {}, None, None
    if compress != "none":
        if progress:
            progress(f"compressing linear layers ({compress})")
        # Once per weight: every function then refers to identical blobs, stored once.
        packed, calibrated = compress_model(
            model, compress, calibration, calibrate_steps, progress=calibrate_progress
        )
        if calibration:  # what the compression costs, on text the tuning did not see
            held = split_calibration(calibration)[1]
            if held:
                agreement = greedy_agreement(
                    model, packed, held, first_slot=0 if vocab_map is None else 1
                )
    weights = prepare_weights(model, shape, packed)

    # coremltools is heavy and optional (the convert extra): imported only when a package is built or read
    import coremltools as ct  # optional: coremltools
    from coremltools.converters.mil import Builder as mb  # optional: coremltools
    from coremltools.converters.mil.mil import types  # optional: coremltools

    specs = function_specs(prefill_chunk, decode_tokens)
    with package_staging(out, force) as work:
        desc = ct.utils.MultiFunctionDescriptor()
        for name, (T, last_only) in specs.items():
            if progress:
                progress(f"building {name} (T={T})")
            prog = build_function(mb, types, shape, weights, T, last_only, ct.target.iOS18)
            add_function(ct, desc, prog, work, name)
        if progress:
            progress("assembling multifunction package")
        info = {
            "package": out.name,
            "package_format": PACKAGE_FORMAT,
            "context_length": context_length,
            "prefill_chunk": prefill_chunk,
            "decode_tokens": list(decode_tokens),
            "functions": list(specs),
            "compression": compress,
            "calibration": calibrated,
            "agreement": agreement,
            "precision": "float16",
            "deployment_target": "iOS18/macOS15",
            "vocab_size": shape.vocab if vocab_map is None else vocab_map.full_vocab_size,
            "vocab_hash": vocab_hash,
            "num_layers": shape.n_layers,
        }
        meta = dict(info)
        if vocab_map is not None:
            info["reduced_vocab"] = {"size": vocab_map.size, "sha256": vocab_map.digest()}
            meta["reduced_vocab"] = {**info["reduced_vocab"], "ids": vocab_map.ids.tolist()}
        finish_package(ct, desc, "decode", work, meta, out, force)
    return info
