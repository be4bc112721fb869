"""Write GGUF files for tests with the `gguf` package's own writer, names and quantizers.

The tensor names come from gguf's TensorNameMap (HF name -> GGUF name), not from
edgespec's reader, so a reader bug cannot hide behind a matching writer bug. The
per-architecture transforms are the ones llama.cpp's HF->GGUF converter applies
(written out here from its documented behaviour): Llama's Q/K row permutation,
Gemma's norm weights stored as 1 + w, Phi-3's fused QKV and gate/up tensors, MoE experts stacked.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

Q = gguf.GGMLQuantizationType


def byte_level_tokens() -> list[str]:
    """The 256 byte-level BPE symbols (GPT-2's bytes->unicode table) in byte order."""
    printable = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


def gpt2_tokenizer_meta(vocab_size: int) -> dict:
    """A byte-level BPE vocabulary of `vocab_size` tokens: 256 bytes, merges, last = <|endoftext|>."""
    tokens = byte_level_tokens()
    merges = []
    pairs = [("a", "b"), ("ab", "c"), ("Ġ", "t"), ("h", "e"), ("Ġt", "he")]
    for a, b in pairs:
        if len(tokens) >= vocab_size - 1:
            break
        merges.append(f"{a} {b}")
        tokens.append(a + b)
    while len(tokens) < vocab_size - 1:
        tokens.append(f"<unused{len(tokens)}>")
    tokens.append("<|endoftext|>")
    types = [1] * (vocab_size - 1) + [3]
    return {"model": "gpt2", "tokens": tokens, "types": types, "merges": merges,
            "bos": vocab_size - 1, "eos": vocab_size - 1}


# byte offsets of the fp16 scale fields in each K-quant super-block (llama.cpp's block_qN_K)
K_F16_FIELDS = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def k_blocks(type_name: str, rows: int, cols: int, seed: int = 0, scale: float = 1e-3) -> np.ndarray:
    """Hand-built K-quant tensor bytes (gguf cannot quantize K types): random quants and
    sub-block scales, fp16 super-block scales in [scale/10, scale]. -> (rows, row_bytes) uint8."""
    rng = np.random.default_rng(seed)
    _, block_bytes = gguf.GGML_QUANT_SIZES[Q[type_name]]
    nb = cols // 256
    b = rng.integers(0, 256, size=(rows, nb, block_bytes), dtype=np.uint8)
    for off in K_F16_FIELDS[type_name]:
        d = rng.uniform(scale / 10, scale, size=(rows, nb)).astype(np.float16)
        b[..., off : off + 2] = d[..., None].view(np.uint8).reshape(rows, nb, 2)
    return b.reshape(rows, nb * block_bytes)


def quantized_bytes(w: np.ndarray, qtype, seed: int = 0) -> np.ndarray:
    """`w` in GGUF type `qtype`: gguf's quantizer where it has one, else hand-built K blocks."""
    if qtype.name in K_F16_FIELDS:
        return k_blocks(qtype.name, w.shape[0], w.shape[1], seed)
    return gguf.quants.quantize(w.astype(np.float32), qtype)


def permute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's Q/K row order: per head, the two RoPE halves interleaved."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama_cpp_tensors(arch: str, config: dict, weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """HF tensors as llama.cpp's converter stores them for `arch`, keyed by HF name."""
    out = {}
    for name, w in weights.items():
        if "rotary_emb" in name:
            continue
        w = np.asarray(w, dtype=np.float32)
        if arch in ("llama", "smollm3") and name.endswith(("q_proj.weight", "q_proj.bias")):
            w = permute_qk(w, config["num_attention_heads"])
        elif arch in ("llama", "smollm3") and name.endswith(("k_proj.weight", "k_proj.bias")):
            w = permute_qk(w, config.get("num_key_value_heads", config["num_attention_heads"]))
        elif arch in ("gemma", "gemma2", "gemma3") and name.endswith("norm.weight"):
            w = w + 1.0
        out[name] = w
    if arch == "phi3":  # fused in the HF checkpoint already (qkv_proj, gate_up_proj): kept as is
        pass
    if arch in ("qwen35", "qwen35moe"):
        out = qwen35_tensors(config, out)
    if arch == "gemma4":
        out = gemma4_tensors(config, out)
    if arch in ("lfm2", "lfm2moe"):  # the convolution as a 2-D (C, K) tensor
        out = {k: (w[:, 0] if k.endswith("conv.conv.weight") else w) for k, w in out.items()}
    if arch == "lfm2moe":
        out = lfm2moe_tensors(config, out)
    if arch in ("qwen3moe", "qwen35moe"):  # one (experts, out, in) tensor per projection and layer (ffn_gate_exps ...)
        n = config.get("num_experts") or config["num_local_experts"]
        for i in range(config["num_hidden_layers"]):
            pre = f"model.layers.{i}.mlp.experts"
            fused = out.pop(f"{pre}.gate_up_proj", None)  # transformers 5's in-memory layout
            if fused is not None:
                half = fused.shape[1] // 2
                out[f"{pre}.gate_proj.weight"], out[f"{pre}.up_proj.weight"] = fused[:, :half], fused[:, half:]
                out[f"{pre}.down_proj.weight"] = out.pop(f"{pre}.down_proj")
            for proj in ("gate_proj", "up_proj", "down_proj"):
                names = [f"{pre}.{e}.{proj}.weight" for e in range(n)]
                if names[0] in out:
                    out[f"{pre}.{proj}.weight"] = np.stack([out.pop(k) for k in names])
    if config.get("tie_word_embeddings", False):
        out.pop("lm_head.weight", None)
    return out


def lfm2moe_tensors(config: dict, weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """LFM2-MoE as llama.cpp's converter writes it: each sparse layer's per-expert w1/w3/w2
    stacked (experts, out, in) into ffn_gate_exps / ffn_up_exps / ffn_down_exps, the expert bias
    as exp_probs_b.bias (GGUF names here)."""
    out, n = dict(weights), config["num_experts"]
    for i in range(config["num_hidden_layers"]):
        pre = f"model.layers.{i}.feed_forward"
        for hf, gg in (("w1", "ffn_gate_exps"), ("w3", "ffn_up_exps"), ("w2", "ffn_down_exps")):
            names = [f"{pre}.experts.{e}.{hf}.weight" for e in range(n)]
            if names[0] in out:
                out[f"blk.{i}.{gg}.weight"] = np.stack([out.pop(k) for k in names])
        if f"{pre}.expert_bias" in out:
            out[f"blk.{i}.exp_probs_b.bias"] = out.pop(f"{pre}.expert_bias")
    return out


def tile_v_heads(a: np.ndarray, axis: int, k_heads: int, per_k: int, dim: int) -> np.ndarray:
    """llama.cpp's value-head reorder along `axis`: grouped by key head (k0v0 k0v1 k1v0 ...) ->
    tiled (k0v0 k1v0 k0v1 ...)."""
    a = np.moveaxis(a, axis, 0)
    rest = a.shape[1:]
    a = a.reshape(k_heads, per_k, dim, *rest).swapaxes(0, 1).reshape(-1, *rest)
    return np.moveaxis(a, 0, axis)


def qwen35_tensors(config: dict, weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Qwen3.5 (dense or MoE) as llama.cpp's converter writes it: value heads tiled where there
    are fewer key heads, A_log as -exp(A_log), dt_bias as dt_proj.bias, conv1d squeezed to
    (C, K), every norm but the delta rule's stored as 1 + w, mtp.* dropped."""
    Hk, Hv = config["linear_num_key_heads"], config["linear_num_value_heads"]
    r, Dk, Dv = Hv // Hk, config["linear_key_head_dim"], config["linear_value_head_dim"]
    qk = 2 * Hk * Dk
    out = {}
    for name, w in weights.items():
        if name.startswith("mtp."):
            continue
        if ".linear_attn." in name and Hk != Hv:
            if name.endswith(("in_proj_qkv.weight", "conv1d.weight")):
                w = np.concatenate([w[:qk], tile_v_heads(w[qk:], 0, Hk, r, Dv)])
            elif name.endswith("in_proj_z.weight"):
                w = tile_v_heads(w, 0, Hk, r, Dv)
            elif name.endswith(("in_proj_a.weight", "in_proj_b.weight", "A_log", "dt_bias")):
                w = tile_v_heads(w, 0, Hk, r, 1)
            elif name.endswith("out_proj.weight"):
                w = tile_v_heads(w, 1, Hk, r, Dv)
        if name.endswith("A_log"):
            w = -np.exp(w)
        elif name.endswith("dt_bias"):
            name = name.replace("dt_bias", "dt_proj.bias")
        elif name.endswith("conv1d.weight"):
            w = w[:, 0]
        elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            w = w + 1.0
        out[name] = w
    return out


def gemma4_tensors(config: dict, weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Gemma 4 as llama.cpp's converter writes it: norms as they are (applied as w), the layer
    scalar and the fused experts under `.weight` names, the router's scale and the per-expert
    scales as `.scale` tensors of ffn_gate_inp / ffn_down_exps (GGUF names here), and the
    full layers' proportional RoPE as rope_freqs (1 on the rotated pairs, 1e30 after)."""
    out = {}
    for name, w in weights.items():
        if name.endswith(("layer_scalar", "experts.gate_up_proj", "experts.down_proj")):
            name += ".weight"
        elif name.endswith(("router.scale", "router.per_expert_scale")):
            i = name.split(".")[2]
            name = f"blk.{i}.ffn_gate_inp.scale" if name.endswith("router.scale") else f"blk.{i}.ffn_down_exps.scale"
        out[name] = w
    full = config["rope_parameters"]["full_attention"]
    if full.get("rope_type") == "proportional":
        rotated = int(config["global_head_dim"] * full["partial_rotary_factor"] / 2)
        out["rope_freqs.weight"] = np.array([1.0] * rotated + [1e30] * (config["global_head_dim"] // 2 - rotated),
                                            np.float32)
    return out


def llama_cpp_config(arch: str, config: dict) -> tuple[dict, dict]:
    """(config as write_gguf reads it, the architecture's own GGUF keys) as llama.cpp's converter
    writes them for `arch`."""
    config, kv = dict(config), {}
    if arch in ("qwen35", "qwen35moe"):
        head_dim = config["head_dim"]
        partial = (config.get("rope_parameters") or {}).get("partial_rotary_factor", 0.25)
        kinds = config["layer_types"]
        every = kinds.index("full_attention") + 1
        assert kinds == ["full_attention" if (i + 1) % every == 0 else "linear_attention"
                         for i in range(len(kinds))], "GGUF stores the layer kinds as an interval"
        kv = {"ssm.conv_kernel": config["linear_conv_kernel_dim"], "ssm.state_size": config["linear_key_head_dim"],
              "ssm.group_count": config["linear_num_key_heads"],
              "ssm.time_step_rank": config["linear_num_value_heads"],
              "ssm.inner_size": config["linear_value_head_dim"] * config["linear_num_value_heads"],
              "full_attention_interval": every, "rope.dimension_count": int(head_dim * partial)}
        if arch == "qwen35moe":
            kv.update({"expert_count": config["num_experts"], "expert_used_count": config["num_experts_per_tok"],
                       "expert_feed_forward_length": config["moe_intermediate_size"],
                       "expert_shared_feed_forward_length": config["shared_expert_intermediate_size"]})
    if arch == "gemma4":
        kinds, n = config["layer_types"], config["num_hidden_layers"]
        swa = [t == "sliding_attention" for t in kinds]
        first_shared = n - config["num_kv_shared_layers"]
        full, local = config["rope_parameters"]["full_attention"], config["rope_parameters"]["sliding_attention"]
        swa_dim = config["head_dim"]
        # transformers 5 writes the full layers' sizes as per_layer_config (the published configs:
        # global_head_dim, num_global_key_value_heads, which llama.cpp's converter reads)
        per = {int(k): v for k, v in (config.get("per_layer_config") or {}).items()}
        config.setdefault("global_head_dim", next(v["head_dim"] for v in per.values()))
        config["head_dim"] = config["global_head_dim"]  # key_length: the full layers'
        config["num_key_value_heads"] = [per.get(i, {}).get("num_key_value_heads", config["num_key_value_heads"])
                                         for i in range(n)]
        if config.get("use_double_wide_mlp"):
            F = config["intermediate_size"]
            config["intermediate_size"] = [F if i < first_shared else 2 * F for i in range(n)]
        config["rope_theta"] = full["rope_theta"]
        kv = {"attention.key_length_swa": swa_dim, "attention.value_length_swa": swa_dim,
              "rope.dimension_count_swa": swa_dim, "rope.freq_base_swa": float(local["rope_theta"]), "rope.dimension_count": config["global_head_dim"],
              "attention.sliding_window": config["sliding_window"], "attention.sliding_window_pattern": swa,
              "attention.shared_kv_layers": config["num_kv_shared_layers"],
              "embedding_length_per_layer_input": config.get("hidden_size_per_layer_input") or 0}
        if config.get("final_logit_softcapping"):
            kv["final_logit_softcapping"] = float(config["final_logit_softcapping"])
        if config.get("enable_moe_block"):
            kv.update({"expert_count": config["num_experts"], "expert_used_count": config["top_k_experts"],
                       "expert_feed_forward_length": config["moe_intermediate_size"]})
    if arch == "lfm2moe":  # the dense width as written; the MoE keys
        config["num_key_value_heads"] = [config["num_key_value_heads"] if t != "conv" else 0
                                         for t in config["layer_types"]]
        config["rms_norm_eps"] = config["norm_eps"]
        kv = {"shortconv.l_cache": config["conv_L_cache"], "expert_count": config["num_experts"],
              "expert_used_count": config["num_experts_per_tok"],
              "expert_feed_forward_length": config["moe_intermediate_size"],
              "leading_dense_block_count": config["num_dense_layers"], "expert_gating_func": 2}
    if arch == "lfm2":
        F = config["intermediate_size"]
        if config.get("block_auto_adjust_ff_dim", True):
            F = int(2 * F / 3)
            if config.get("block_ffn_dim_multiplier") is not None:
                F = int(config["block_ffn_dim_multiplier"] * F)
            m = config["block_multiple_of"]
            F = m * ((F + m - 1) // m)
        config["intermediate_size"] = F
        config["num_key_value_heads"] = [config["num_key_value_heads"] if t != "conv" else 0
                                         for t in config["layer_types"]]
        config["rms_norm_eps"] = config["norm_eps"]
        kv = {"shortconv.l_cache": config["conv_L_cache"]}
    return config, {f"{arch}.{k}": v for k, v in kv.items()}


def write_gguf(path: Path, arch: str, config: dict, weights: dict[str, np.ndarray], tok: dict,
               types: dict[str, int] | None = None, default_type=Q.F32, extra_kv: dict | None = None,
               extra_tensors: dict[str, np.ndarray] | None = None) -> Path:
    """Write a GGUF: `weights` by HF name (already in llama.cpp's layout), `types` per HF name."""
    arch_enum = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch)
    n_layers = config["num_hidden_layers"]
    names = gguf.get_tensor_name_map(arch_enum, n_layers)
    w = gguf.GGUFWriter(str(path), arch)
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    kv_heads = config.get("num_key_value_heads") or heads  # a list: per layer (lfm2)
    w.add_block_count(n_layers)
    w.add_context_length(config.get("max_position_embeddings", 512))
    w.add_embedding_length(config["hidden_size"])
    if config.get("intermediate_size") is not None:  # none where every layer is MoE (qwen35moe)
        w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(config.get("rms_norm_eps", 1e-6))
    rope = config.get("rope_parameters") or {}  # transformers v5 moved rope_theta in here
    rope = rope.get("full_attention", rope)  # Gemma 3: per layer type; GGUF holds the global one
    w.add_rope_freq_base(config.get("rope_theta") or rope.get("rope_theta", 10000.0))
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_vocab_size(config["vocab_size"])
    for key, value in (extra_kv or {}).items():
        if isinstance(value, list):
            w.add_array(key, value)
        elif isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        else:
            w.add_string(key, value)
    w.add_tokenizer_model(tok["model"])
    if tok.get("pre"):
        w.add_tokenizer_pre(tok["pre"])
    w.add_token_list(tok["tokens"])
    w.add_token_types(tok["types"])
    if tok.get("scores") is not None:
        w.add_token_scores(tok["scores"])
    if tok.get("merges"):
        w.add_token_merges(tok["merges"])
    for key, fn in (("bos", w.add_bos_token_id), ("eos", w.add_eos_token_id), ("unk", w.add_unk_token_id),
                    ("pad", w.add_pad_token_id)):
        if tok.get(key) is not None:
            fn(tok[key])
    if tok.get("add_bos") is not None:
        w.add_add_bos_token(tok["add_bos"])
    if tok.get("chat_template"):
        w.add_chat_template(tok["chat_template"])
    for name, arr in weights.items():
        literal = name.startswith("blk.") or name == "rope_freqs.weight"  # already a GGUF name
        gname = name if literal else names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gname is not None, f"gguf has no name for {name} in {arch}"
        qtype = (types or {}).get(name, default_type if arr.ndim == 2 else Q.F32)
        if qtype not in (Q.F32, Q.F16) and arr.shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0]:
            qtype = Q.F32  # rows of no whole number of blocks stay unquantized, as llama.cpp leaves them
        if qtype == Q.F32:
            w.add_tensor(gname, arr.astype(np.float32))
        elif qtype == Q.F16:
            w.add_tensor(gname, arr.astype(np.float16))
        else:
            raw = quantized_bytes(arr, qtype, seed=len(gname))
            w.add_tensor(gname, raw, raw_shape=raw.shape, raw_dtype=qtype)
    for gname, arr in (extra_tensors or {}).items():  # by GGUF name (rope_freqs)
        w.add_tensor(gname, np.asarray(arr, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_llama_gguf(path: Path, seed: int = 0, types: dict | None = None, default_type=Q.F32, **overrides):
    """A tiny random Llama (conftest's) with a byte-level BPE vocabulary, as GGUF. -> path."""
    from conftest import make_tiny_model
    from mlx.utils import tree_flatten

    overrides.setdefault("vocab_size", 272)
    model = make_tiny_model(seed, **overrides)
    config = model.args.to_dict()
    weights = {k: np.array(v) for k, v in tree_flatten(model.parameters())}
    tensors = llama_cpp_tensors("llama", config, weights)
    return write_gguf(path, "llama", config, tensors, gpt2_tokenizer_meta(config["vocab_size"]), types, default_type)
