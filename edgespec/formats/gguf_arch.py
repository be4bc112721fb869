"""Per-architecture GGUF facts: tensor names, config keys and the transforms llama.cpp applied.

llama.cpp's HF->GGUF converter renames tensors (`blk.N.attn_q`) and, for some
architectures, changes their values; reading undoes both so `models/` sees a
Hugging Face checkpoint:
- llama, smollm3: rows of Q and K permuted per head (RoPE pairs interleaved) -> inverted;
- gemma, gemma2, gemma3: RMSNorm weights stored as 1 + w (HF Gemma computes
  x * (1 + w); llama.cpp's norm computes x * w) -> 1 subtracted;
- phi3: QKV and gate/up stay fused (attn_qkv, ffn_up = [gate; up]) as in HF's Phi-3;
- qwen3moe: experts stacked per layer (ffn_gate_exps ...), read as models/qwen3_moe's switch_mlp.
"""

from __future__ import annotations

from typing import Any

from edgespec.errors import ModelLoadError

_ATTN = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LLAMA = {**_ATTN, "ffn_norm": "post_attention_layernorm"}
_QK_NORM = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_GEMMA2 = {
    **_ATTN,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# Mixture of experts: the router and the experts stacked (experts, out, in), as llama.cpp stores them
_MOE = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.switch_mlp.gate_proj",
    "ffn_up_exps": "mlp.switch_mlp.up_proj",
    "ffn_down_exps": "mlp.switch_mlp.down_proj",
}
_PHI3 = {
    "attn_norm": "input_layernorm",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_up": "mlp.gate_up_proj",
    "ffn_down": "mlp.down_proj",
}

# GGUF architecture -> (HF model_type, per-layer names, Q/K permuted, norms stored as 1 + w)
ARCHS: dict[str, tuple[str, dict[str, str], bool, bool]] = {
    "llama": ("llama", _LLAMA, True, False),
    "qwen2": ("qwen2", _LLAMA, False, False),
    "qwen3": ("qwen3", {**_LLAMA, **_QK_NORM}, False, False),
    "qwen3moe": ("qwen3_moe", {**_LLAMA, **_QK_NORM, **_MOE}, False, False),
    "gemma2": ("gemma2", _GEMMA2, False, True),
    "gemma3": ("gemma3_text", {**_GEMMA2, **_QK_NORM}, False, True),
    "phi3": ("phi3", _PHI3, False, False),
    # llama.cpp converts SmolLM3 as Llama (Q/K permuted) and hard-codes its NoPE layers
    # as every 4th, which is also edgespec.models.smollm3's default interval.
    "smollm3": ("smollm3", _LLAMA, True, False),
}
_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def arch_of(arch: str | None, path) -> tuple[str, dict[str, str], bool, bool]:
    if arch not in ARCHS:
        raise ModelLoadError(
            f"{path}: GGUF architecture {arch!r} is not supported (supported: {', '.join(ARCHS)})"
        )
    return ARCHS[arch]


def hf_name(gguf_name: str, arch: str = "llama") -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight` for `arch`."""
    layer_map = ARCHS.get(arch, ARCHS["llama"])[1]
    base, _, kind = gguf_name.rpartition(".")  # kind: weight | bias
    if base.startswith("blk."):
        _, idx, part = base.split(".", 2)
        if part not in layer_map:
            raise ModelLoadError(f"unexpected GGUF tensor {gguf_name!r} for architecture {arch}")
        return f"model.layers.{idx}.{layer_map[part]}.{kind}"
    if base not in _TOP:
        raise ModelLoadError(f"unexpected GGUF tensor {gguf_name!r} for architecture {arch}")
    return f"{_TOP[base]}.{kind}"


def is_norm(hf: str) -> bool:
    return hf.endswith(("norm.weight", "layernorm.weight"))


def arch_config(arch: str, g, cfg: dict[str, Any]) -> None:
    """Add the architecture's own HF config keys; `g(key, default)` reads `{arch}.{key}`."""
    if arch in ("gemma2", "gemma3"):
        cfg["hidden_activation"] = "gelu_pytorch_tanh"
        cfg["sliding_window"] = int(g("attention.sliding_window", 4096))
        head_dim = cfg["head_dim"]
        # The query scale is not stored; llama.cpp uses 1/sqrt(head_dim), except for the 27B
        # models (46 layers Gemma 2, 62 layers Gemma 3), which scale by 1/sqrt(hidden/heads).
        big = cfg["num_hidden_layers"] == (46 if arch == "gemma2" else 62)
        cfg["query_pre_attn_scalar"] = cfg["hidden_size"] // cfg["num_attention_heads"] if big else head_dim
    if arch == "gemma2":
        cfg["attn_logit_softcapping"] = float(g("attn_logit_softcapping", 50.0))
        cfg["final_logit_softcapping"] = float(g("final_logit_softcapping", 30.0))
    if arch == "gemma3":
        # llama.cpp hard-codes these for Gemma 3: every 6th layer global, local RoPE base 10k.
        cfg["sliding_window_pattern"] = 6
        cfg["rope_local_base_freq"] = 10000.0
        cfg["final_logit_softcapping"] = None
        cfg["attn_logit_softcapping"] = None
    if arch == "qwen3moe":
        # llama.cpp runs every layer sparse and renormalises the top-k weights unless told
        # otherwise (expert_weights_norm); Qwen3-MoE checkpoints do both (norm_topk_prob true).
        cfg["num_experts"] = int(g("expert_count"))
        cfg["num_experts_per_tok"] = int(g("expert_used_count"))
        cfg["moe_intermediate_size"] = int(g("expert_feed_forward_length"))
        cfg["norm_topk_prob"] = bool(g("expert_weights_norm", True))
        cfg["decoder_sparse_step"], cfg["mlp_only_layers"] = 1, []
    if arch == "phi3":
        window = g("attention.sliding_window")
        if window is not None:
            cfg["sliding_window"] = int(window)
        rot = g("rope.dimension_count")
        if rot is not None and int(rot) != cfg["head_dim"]:
            cfg["partial_rotary_factor"] = int(rot) / cfg["head_dim"]
