"""Per-architecture GGUF facts: tensor names, config keys and the transforms llama.cpp applied.

llama.cpp's HF->GGUF converter renames tensors (`blk.N.attn_q`) and, for some
architectures, changes their values; reading undoes both so `models/` sees a
Hugging Face checkpoint:
- llama, smollm3: rows of Q and K permuted per head (RoPE pairs interleaved) -> inverted;
- gemma, gemma2, gemma3: RMSNorm weights stored as 1 + w (HF Gemma computes
  x * (1 + w); llama.cpp's norm computes x * w) -> 1 subtracted;
- phi3: QKV and gate/up stay fused (attn_qkv, ffn_up = [gate; up]) as in HF's Phi-3;
- qwen3moe: experts stacked per layer (ffn_gate_exps ...), read as models/qwen3_moe's switch_mlp;
- qwen35, qwen35moe (Qwen3.5, llama.cpp's Qwen3_5TextModel / Qwen3_5MoeTextModel): the (1 + w)
  norms stored as 1 + w (not the delta rule's gated norm, ssm_norm); A_log stored as
  -exp(A_log) (ssm_a); dt_bias named ssm_dt.bias; conv1d weights squeezed to (C, K); and,
  where there are fewer key heads than value heads, the value heads reordered from grouped by
  key head (HF: k0v0 k0v1 k1v0 k1v1) to tiled (k0v0 k1v0 k0v1 k1v1) in every tensor that has
  them (in_proj_qkv's v rows, in_proj_z, in_proj_a/b, A_log, dt_bias, the conv's v channels,
  out_proj's columns); MTP layers (nextn_predict_layers) appended as extra blocks, skipped;
- lfm2: the short convolution's weight squeezed to (C, K); key/value heads per layer (0 on
  convolution layers), which is how the layer kinds are told;
- lfm2moe (LFM2-MoE): as lfm2, with the experts stacked (ffn_gate_exps ...), the router as
  ffn_gate_inp and the expert bias as exp_probs_b.bias; the dense layers' count as
  leading_dense_block_count, the sigmoid router as expert_gating_func (2);
- gemma4 (llama.cpp's Gemma4Model, text part): norms as stored (Gemma 4 applies w); the
  router's scale and the per-expert scales as `.scale` tensors (ffn_gate_inp.scale,
  ffn_down_exps.scale); the experts' gate/up fused as in HF (ffn_gate_up_exps); full layers'
  head size and key/value heads as the main attention.key_length / head_count_kv entries
  (sliding layers': key_length_swa and the per-layer head_count_kv list); proportional RoPE as
  a rope_freqs tensor (1 on the rotated pairs, 1e30 on the rest).
"""

from __future__ import annotations

from typing import Any

from edgespec.errors import ModelLoadError
from edgespec.weights.formats.gguf_hybrid import lfm2moe_config, qwen35_config

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
_QWEN35 = {
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    **_QK_NORM,
    "attn_qkv": "linear_attn.in_proj_qkv",
    "attn_gate": "linear_attn.in_proj_z",
    "ssm_alpha": "linear_attn.in_proj_a",
    "ssm_beta": "linear_attn.in_proj_b",
    "ssm_out": "linear_attn.out_proj",
    "ssm_norm": "linear_attn.norm",
    "ssm_conv1d": "linear_attn.conv1d",
    "ssm_a": "linear_attn.A_log",  # leaf: no .weight
    "ssm_dt": "linear_attn.dt_bias",  # ssm_dt.bias -> the leaf dt_bias
}
_QWEN35_DENSE = {**_QWEN35, "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_SHARED_EXPERT = {
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
_GEMMA4 = {
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    **_QK_NORM,
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "inp_gate": "per_layer_input_gate",
    "proj": "per_layer_projection",
    "post_norm": "post_per_layer_input_norm",
    "ffn_gate_inp": "router.proj",
    "pre_ffw_norm_2": "pre_feedforward_layernorm_2",
    "post_ffw_norm_1": "post_feedforward_layernorm_1",
    "post_ffw_norm_2": "post_feedforward_layernorm_2",
}
# (GGUF part, suffix) -> an HF parameter that is not `{module}.{suffix}`
LEAVES = {
    ("ssm_a", ""): "linear_attn.A_log",
    ("ssm_dt", "bias"): "linear_attn.dt_bias",
    ("layer_output_scale", "weight"): "layer_scalar",
    ("ffn_gate_inp", "scale"): "router.scale",
    ("ffn_down_exps", "scale"): "router.per_expert_scale",
    ("ffn_gate_up_exps", "weight"): "experts.gate_up_proj",  # (experts, 2F, E), gate first, as HF
    ("ffn_down_exps", "weight"): "experts.down_proj",
    ("exp_probs_b", "bias"): "feed_forward.expert_bias",  # lfm2moe: a leaf, selection only
}
_LEAVES_OF = {"qwen35": ("ssm_a", "ssm_dt"), "qwen35moe": ("ssm_a", "ssm_dt"),
              "lfm2moe": ("exp_probs_b",),
              "gemma4": ("layer_output_scale", "ffn_gate_inp", "ffn_down_exps", "ffn_gate_up_exps")}
# llama.cpp's --fuse-gate-up-exps: one (experts, 2F, E) tensor, gate rows first (as transformers
# keeps them in memory), which models/experts.stack_experts splits
_FUSED_EXPERTS = {"ffn_gate_up_exps": "mlp.experts.gate_up_proj"}
_LFM2 = {
    "attn_norm": "operator_norm",
    "ffn_norm": "ffn_norm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.out_proj",
    "attn_q_norm": "self_attn.q_layernorm",
    "attn_k_norm": "self_attn.k_layernorm",
    "shortconv.conv": "conv.conv",
    "shortconv.in_proj": "conv.in_proj",
    "shortconv.out_proj": "conv.out_proj",
    "ffn_gate": "feed_forward.w1",
    "ffn_up": "feed_forward.w3",
    "ffn_down": "feed_forward.w2",
}
_LFM2MOE = {**_LFM2, "ffn_gate_inp": "feed_forward.gate", "ffn_gate_exps": "feed_forward.switch_mlp.gate_proj",
            "ffn_up_exps": "feed_forward.switch_mlp.up_proj", "ffn_down_exps": "feed_forward.switch_mlp.down_proj"}
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
    "qwen35": ("qwen3_5_text", _QWEN35_DENSE, False, True),
    "qwen35moe": ("qwen3_5_moe_text", {**_QWEN35, **_MOE, **_SHARED_EXPERT}, False, True),
    "lfm2": ("lfm2", _LFM2, False, False),
    "lfm2moe": ("lfm2_moe", _LFM2MOE, False, False),
    "gemma4": ("gemma4_text", _GEMMA4, False, False),
}
_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_TOP_OF = {"lfm2": {"token_embd_norm": "model.embedding_norm"},  # LFM2's final norm, named so in HF
           "lfm2moe": {"token_embd_norm": "model.embedding_norm"},
           "gemma4": {"per_layer_token_embd": "model.embed_tokens_per_layer",
                      "per_layer_model_proj": "model.per_layer_model_projection",
                      "per_layer_proj_norm": "model.per_layer_projection_norm"}}


