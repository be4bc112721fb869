"""Per-architecture GGUF reading: a tiny Hugging Face checkpoint (transformers, from_config) written
to GGUF the way llama.cpp's converter stores it loads with the same logits as the HF folder, and
matches transformers' own forward (logits, 32 greedy tokens in plain and auto)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from conftest import make_tiny_tokenizer
from gguf_support import gpt2_tokenizer_meta, llama_cpp_config, llama_cpp_tensors, write_gguf

from edgespec.weights.formats.gguf_arch import ARCHS
from edgespec.weights.loader import load_gguf, load_hf_folder

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

V = 272
BASE = dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=50000.0,
            initializer_range=0.1)

QWEN35 = dict(head_dim=16, num_hidden_layers=4, full_attention_interval=2, linear_num_key_heads=2,
              linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12, linear_conv_kernel_dim=3)
# GGUF architecture -> (transformers config class, its extra settings, extra GGUF metadata)
CASES = {
    "llama": ("LlamaConfig", dict(tie_word_embeddings=False), {}),
    # llama.cpp writes Mistral (no sliding window: v0.2 and later) as a "llama" GGUF
    "mistral": ("MistralConfig", dict(tie_word_embeddings=False, sliding_window=None), {}),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True), {}),
    "qwen3": ("Qwen3Config", dict(head_dim=32, tie_word_embeddings=True), {}),
    "gemma2": ("Gemma2Config", dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=4,
                                    attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                                    hidden_activation="gelu_pytorch_tanh"),
               {"gemma2.attention.sliding_window": 4, "gemma2.attn_logit_softcapping": 50.0,
                "gemma2.final_logit_softcapping": 30.0}),
    "gemma3": ("Gemma3TextConfig", dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=4,
                                        num_hidden_layers=6, rope_theta=1_000_000.0,
                                        rope_local_base_freq=10000.0, sliding_window_pattern=6,
                                        hidden_activation="gelu_pytorch_tanh"),
               {"gemma3.attention.sliding_window": 4}),
    "smollm3": ("SmolLM3Config", dict(num_hidden_layers=4, tie_word_embeddings=True, pad_token_id=0), {}),
    "phi3": ("Phi3Config", dict(num_key_value_heads=4, tie_word_embeddings=False, pad_token_id=0,
                                sliding_window=None), {"phi3.rope.dimension_count": 16}),
    # 8 experts, 2 active per token, every layer sparse (as llama.cpp runs it)
    "qwen3moe": ("Qwen3MoeConfig", dict(head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                        norm_topk_prob=True, tie_word_embeddings=False),
                 {"qwen3moe.expert_count": 8, "qwen3moe.expert_used_count": 2,
                  "qwen3moe.expert_feed_forward_length": 32}),
    # Qwen3.5: delta-rule and gated-attention layers (every 2nd), 2 key heads for 4 value heads
    # (llama.cpp reorders the value heads); its metadata from gguf_support.llama_cpp_config
    "qwen35": ("Qwen3_5TextConfig", dict(QWEN35, tie_word_embeddings=False), {}),
    "qwen35moe": ("Qwen3_5MoeTextConfig", dict(QWEN35, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                               shared_expert_intermediate_size=48, tie_word_embeddings=True), {}),
    # sliding (head 16, 2 KV heads) and full (head 32, 1 KV head, k = v, proportional RoPE) layers;
    # the last two share KV, double-wide MLPs; per-layer inputs; the MoE block; soft-capped logits
    "gemma4": ("Gemma4TextConfig", dict(
        head_dim=16, global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True, num_hidden_layers=6,
        num_kv_shared_layers=2, hidden_size_per_layer_input=8, vocab_size_per_layer_input=V, enable_moe_block=True,
        num_experts=4, top_k_experts=2, moe_intermediate_size=32, use_double_wide_mlp=True,
        final_logit_softcapping=30.0, sliding_window=4, layer_types=["sliding_attention", "full_attention"] * 3,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 5000.0},
                         "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.5,
                                            "rope_theta": 200000.0}}), {}),
    "lfm2": ("Lfm2Config", dict(num_hidden_layers=4, layer_types=["conv", "full_attention", "conv", "full_attention"],
                                conv_L_cache=3, block_multiple_of=16, pad_token_id=0), {}),
}


GGUF_ARCH = {"mistral": "llama"}  # case -> the GGUF architecture llama.cpp writes it as


def _hf_checkpoint(arch: str, folder, with_model: bool = False):
    cls_name, extra, _ = CASES[arch]
    kw = {**BASE, **extra}
    if cls_name == "Qwen3_5MoeTextConfig":
        kw.pop("intermediate_size")  # no dense MLP
    if "rope_parameters" in extra:
        kw.pop("rope_theta")
    cfg = getattr(transformers, cls_name)(**kw)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # norms (and dt_bias) away from their init so a missed 1+w (or reorder) would show
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "dt_bias", "router.scale", "per_expert_scale", "layer_scalar")):
                p.add_(torch.randn_like(p) * 0.3)
    model.save_pretrained(folder, safe_serialization=True)
    make_tiny_tokenizer(64).save(folder)
    config = cfg.to_dict()
    weights = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    return (config, weights, model) if with_model else (config, weights)


def _write(tmp_path, arch: str, config, weights, **kw):
    g = GGUF_ARCH.get(arch, arch)
    config, kv = llama_cpp_config(g, config)
    return write_gguf(tmp_path / f"{arch}.gguf", g, config, llama_cpp_tensors(g, config, weights),
                      gpt2_tokenizer_meta(V), extra_kv={**kv, **CASES[arch][2]}, **kw)


@pytest.mark.parametrize("arch", list(CASES))
def test_gguf_and_hf_folder_give_the_same_logits(tmp_path, arch):
    from edgespec.models import ARCHITECTURES

    assert ARCHS[GGUF_ARCH.get(arch, arch)][0] in ARCHITECTURES
    config, weights = _hf_checkpoint(arch, tmp_path / "hf")
    path = _write(tmp_path, arch, config, weights)
    hf = load_hf_folder(tmp_path / "hf")
    gg = load_gguf(path)
    assert type(gg.model) is type(hf.model)
    ids = mx.array([[3, 17, 250, 9, 41, 41, 7, 100, 3, 12, 200, 5]])
    a, b = np.array(gg.model(ids)), np.array(hf.model(ids))
    assert np.abs(b).max() > 0
    assert np.abs(a - b).max() <= 1e-4 * np.abs(b).max(), arch


GREEDY_PROMPT = [3, 17, 250, 9, 41, 41, 7, 100, 3, 12, 200, 5, 66, 130, 22, 9]


@pytest.mark.parametrize("arch", list(CASES))
def test_gguf_matches_transformers(tmp_path, arch):
    """The GGUF written from a transformers checkpoint (RoPE base 50000, not the default) gives
    transformers' last-token logits (1e-4 relative) and its 32 greedy tokens, in plain and auto."""
    import edgespec

    config, weights, ref = _hf_checkpoint(arch, tmp_path / "hf", with_model=True)
    eos = V - 1  # gpt2_tokenizer_meta's EOS
    with torch.no_grad():
        want_logits = ref(torch.tensor([GREEDY_PROMPT])).logits[0, -1].numpy()
        out = ref.generate(torch.tensor([GREEDY_PROMPT]), max_new_tokens=32, do_sample=False,
                           eos_token_id=eos, pad_token_id=0,
                           attention_mask=torch.ones(1, len(GREEDY_PROMPT), dtype=torch.long))
    want = out[0, len(GREEDY_PROMPT):].tolist()
    # no early EOS; the logits check below covers the cases (qwen2, gemma2 here) whose random
    # weights settle on one repeated token
    assert len(want) == 32, want
    engine = edgespec.load(_write(tmp_path, arch, config, weights), drafter="none", progress=False,
                           history="off")
    got_logits = np.array(engine.model(mx.array([GREEDY_PROMPT]))[0, -1])
    err = float(np.abs(got_logits - want_logits).max() / np.abs(want_logits).max())
    assert err < 1e-4, f"relative error {err:.2e}"
    for mode in ("plain", "auto"):
        assert engine.generate(GREEDY_PROMPT, max_tokens=32, mode=mode).tokens == want, mode


