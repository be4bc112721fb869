"""GGUF facts of the newer families (Qwen3.5 dense and MoE, LFM2, Gemma 4): their config keys and
the value transforms llama.cpp's converter applied (names: gguf_arch.py; the list of what
llama.cpp changes: gguf_arch's docstring)."""

from __future__ import annotations

from typing import Any

import numpy as np

from edgespec.errors import ModelLoadError


def dense_only(arch: str, hf: str) -> bool:
    """Tensors read dense even when quantized ones are kept: their transform moves columns
    (the value-head reorder of out_proj) or reshapes them (convolution weights)."""
    if arch in ("qwen35", "qwen35moe"):
        return ".linear_attn." in hf
    return arch in ("lfm2", "lfm2moe") and hf.endswith("conv.conv.weight")


def _untile_v_heads(a, axis: int, k_heads: int, per_k: int, dim: int):
    """Inverse of llama.cpp's value-head reorder along `axis`: (per_k, k_heads, dim) tiled ->
    (k_heads, per_k, dim) grouped by key head, as Hugging Face stores them."""
    a = np.moveaxis(a, axis, 0)
    rest = a.shape[1:]
    a = a.reshape(per_k, k_heads, dim, *rest).swapaxes(0, 1).reshape(per_k * k_heads * dim, *rest)
    return np.moveaxis(a, 0, axis)


def undo_values(arch: str, hf: str, a, cfg: dict[str, Any]):
    """A dense GGUF tensor (HF name `hf`) -> the HF tensor: the value transforms llama.cpp applied."""
    if arch in ("lfm2", "lfm2moe") and hf.endswith("conv.conv.weight"):
        return a.reshape(a.shape[0], 1, -1)  # (C, K) -> HF's (C, 1, K)
    if arch not in ("qwen35", "qwen35moe"):
        return a
    if hf.endswith("mlp.shared_expert_gate.weight"):
        return a.reshape(1, -1)
    if ".linear_attn." not in hf:
        return a
    if hf.endswith("A_log"):
        a = np.log(-a.astype(np.float64)).astype(np.float32)  # stored as -exp(A_log)
    if hf.endswith("conv1d.weight"):
        a = a.reshape(a.shape[0], -1)
    Hk, Hv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    if Hk != Hv:
        r, Dk, Dv = Hv // Hk, cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
        qk = 2 * Hk * Dk
        if hf.endswith(("in_proj_qkv.weight", "conv1d.weight")):  # q and k rows stay; v rows reordered
            a = np.concatenate([a[:qk], _untile_v_heads(a[qk:], 0, Hk, r, Dv)])
        elif hf.endswith("in_proj_z.weight"):
            a = _untile_v_heads(a, 0, Hk, r, Dv)
        elif hf.endswith(("in_proj_a.weight", "in_proj_b.weight", "A_log", "dt_bias")):
            a = _untile_v_heads(a, 0, Hk, r, 1)
        elif hf.endswith("out_proj.weight"):
            a = _untile_v_heads(a, 1, Hk, r, Dv)
    if hf.endswith("conv1d.weight"):
        a = a[:, None, :]  # (C, K) -> HF's (C, 1, K)
    return a