def arch_of(arch: str | None, path) -> tuple[str, dict[str, str], bool, bool]:
    if arch not in ARCHS:
        raise ModelLoadError(
            f"{path}: GGUF architecture {arch!r} is not supported (supported: {', '.join(ARCHS)})"
        )
    return ARCHS[arch]


def hf_name(gguf_name: str, arch: str = "llama") -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight` for `arch`."""
    layer_map = ARCHS.get(arch, ARCHS["llama"])[1]
    base, _, kind = gguf_name.rpartition(".")  # kind: weight | bias | scale
    if kind not in ("weight", "bias", "scale"):  # a bare parameter (blk.N.ssm_a)
        base, kind = gguf_name, ""
    top = {**_TOP, **_TOP_OF.get(arch, {})}
    if base.startswith("blk."):
        _, idx, part = base.split(".", 2)
        if part in _LEAVES_OF.get(arch, ()) and (part, kind) in LEAVES:
            return f"model.layers.{idx}.{LEAVES[part, kind]}"
        if part in _FUSED_EXPERTS and kind == "weight" and arch == "qwen35moe":
            return f"model.layers.{idx}.{_FUSED_EXPERTS[part]}"
        if part not in layer_map or kind not in ("weight", "bias"):
            raise ModelLoadError(f"unexpected GGUF tensor {gguf_name!r} for architecture {arch}")
        return f"model.layers.{idx}.{layer_map[part]}.{kind}"
    if base not in top or kind not in ("weight", "bias"):
        raise ModelLoadError(f"unexpected GGUF tensor {gguf_name!r} for architecture {arch}")
    return f"{top[base]}.{kind}"


def is_norm(hf: str, arch: str = "llama") -> bool:
    """Norm weights llama.cpp stored as 1 + w for architectures that apply (1 + w)."""
    if arch in ("qwen35", "qwen35moe") and hf.endswith("linear_attn.norm.weight"):
        return False  # the delta rule's gated output norm applies w
    return hf.endswith(("norm.weight", "layernorm.weight"))


def block_of(gguf_name: str) -> int | None:
    return int(gguf_name.split(".")[1]) if gguf_name.startswith("blk.") else None


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
    if arch in ("qwen35", "qwen35moe"):
        qwen35_config(arch, g, cfg)
    if arch in ("lfm2", "lfm2moe"):
        kv = g("attention.head_count_kv")
        kinds = kv if isinstance(kv, list) else [kv] * cfg["num_hidden_layers"]
        cfg["layer_types"] = ["full_attention" if int(h) else "conv" for h in kinds]
        cfg["num_key_value_heads"] = max(int(h) for h in kinds) or cfg["num_attention_heads"]
        cfg["conv_L_cache"] = int(g("shortconv.l_cache"))
        cfg["norm_eps"] = cfg.pop("rms_norm_eps")
        cfg["block_auto_adjust_ff_dim"] = False  # the stored width is the adjusted one
    if arch == "lfm2moe":
        lfm2moe_config(g, cfg)
    if arch == "phi3":
        window = g("attention.sliding_window")
        if window is not None:
            cfg["sliding_window"] = int(window)
        rot = g("rope.dimension_count")
        if rot is not None and int(rot) != cfg["head_dim"]:
            cfg["partial_rotary_factor"] = int(rot) / cfg["head_dim"]