@pytest.mark.parametrize("arch", ["llama", "gemma3", "phi3"])
def test_quantized_gguf_kept_quantized_equals_dequantized(tmp_path, arch):
    """Q8_0 tensors kept as MLX 8-bit (phi3: fused QKV and gate/up split by rows while packed)
    give the logits of the same GGUF dequantized."""
    from edgespec.models import ARCHITECTURES
    from gguf_support import Q

    assert ARCHS[arch][0] in ARCHITECTURES
    config, weights = _hf_checkpoint(arch, tmp_path / "hf")
    path = _write(tmp_path, arch, config, weights, default_type=Q.Q8_0)
    dense, kept = load_gguf(path), load_gguf(path, keep_quantized=True)
    assert kept.model.layers[0].self_attn.o_proj.bits == 8
    ids = mx.array([[3, 17, 250, 9, 41, 41, 7, 100]])
    a, b = np.array(kept.model(ids)), np.array(dense.model(ids))
    assert np.abs(a - b).max() <= 1e-5 * np.abs(b).max()


def _rope_freqs(theta, dims, factor, low, high, old_ctx):
    """llama.cpp's converter's rope_freqs for Llama 3 scaling, written out per frequency."""
    import math

    out = []
    for i in range(0, dims, 2):
        wavelen = 2 * math.pi * theta ** (i / dims)
        if wavelen < old_ctx / high:
            out.append(1.0)
        elif wavelen > old_ctx / low:
            out.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, np.float32)