def gemma4_config(g, cfg: dict[str, Any], names: set[str], rope_freqs, path) -> None:
    """Gemma 4's HF config from llama.cpp's keys: the full layers' head size and KV heads are
    the main entries, the sliding layers' the _swa ones and the per-layer lists."""
    n = cfg["num_hidden_layers"]
    sliding = g("attention.sliding_window_pattern")
    if not isinstance(sliding, list) or len(sliding) != n:
        raise ModelLoadError(f"{path}: gemma4 GGUF lacks attention.sliding_window_pattern (one flag per layer)")
    types = ["sliding_attention" if s else "full_attention" for s in sliding]
    full_dim, swa_dim = cfg["head_dim"], int(g("attention.key_length_swa", cfg["head_dim"]))
    kv = g("attention.head_count_kv")
    kv = kv if isinstance(kv, list) else [kv] * n
    ff = g("feed_forward_length")
    ff = ff if isinstance(ff, list) else [ff] * n
    shared = int(g("attention.shared_kv_layers", 0))
    first_shared = n - shared
    wide = shared > 0 and all(int(ff[i]) == 2 * int(ff[0]) for i in range(first_shared, n))
    if any(int(f) != int(ff[0]) for f in ff[:first_shared]) or (not wide and len(set(ff)) > 1):
        raise ModelLoadError(f"{path}: gemma4 feed_forward_length {ff} is neither one width nor double-wide "
                             "shared layers")
    swa_rot = g("rope.dimension_count_swa")
    if swa_rot is not None and int(swa_rot) != swa_dim:
        raise ModelLoadError(f"{path}: gemma4 sliding layers rotating {swa_rot} of {swa_dim} dims is not supported")
    cfg.update(
        head_dim=swa_dim, layer_types=types, intermediate_size=int(ff[0]), use_double_wide_mlp=wide,
        num_key_value_heads=int(next((k for k, t in zip(kv, types, strict=True) if t == "sliding_attention"), kv[0])),
        per_layer_config={i: {"head_dim": full_dim, "num_key_value_heads": int(kv[i])}
                          for i, t in enumerate(types) if t == "full_attention"},
        num_kv_shared_layers=shared, sliding_window=int(g("attention.sliding_window")),
        hidden_size_per_layer_input=int(g("embedding_length_per_layer_input", 0)),
        final_logit_softcapping=g("final_logit_softcapping"), hidden_activation="gelu_pytorch_tanh",
        rope_local_base_freq=float(g("rope.freq_base_swa", 10000.0)),
        # a full layer whose values are its keys' projection has no attn_v
        attention_k_eq_v=any(t == "full_attention" and f"blk.{i}.attn_k.weight" in names
                             and f"blk.{i}.attn_v.weight" not in names for i, t in enumerate(types)))
    if rope_freqs is not None:  # proportional RoPE: 1 on the rotated pairs, 1e30 on the others
        rotated = int((rope_freqs < 1e20).sum())
        cfg.update(full_rope_type="proportional", full_partial_rotary_factor=2 * rotated / full_dim)
    else:
        cfg.update(full_rope_type="default", full_partial_rotary_factor=1.0)
    if "blk.0.ffn_gate_inp.weight" in names:
        cfg.update(enable_moe_block=True, num_experts=int(g("expert_count")), top_k_experts=int(g("expert_used_count")),
                   moe_intermediate_size=int(g("expert_feed_forward_length")))



def qwen35_config(arch: str, g, cfg: dict[str, Any]) -> None:
    """Qwen3.5's Gated DeltaNet sizes from the ssm.* keys, the layer kinds from the full-attention
    interval, the rotary fraction from the rotated dims; the MoE sizes for qwen35moe."""
    Hv, Hk = int(g("ssm.time_step_rank")), int(g("ssm.group_count"))
    cfg.update(linear_conv_kernel_dim=int(g("ssm.conv_kernel")), linear_key_head_dim=int(g("ssm.state_size")),
               linear_num_key_heads=Hk, linear_num_value_heads=Hv,
               linear_value_head_dim=int(g("ssm.inner_size")) // Hv)
    every = int(g("full_attention_interval", 4))
    cfg["layer_types"] = ["full_attention" if (i + 1) % every == 0 else "linear_attention"
                          for i in range(cfg["num_hidden_layers"])]
    rot = g("rope.dimension_count")
    if rot is not None:
        cfg["partial_rotary_factor"] = int(rot) / cfg["head_dim"]
    if arch == "qwen35moe":
        cfg["num_experts"] = int(g("expert_count"))
        cfg["num_experts_per_tok"] = int(g("expert_used_count"))
        cfg["moe_intermediate_size"] = int(g("expert_feed_forward_length"))
        cfg["shared_expert_intermediate_size"] = int(g("expert_shared_feed_forward_length", 0))
        cfg["norm_topk_prob"] = bool(g("expert_weights_norm", True))
        cfg.pop("intermediate_size", None)


def lfm2moe_config(g, cfg: dict[str, Any]) -> None:
    """LFM2-MoE's expert sizes, its dense layers' count and its router: llama.cpp runs it with
    sigmoid scores and the top-k weights renormalised (expert_weights_norm, expert_weights_scale
    read where a GGUF has them); whether the expert bias is present is read off the tensors."""
    gating = int(g("expert_gating_func", 2))
    if gating != 2:
        raise ModelLoadError(f"lfm2moe GGUF: expert_gating_func {gating} is not supported (LFM2-MoE's router "
                             "is sigmoid, 2)")
    cfg.pop("block_auto_adjust_ff_dim", None)  # LFM2-MoE takes the dense width as written anyway
    cfg.update(num_experts=int(g("expert_count")), num_experts_per_tok=int(g("expert_used_count")),
               moe_intermediate_size=int(g("expert_feed_forward_length")),
               num_dense_layers=int(g("leading_dense_block_count", 0)),
               norm_topk_prob=bool(g("expert_weights_norm", True)),
               routed_scaling_factor=float(g("expert_weights_scale", 1.0) or 1.0))
