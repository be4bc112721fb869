"""Read a llama.cpp GGUF file: config, weights (dense or kept quantized) and tokenizer.

GGUF quirks undone here, so `models/` never sees them:
- tensor names (`blk.N.attn_q`) map to Hugging Face names;
- llama.cpp permutes the rows of Q and K per head (interleaved RoPE pairs ->
  halves); we invert that permutation;
- Q4_0 / Q4_1 / Q8_0 blocks of 32 map exactly onto MLX affine quantization
  (w = scale * q + bias, group size 32), so they stay quantized without any
  rounding; other types are dequantized.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from edgespec.errors import ModelLoadError

_LAYER_MAP = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_MAP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
SUPPORTED_ARCHS = ("llama", "qwen2")
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4


def hf_name(gguf_name: str) -> str:
    base, _, kind = gguf_name.rpartition(".")  # kind: weight | bias
    if base.startswith("blk."):
        _, idx, part = base.split(".", 2)
        if part not in _LAYER_MAP:
            raise ModelLoadError(f"unexpected GGUF tensor {gguf_name!r}")
        return f"model.layers.{idx}.{_LAYER_MAP[part]}.{kind}"
    if base not in _TOP_MAP:
        raise ModelLoadError(f"unexpected GGUF tensor {gguf_name!r}")
    return f"{_TOP_MAP[base]}.{kind}"


def unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Invert llama.cpp's per-head row permutation of Q/K (works on any per-row array)."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _open(path: Path):
    import gguf

    if not path.is_file():
        raise ModelLoadError(f"{path}: no such GGUF file")
    try:
        return gguf.GGUFReader(str(path))
    except Exception as e:  # the reader raises ValueError/struct/OSError on bad files
        raise ModelLoadError(f"{path}: not a readable GGUF file (corrupt or truncated?): {e}") from None


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def read_config(reader, path: Path) -> dict[str, Any]:
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise ModelLoadError(
            f"{path}: GGUF architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHS)})"
        )
    g = lambda k, d=None: _field(reader, f"{arch}.{k}", d)  # noqa: E731
    names = {t.name for t in reader.tensors}
    n_heads = int(g("attention.head_count"))
    hidden = int(g("embedding_length"))
    tokens = _field(reader, "tokenizer.ggml.tokens") or []
    cfg: dict[str, Any] = {
        "model_type": "qwen2" if arch == "qwen2" else "llama",
        "hidden_size": hidden,
        "num_hidden_layers": int(g("block_count")),
        "intermediate_size": int(g("feed_forward_length")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(g("attention.head_count_kv", n_heads)),
        "rms_norm_eps": float(g("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(g("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(g("context_length", 4096)),
        "vocab_size": int(g("vocab_size", len(tokens))),
        "tie_word_embeddings": "output.weight" not in names,
        "head_dim": int(g("attention.key_length", hidden // n_heads)),
    }
    stype = g("rope.scaling.type")
    if stype == "linear":
        cfg["rope_scaling"] = {"type": "linear", "factor": float(g("rope.scaling.factor"))}
    if "rope_freqs.weight" in names:
        raise ModelLoadError(f"{path}: GGUF with a rope_freqs tensor (Llama 3.1 scaling) is not supported yet")
    for k in ("bos_token_id", "eos_token_id"):
        v = _field(reader, f"tokenizer.ggml.{k}")
        if v is not None:
            cfg[k] = int(v)
    return cfg


def _q_blocks(t) -> tuple[str, np.ndarray]:
    """Raw block bytes (rows, n_blocks, block_bytes) and the type name."""
    name = t.tensor_type.name
    data = np.asarray(t.data)
    rows = data.shape[0]
    bytes_per_block = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}[name]
    return name, data.reshape(rows, -1, bytes_per_block)


def _pack_mlx(q: np.ndarray, bits: int) -> np.ndarray:
    """q (rows, cols) uint8 values < 2**bits -> MLX packed uint32 (rows, cols*bits/32)."""
    if bits == 8:
        packed = q.astype(np.uint8)
    else:  # 4 bits: element 2k in the low nibble of byte k
        packed = (q[:, 0::2] | (q[:, 1::2] << 4)).astype(np.uint8)
    return np.ascontiguousarray(packed).view(np.uint32)


def native_quantized(t) -> tuple[dict[str, np.ndarray], int] | None:
    """Map a Q4_0/Q4_1/Q8_0 tensor exactly onto MLX affine quantization, or None."""
    if t.tensor_type.name not in ("Q4_0", "Q4_1", "Q8_0"):
        return None
    name, blocks = _q_blocks(t)
    rows, nb, _ = blocks.shape
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)  # (rows, nb)
    if name == "Q8_0":
        q = blocks[..., 2:].copy().view(np.int8).astype(np.int16) + 128  # unsigned 0..255
        bias = -128.0 * d
        bits = 8
    else:
        qs = blocks[..., 4:] if name == "Q4_1" else blocks[..., 2:]
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # (rows, nb, 32): low nibbles first
        if name == "Q4_1":
            bias = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        else:
            bias = -8.0 * d
        bits = 4
    q = q.reshape(rows, nb * 32).astype(np.uint8)
    return {"weight": _pack_mlx(q, bits), "scales": d, "biases": bias}, bits


def dequantized(t) -> np.ndarray:
    import gguf

    name = t.tensor_type.name
    data = np.asarray(t.data)
    if name in ("F32", "F16", "BF16"):
        out = data.astype(np.float32) if name != "BF16" else gguf.quants.dequantize(data, t.tensor_type)
    else:
        out = gguf.quants.dequantize(data, t.tensor_type)
    shape = tuple(int(s) for s in reversed(t.shape))  # GGUF lists ne0 (columns) first
    return np.asarray(out, dtype=np.float32).reshape(shape)


def read_weights(reader, config: dict[str, Any], keep_quantized: bool, progress=None):
    """-> (weights: name -> np.ndarray, quantization: per-module {group_size, bits} or {})."""
    weights: dict[str, np.ndarray] = {}
    quant: dict[str, dict[str, int]] = {}
    permute = config["model_type"] == "llama"
    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    for t in reader.tensors:
        name = hf_name(t.name)
        module, _, kind = name.rpartition(".")
        n_heads = next((h for p, h in heads.items() if module.endswith(p)), None) if permute else None
        native = native_quantized(t) if keep_quantized and kind == "weight" else None
        if native is not None:
            parts, bits = native
            for part, arr in parts.items():
                weights[f"{module}.{part}"] = unpermute_rows(arr, n_heads) if n_heads else arr
            quant[module] = {"group_size": 32, "bits": bits}
        else:
            arr = dequantized(t)
            weights[name] = unpermute_rows(arr, n_heads) if n_heads else arr
        if progress is not None:
            progress(1)
    return weights, quant


def build_tokenizer(reader, path: Path):
    """Hugging Face `tokenizers` object and tokenizer_config dict from GGUF metadata."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors
    from tokenizers import Tokenizer as HFTokenizer

    kind = _field(reader, "tokenizer.ggml.model")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    if not tokens:
        raise ModelLoadError(f"{path}: GGUF carries no tokenizer")
    types = _field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    if kind != "gpt2":
        raise ModelLoadError(
            f"{path}: GGUF tokenizer model {kind!r} is not supported (byte-level BPE 'gpt2' is); "
            "convert from the Hugging Face folder instead"
        )
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges") or []]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    special = [
        AddedToken(t, special=True, normalized=False)
        for t, ty in zip(tokens, types, strict=True)
        if ty in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED)
    ]
    tok.add_special_tokens(special)

    def tok_of(key):
        i = _field(reader, f"tokenizer.ggml.{key}")
        return tokens[int(i)] if i is not None and int(i) < len(tokens) else None

    config = {
        "bos_token": tok_of("bos_token_id"),
        "eos_token": tok_of("eos_token_id"),
        "unk_token": tok_of("unknown_token_id"),
        "pad_token": tok_of("padding_token_id"),
        "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        "chat_template": _field(reader, "tokenizer.chat_template"),
    }
    eot = _field(reader, "tokenizer.ggml.eot_token_id")
    if eot is not None:
        config["extra_eos_token_ids"] = [int(eot)]
    return tok, config


def source_info(path: Path) -> dict[str, Any]:
    st = path.stat()
    return {"format": "gguf", "path": str(path), "size": st.st_size}


def read_gguf(path: str | Path, keep_quantized: bool, progress=None):
    """-> (config, weights, quantization, (tokenizer_backend, tokenizer_config))."""
    path = Path(path)
    reader = _open(path)
    config = read_config(reader, path)
    try:
        weights, quant = read_weights(reader, config, keep_quantized, progress)
    except ModelLoadError:
        raise
    except Exception as e:
        raise ModelLoadError(f"{path}: could not read tensors (corrupt or truncated?): {e}") from None
    tokenizer = build_tokenizer(reader, path)
    return config, weights, quant, tokenizer


def n_tensors(path: str | Path) -> int:
    return len(_open(Path(path)).tensors)


def dump_config(path: str | Path) -> str:
    reader = _open(Path(path))
    return json.dumps(read_config(reader, Path(path)), indent=2)