@pytest.mark.parametrize("factor", [8.0, 32.0])
def test_llama3_rope_scaling_from_rope_freqs(tmp_path, factor):
    """Llama 3.1/3.2 GGUFs carry their RoPE scaling only as the rope_freqs tensor."""
    scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    cfg = transformers.LlamaConfig(**{**BASE, "rope_theta": 500000.0, "max_position_embeddings": 131072,
                                      "rope_scaling": scaling, "tie_word_embeddings": True})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    model.save_pretrained(tmp_path / "hf", safe_serialization=True)
    make_tiny_tokenizer(64).save(tmp_path / "hf")
    config = cfg.to_dict()
    weights = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    freqs = _rope_freqs(500000.0, 16, factor, 1.0, 4.0, 8192)
    assert 1.0 in freqs and factor in freqs and ((freqs > 1) & (freqs < factor)).any()  # all three bands
    path = write_gguf(tmp_path / "l3.gguf", "llama", config, llama_cpp_tensors("llama", config, weights),
                      gpt2_tokenizer_meta(V), extra_tensors={"rope_freqs.weight": freqs})
    gg, hf = load_gguf(path), load_hf_folder(tmp_path / "hf")
    assert gg.model.args.rope_scaling["factor"] == factor
    ids = mx.array([[3, 17, 250, 9, 41, 41, 7, 100, 3, 12, 200, 5]])
    positions = mx.array([0, 1, 2, 3, 4, 5, 6, 7, 5000, 5001, 9000, 9001])  # far positions: long wavelengths
    a, b = np.array(gg.model(ids, positions=positions)), np.array(hf.model(ids, positions=positions))
    assert np.abs(a - b).max() <= 1e-4 * np.abs(b).max()
    # and the scaling matters: without it the logits differ
    plain = load_gguf(write_gguf(tmp_path / "plain.gguf", "llama", config,
                                 llama_cpp_tensors("llama", config, weights), gpt2_tokenizer_meta(V)))
    assert np.abs(np.array(plain.model(ids, positions=positions)) - b).max() > 1e-3 * np.abs(b).max()


def test_rope_freqs_of_no_known_scaling_are_refused(tmp_path):
    from edgespec.errors import ModelLoadError

    config, weights = _hf_checkpoint("llama", tmp_path / "hf")
    odd = np.linspace(1, 3, 8).astype(np.float32)
    path = write_gguf(tmp_path / "odd.gguf", "llama", config, llama_cpp_tensors("llama", config, weights),
                      gpt2_tokenizer_meta(V), extra_tensors={"rope_freqs.weight": odd})
    with pytest.raises(ModelLoadError, match="rope_freqs match no Llama 3 RoPE scaling"):
        load_gguf(path)


def test_phi3_longrope_from_its_factor_tensors(tmp_path):
    """Phi-3 128k / 3.5: LongRoPE's factor lists are GGUF tensors, the original context metadata."""
    import math

    from edgespec.models import ARCHITECTURES

    if "phi3" not in ARCHITECTURES:
        pytest.skip("edgespec.models has no phi3 yet")
    rng = np.random.default_rng(0)
    short, long = (1 + rng.random(8) * 3).round(3).tolist(), (1 + rng.random(8) * 20).round(3).tolist()
    cfg = transformers.Phi3Config(**{**BASE, **CASES["phi3"][1], "max_position_embeddings": 4096,
                                     "original_max_position_embeddings": 64,
                                     "rope_scaling": {"type": "longrope", "short_factor": short, "long_factor": long}})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    model.save_pretrained(tmp_path / "hf", safe_serialization=True)
    make_tiny_tokenizer(64).save(tmp_path / "hf")
    config = {**cfg.to_dict(), "max_position_embeddings": 4096}
    weights = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    attn = math.sqrt(1 + math.log(4096 / 64) / math.log(64))  # what llama.cpp's converter stores
    kv = {**CASES["phi3"][2], "phi3.rope.scaling.original_context_length": 64, "phi3.rope.scaling.attn_factor": attn}
    path = write_gguf(tmp_path / "p.gguf", "phi3", config, llama_cpp_tensors("phi3", config, weights),
                      gpt2_tokenizer_meta(V), extra_kv=kv,
                      extra_tensors={"rope_factors_long.weight": np.array(long), "rope_factors_short.weight": np.array(short)})
    gg, hf = load_gguf(path), load_hf_folder(tmp_path / "hf")
    assert gg.context_length == hf.context_length == 64  # edgespec runs LongRoPE within the original context
    assert gg.model.args.rope_scaling["short_factor"] == pytest.approx(short)
    ids = mx.array([[3, 17, 250, 9, 41, 41, 7, 100, 3, 12, 200, 5]])
    positions = mx.array([0, 1, 2, 3, 4, 5, 30, 31, 50, 51, 62, 63])
    a, b = np.array(gg.model(ids, positions=positions)), np.array(hf.model(ids, positions=positions))
    assert np.abs(a - b).max() <= 1e-4 * np.abs(b).max()


