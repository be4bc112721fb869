"""Read a llama.cpp GGUF file: config, weights (dense or kept quantized) and tokenizer.

GGUF quirks are undone here, so `models/` never sees them: per-architecture
tensor names and value transforms (gguf_arch.py), tensor types (gguf_quants.py:
exact MLX mappings, dequantization, re-quantization), and the tokenizer
(gguf_tokenizer.py: byte-level BPE and SentencePiece).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from edgespec.errors import ModelLoadError
from edgespec.weights.formats import gguf_quants as quants
from edgespec.weights.formats.gguf_arch import (
    ARCHS,
    arch_config,
    arch_of,
    block_of,
    hf_name,
    is_norm,
)
from edgespec.weights.formats.gguf_file import GGUFFile
from edgespec.weights.formats.gguf_hybrid import dense_only, gemma4_config, undo_values
from edgespec.weights.formats.gguf_tokenizer import build_tokenizer

SUPPORTED_ARCHS = tuple(ARCHS)
__all__ = [
    "SUPPORTED_ARCHS", "hf_name", "unpermute_rows", "read_config", "native_quantized", "dequantized",
    "read_weights", "build_tokenizer", "source_info", "read_gguf", "n_tensors", "dump_config",
]  # fmt: skip


def unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Invert llama.cpp's per-head row permutation of Q/K (works on any per-row array)."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _open(path: Path) -> GGUFFile:
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"{path}: no such GGUF file")
    try:
        return GGUFFile(path)
    except Exception as e:  # GGUFFormatError, OSError, ValueError from numpy on bad files
        raise ModelLoadError(f"{path}: not a readable GGUF file (corrupt or truncated?): {e}") from None


def _field(reader, key: str, default=None):
    value = reader.fields.get(key)
    return default if value is None else value


def _arch(reader) -> str:
    return _field(reader, "general.architecture")


def read_config(reader, path: Path) -> dict[str, Any]:
    """An HF-style config.json dict from the GGUF metadata."""
    arch = _arch(reader)
    model_type = arch_of(arch, path)[0]
    g = lambda k, d=None: _field(reader, f"{arch}.{k}", d)  # noqa: E731
    names = {t.name for t in reader.tensors}
    n_heads = int(g("attention.head_count"))
    hidden = int(g("embedding_length"))
    tokens = _field(reader, "tokenizer.ggml.tokens") or []
    cfg: dict[str, Any] = {
        "model_type": model_type,
        "hidden_size": hidden,
        # MTP layers (Qwen3.5's) are appended as extra blocks: not part of the model's stack
        "num_hidden_layers": int(g("block_count")) - int(g("nextn_predict_layers", 0)),
        "num_attention_heads": n_heads,
        "rms_norm_eps": float(g("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(g("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(g("context_length", 4096)),
        "vocab_size": int(g("vocab_size", len(tokens))),
        "tie_word_embeddings": "output.weight" not in names,
        "head_dim": int(g("attention.key_length", hidden // n_heads)),
    }
    ff, kv = g("feed_forward_length"), g("attention.head_count_kv", n_heads)
    if ff is not None and not isinstance(ff, list):  # absent: every layer MoE (qwen35moe); a list: gemma4
        cfg["intermediate_size"] = int(ff)
    if not isinstance(kv, list):  # a list: per layer (lfm2, read in arch_config)
        cfg["num_key_value_heads"] = int(kv)
    stype = g("rope.scaling.type")
    if stype == "linear":
        cfg["rope_scaling"] = {"rope_type": "linear", "type": "linear", "factor": float(g("rope.scaling.factor"))}
    elif stype not in (None, "none"):
        raise ModelLoadError(f"{path}: GGUF rope scaling {stype!r} is not supported (linear is)")
    rope_freqs = next((dequantized(t).reshape(-1) for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if rope_freqs is not None and arch != "gemma4":  # gemma4: its proportional RoPE (gemma4_config)
        cfg["rope_scaling"] = _llama3_scaling(reader, cfg, path)
    if names & {"rope_factors_long.weight", "rope_factors_short.weight"}:
        cfg.update(_longrope(reader, g, names, path))
    arch_config(arch, g, cfg)
    if arch == "lfm2moe":  # the expert bias (selection only) is a tensor or absent
        cfg["use_expert_bias"] = any(n.endswith(".exp_probs_b.bias") for n in names)
    if arch == "gemma4":
        gemma4_config(g, cfg, names, rope_freqs, path)
        if cfg["hidden_size_per_layer_input"]:
            t = next(t for t in reader.tensors if t.name == "per_layer_token_embd.weight")
            cfg["vocab_size_per_layer_input"] = _shape(t)[0]
    for k in ("bos_token_id", "eos_token_id"):
        v = _field(reader, f"tokenizer.ggml.{k}")
        if v is not None:
            cfg[k] = int(v)
    return cfg


# Llama 3.x RoPE scaling as released (3.1: factor 8, 3.2: factor 32): (low_freq_factor,
# high_freq_factor, original_max_position_embeddings). llama.cpp stores only the resulting
# per-frequency divisors (the rope_freqs tensor), so the parameters are found by recomputing.
LLAMA3_ROPE = [(1.0, 4.0, 8192)]


def llama3_rope_factors(base: float, dims: int, factor: float, low: float, high: float, old_ctx: int):
    """Per rotary pair i, the divisor of its frequency base**(-2i/dims): 1 for short wavelengths,
    `factor` for long ones, and between them 1 / ((1 - s)/factor + s), s = (old_ctx/wavelength - low)/(high - low)."""
    freqs = 1.0 / base ** (np.arange(0, dims, 2, dtype=np.float64) / dims)
    wavelen = 2 * np.pi / freqs
    smooth = (old_ctx / wavelen - low) / (high - low)
    mid = 1.0 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < old_ctx / high, 1.0, np.where(wavelen > old_ctx / low, factor, mid))


def _llama3_scaling(reader, cfg: dict[str, Any], path) -> dict[str, Any]:
    t = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
    got = dequantized(t).astype(np.float64).reshape(-1)
    dims = 2 * got.size
    factor = float(got.max())
    for low, high, old_ctx in LLAMA3_ROPE:
        want = llama3_rope_factors(cfg["rope_theta"], dims, factor, low, high, old_ctx)
        if np.allclose(got, want, rtol=1e-5, atol=0):
            return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
                    "original_max_position_embeddings": old_ctx}
    raise ModelLoadError(f"{path}: the GGUF's rope_freqs match no Llama 3 RoPE scaling "
                         f"(tried factor {factor:g} with low/high/original context {LLAMA3_ROPE})")


def _longrope(reader, g, names, path) -> dict[str, Any]:
    """Phi-3 LongRoPE: the short/long factor lists are stored as tensors, the original context
    and the attention factor as metadata (llama.cpp's names)."""
    if not {"rope_factors_long.weight", "rope_factors_short.weight"} <= names:
        raise ModelLoadError(f"{path}: GGUF LongRoPE needs both rope_factors_long and rope_factors_short")
    factors = {t.name: dequantized(t).reshape(-1).tolist() for t in reader.tensors if t.name.startswith("rope_factors")}
    scaling: dict[str, Any] = {"rope_type": "longrope", "long_factor": factors["rope_factors_long.weight"],
                               "short_factor": factors["rope_factors_short.weight"]}
    attn = g("rope.scaling.attn_factor")
    if attn is not None:
        scaling["attention_factor"] = float(attn)
    out: dict[str, Any] = {"rope_scaling": scaling}
    original = g("rope.scaling.original_context_length")
    if original is not None:
        out["original_max_position_embeddings"] = int(original)
    return out


def _shape(t) -> tuple[int, ...]:
    return tuple(int(s) for s in reversed(t.shape))  # GGUF lists ne0 (columns) first


def native_quantized(t) -> tuple[dict[str, np.ndarray], int] | None:
    """The exact MLX affine form of a GGUF tensor (see gguf_quants), or None."""
    return quants.native(t.tensor_type.name, np.asarray(t.data))


def dequantized(t) -> np.ndarray:
    return quants.dequantize(t.tensor_type.name, np.asarray(t.data), _shape(t))


def read_weights(reader, config: dict[str, Any], keep_quantized: bool, progress=None,
                 report: dict[str, Any] | None = None):
    """-> (weights: name -> np.ndarray, quantization: per-module {group_size, bits} or {}).

    keep_quantized: exactly-mapped types stay quantized; Q2_K/Q3_K/Q6_K are re-quantized
    to 2/3/6 bits (error recorded in `report`); F32/F16/BF16 stay dense.
    """
    arch = _arch(reader)
    _, _, permute, norm_plus_one = arch_of(arch, "GGUF")
    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    weights: dict[str, np.ndarray] = {}
    quant: dict[str, dict[str, int]] = {}
    report = {} if report is None else report
    for t in reader.tensors:
        if t.name in ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"):
            # read into the config's rope_scaling
            if progress is not None:
                progress(1)
            continue
        block = block_of(t.name)
        if block is not None and block >= config["num_hidden_layers"]:  # MTP blocks (not loaded)
            if progress is not None:
                progress(1)
            continue
        name = hf_name(t.name, arch)
        module, _, kind = name.rpartition(".")
        tname = t.tensor_type.name
        if tname not in quants.SUPPORTED:
            raise ModelLoadError(f"tensor {t.name}: GGUF type {tname} is not supported "
                                 f"(supported: {', '.join(quants.SUPPORTED)})")
        n_heads = next((h for p, h in heads.items() if module.endswith(p)), None) if permute else None
        fix = (lambda a, n=n_heads: unpermute_rows(a, n)) if n_heads else (lambda a: a)  # noqa: E731
        quantized = (keep_quantized and kind == "weight" and len(t.shape) == 2 and tname not in quants.DENSE
                     and not dense_only(arch, name))
        native = native_quantized(t) if quantized else None
        if native is not None:
            parts, bits = native
            quants.summary_entry(report, tname, "exact", bits, None)
        elif quantized:  # K-quant with 16-column sub-blocks: no exact MLX form
            bits = quants.REQUANT_BITS[tname]
            parts, err = quants.requantize(fix(dequantized(t)), bits)
            fix = lambda a: a  # noqa: E731  (already in HF row order)
            quants.summary_entry(report, tname, "requantized", bits, err)
        else:
            arr = dequantized(t)
            if norm_plus_one and is_norm(name, arch):
                arr = arr - np.float32(1.0)  # stored as 1 + w (see gguf_arch)
            weights[name] = undo_values(arch, name, fix(arr), config)
            quants.summary_entry(report, tname, "dense", None, None)
            parts = None
        if parts is not None:
            for part, arr in parts.items():
                weights[f"{module}.{part}"] = fix(arr)
            quant[module] = {"group_size": quants.GROUP, "bits": bits}
        if progress is not None:
            progress(1)
    return weights, quant


def source_info(path: Path) -> dict[str, Any]:
    st = path.stat()
    return {"format": "gguf", "path": str(path), "size": st.st_size}


def read_gguf(path: str | Path, keep_quantized: bool, progress=None, report: dict[str, Any] | None = None):
    """-> (config, weights, quantization, (tokenizer_backend, tokenizer_config)).

    `report`, when given, is filled per GGUF tensor type: how it was read ("exact",
    "requantized", "dense"), the tensor count, bits and group size, and for re-quantized
    types the largest relative error ||w' - w|| / ||w|| over its tensors.
    """
    path = Path(path)
    reader = _open(path)
    config = read_config(reader, path)
    try:
        weights, quant = read_weights(reader, config, keep_quantized, progress, report)
    except ModelLoadError as e:
        raise ModelLoadError(f"{path}: {e}") from None
    except Exception as e:
        raise ModelLoadError(f"{path}: could not read tensors (corrupt or truncated?): {e}") from None
    tokenizer = build_tokenizer(reader, path)
    return config, weights, quant, tokenizer


def n_tensors(path: str | Path) -> int:
    return len(_open(Path(path)).tensors)


def dump_config(path: str | Path) -> str:
    reader = _open(Path(path))
    return json.dumps(read_config(reader, Path(path)), indent=2)