def test_qwen35moe_kept_quantized_and_mtp_blocks_skipped(tmp_path):
    """qwen35moe with Q8_0 tensors: kept quantized (attention and shared-expert projections
    8-bit; the delta rule's tensors, whose columns llama.cpp reordered, read dense) gives the
    logits of the same GGUF dequantized. A qwen35 GGUF carrying an MTP block after its layers
    (nextn_predict_layers) loads its layers only, with the HF folder's logits."""
    from gguf_support import Q

    config, weights = _hf_checkpoint("qwen35moe", tmp_path / "hf")
    path = _write(tmp_path, "qwen35moe", config, weights, default_type=Q.Q8_0)
    dense, kept = load_gguf(path), load_gguf(path, keep_quantized=True)
    assert kept.model.layers[1].self_attn.o_proj.bits == 8
    assert kept.model.layers[0].mlp.shared_expert.gate_proj.bits == 8
    assert "scales" not in kept.model.layers[0].linear_attn.out_proj
    ids = mx.array([[3, 17, 250, 9, 41, 41, 7, 100]])
    a, b = np.array(kept.model(ids)), np.array(dense.model(ids))
    assert np.abs(a - b).max() <= 1e-5 * np.abs(b).max()

    config, weights = _hf_checkpoint("qwen35", tmp_path / "hf35")
    cfg, kv = llama_cpp_config("qwen35", config)
    mtp = {"blk.4.nextn.eh_proj.weight": np.ones((64, 128), np.float32), "blk.4.attn_norm.weight": np.ones(64)}
    path = write_gguf(tmp_path / "mtp.gguf", "qwen35", {**cfg, "num_hidden_layers": 5},
                      llama_cpp_tensors("qwen35", cfg, weights), gpt2_tokenizer_meta(V),
                      extra_kv={**kv, "qwen35.nextn_predict_layers": 1}, extra_tensors=mtp)
    gg, hf = load_gguf(path), load_hf_folder(tmp_path / "hf35")
    assert gg.model.args.num_hidden_layers == 4
    a, b = np.array(gg.model(ids)), np.array(hf.model(ids))
    assert np.abs(a - b).max() <= 1e-4 * np.abs(b).max()


def test_fused_expert_gate_up_tensors(tmp_path):
    """llama.cpp's --fuse-gate-up-exps writes each layer's expert gate and up projections as one
    ffn_gate_up_exps (experts, 2F, E), gate rows first (qwen35moe lists that tensor; the gguf
    package's qwen3moe does not): it loads with the HF folder's logits."""
    arch = "qwen35moe"
    config, weights = _hf_checkpoint(arch, tmp_path / "hf")
    cfg, kv = llama_cpp_config(arch, config)
    tensors = llama_cpp_tensors(arch, cfg, weights)
    for i in range(cfg["num_hidden_layers"]):
        pre = f"model.layers.{i}.mlp.experts"
        tensors[f"{pre}.gate_up_proj.weight"] = np.concatenate(
            [tensors.pop(f"{pre}.gate_proj.weight"), tensors.pop(f"{pre}.up_proj.weight")], axis=1)
    path = write_gguf(tmp_path / "fused.gguf", arch, cfg, tensors, gpt2_tokenizer_meta(V),
                      extra_kv={**kv, **CASES[arch][2]})
    gg, hf = load_gguf(path), load_hf_folder(tmp_path / "hf")
    ids = mx.array([[3, 17, 250, 9, 41, 41, 7, 100]])
    a, b = np.array(gg.model(ids)), np.array(hf.model(ids))
    assert np.abs(a - b).max() <= 1e-4 * np.abs(b).max()
