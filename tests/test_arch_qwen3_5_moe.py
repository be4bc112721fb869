"""Qwen3.5-MoE (the Qwen3.5 hybrid with sparse blocks and a gated shared expert) against
transformers, and speculation on it through tests/test_recurrent.py's checks (every decoding
mode equals plain with drafts rejected mid-chain; recurrent states after rollbacks equal
plain decoding's)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
import test_recurrent as rec
from test_recurrent import PROMPT, V

from edgespec.caches.recurrent import CHUNK
from edgespec.generate import prefill

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# 8 experts, 3 active; shared expert of another width; both layer kinds interleaved
TEXT = dict(vocab_size=V, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
            linear_value_head_dim=12, linear_conv_kernel_dim=3,
            layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
            num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32, shared_expert_intermediate_size=48,
            rope_parameters={"rope_type": "default", "rope_theta": 30000.0, "partial_rotary_factor": 0.5},
            initializer_range=0.3, eos_token_id=0, bos_token_id=1, pad_token_id=0)
assert len(PROMPT) > CHUNK and len(PROMPT) > TEXT["linear_conv_kernel_dim"]


def randomise(model) -> None:
    """Norms, dt_bias and A_log away from their constant init (a missed 1 + w would show)."""
    for name, p in model.named_parameters():
        if name.endswith("A_log"):
            p.copy_(torch.rand_like(p) * 2 - 1)
        elif p.ndim == 1:
            p.add_(0.2 * torch.randn_like(p))



def randomised(model):
    with torch.no_grad():
        randomise(model)
    return model.eval()

def moe_checkpoint(folder, seed: int = 1, **overrides):
    from test_architectures import save_random_checkpoint

    return save_random_checkpoint(folder, transformers.Qwen3_5MoeTextConfig(**{**TEXT, **overrides}), seed, randomise)


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    import edgespec

    folder = tmp_path_factory.mktemp("qwen3_5_moe")
    ref = moe_checkpoint(folder)
    return "qwen3_5_moe_text", folder, ref, edgespec.load(folder, drafter="none", progress=False, history="off")


def test_matches_transformers_from_folder_and_bundle(moe, tmp_path):
    """Last-token logits after an 80-token prompt (longer than the conv width and the delta
    rule's chunk) within 1e-4 relative, also prefilled in chunks of 30; 32 greedy tokens
    identical to transformers; from the HF folder and the converted bundle."""
    from edgespec.converters.convert import convert
    from edgespec.models.experts import SwitchGLU
    from edgespec.models.qwen3_5_moe import SharedExpertMoE
    from test_architectures import assert_close, hf_greedy, hf_last_logits

    import edgespec

    _, folder, ref, _ = moe
    want_logits = hf_last_logits(ref, PROMPT)
    want_tokens = hf_greedy(ref, PROMPT[:20], 32)
    assert len(set(want_tokens)) > 3
    convert(folder, tmp_path / "bundle", quantize="none", dtype="float32", progress=False)
    for path in (folder, tmp_path / "bundle"):
        engine = edgespec.load(path, drafter="none", progress=False, history="off")
        model = engine.model
        assert model.args.model_type == "qwen3_5_moe_text"
        assert all(isinstance(layer.mlp, SharedExpertMoE) for layer in model.layers)
        assert isinstance(model.layers[0].mlp.switch_mlp, SwitchGLU)
        assert model.layers[0].mlp.switch_mlp.gate_proj.weight.shape == (8, 32, 64)
        assert_close(np.array(model(mx.array([PROMPT]))[0, -1]), want_logits)
        assert_close(np.array(prefill(model, model.make_cache(), PROMPT, chunk=30)), want_logits)
        assert engine.generate(PROMPT[:20], max_tokens=32, mode="plain").tokens == want_tokens, path.name


def test_shared_expert_and_routing_matter(moe):
    """The shared expert's gate and an unchosen expert: zeroing the gate's weight halves the
    shared expert's share (sigmoid(0)); zeroing an expert no token picked changes nothing."""
    _, _, _, engine = moe
    block = engine.model.layers[1].mlp
    x = mx.random.normal((1, 1, 64), key=mx.random.key(0))
    before = np.array(block(x))
    probs = np.array(mx.softmax(block.gate(x), axis=-1))[0, 0]
    unused = int(np.argsort(probs)[0])
    w = block.switch_mlp.down_proj.weight
    block.switch_mlp.down_proj.weight = mx.where((mx.arange(8) == unused)[:, None, None], 0.0, w)
    np.testing.assert_array_equal(np.array(block(x)), before)
    block.switch_mlp.down_proj.weight = w
    gate = block.shared_expert_gate.weight
    share = np.array(mx.sigmoid(block.shared_expert_gate(x)) * block.shared_expert(x))
    block.shared_expert_gate.weight = mx.zeros_like(gate)
    try:
        np.testing.assert_allclose(np.array(block(x)), before - share + 0.5 * np.array(block.shared_expert(x)),
                                   rtol=1e-5, atol=1e-6)
    finally:
        block.shared_expert_gate.weight = gate


def test_multimodal_folder_loads_its_text_model(tmp_path):
    """A `qwen3_5_moe` folder (text_config nested, weights under model.language_model, a
    vision tower) gives the text model's logits."""
    from test_architectures import vocab_tokenizer

    import edgespec

    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                  patch_size=4, temporal_patch_size=1, spatial_merge_size=1)
    text = transformers.Qwen3_5MoeTextConfig(**TEXT)
    torch.manual_seed(4)
    cfg = transformers.Qwen3_5MoeConfig(text_config=text.to_dict(), vision_config=vision)
    full = randomised(transformers.Qwen3_5MoeForConditionalGeneration(cfg))
    full.save_pretrained(tmp_path / "mm")
    vocab_tokenizer(V).save(tmp_path / "mm")
    with torch.no_grad():
        want = full(input_ids=torch.tensor([PROMPT])).logits[0, -1].numpy()
    model = edgespec.load(tmp_path / "mm", drafter="none", progress=False, history="off").model
    assert model.args.model_type == "qwen3_5_moe"
    got = np.array(model(mx.array([PROMPT]))[0, -1])
    assert float(np.abs(got - want).max() / np.abs(want).max()) < 1e-4


def test_config_fields_that_would_change_the_math_are_refused():
    from edgespec.models import model_from_config

    base = transformers.Qwen3_5MoeTextConfig(**TEXT).to_dict()
    with pytest.raises(ValueError, match="decoder_sparse_step"):
        model_from_config({**base, "decoder_sparse_step": 2})
    with pytest.raises(ValueError, match="intermediate_size"):
        model_from_config({**base, "intermediate_size": 96})
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        model_from_config({**base, "num_experts_per_tok": 9})
    model = model_from_config({**base, "shared_expert_intermediate_size": 0})  # no shared expert
    assert "shared_expert" not in model.layers[0].mlp


# ---------------------------------------------------------------- speculation (test_recurrent's checks)


def test_every_mode_greedy_equals_plain_with_mid_chain_rejections(moe):
    rec.test_every_mode_greedy_equals_plain_with_mid_chain_rejections(moe)


def test_speculative_state_after_rejections_equals_plain(moe):
    rec.test_speculative_state_after_rejections_equals_plain(moe)


def test_rollback_and_tree_branches_restore_plain_states(moe):
    rec.test_rollback_and_tree_branches_restore_plain_states(moe)


# ---------------------------------------------------------------- mlx-community folders


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe", "qwen3_5_moe-4bit"])
def test_mlx_community_folder_matches_hf_folder_and_mlx_lm(tmp_path, arch):
    """A folder written by mlx-lm's own converter from a multimodal Qwen3.5(-MoE) checkpoint
    (its sanitize: conv1d to (C, K, 1), the (1 + w) norms stored as 1 + w, vision and mtp
    dropped, experts stacked) loads with the HF folder's logits and mlx-lm's forward's; its
    bundle too (written in edgespec's convention, read back without a second shift). 4-bit:
    experts, projections and (8-bit, as mlx-lm picks) the routers quantized, as mlx-lm runs it."""
    import json

    from edgespec.converters.convert import convert
    from edgespec.models.qwen3_5 import mlx_lm_converted
    from mlx_lm import load as mlx_lm_load
    from mlx_lm.convert import convert as mlx_lm_convert
    from safetensors.numpy import load_file
    from test_architectures import assert_close, vocab_tokenizer

    import edgespec

    kinds = ["linear_attention", "full_attention"] * 2  # as full_attention_interval=2 gives (mlx-lm reads that)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                  patch_size=4, temporal_patch_size=1, spatial_merge_size=1)
    if arch == "qwen3_5":
        text = rec.ARCHS["qwen3_5_text"](V, 0.3).to_dict()
        cls, config_cls = transformers.Qwen3_5ForConditionalGeneration, transformers.Qwen3_5Config
    else:  # 4-bit: value heads of 16 so every quantized input width is a multiple of the group (32)
        dv = 16 if arch.endswith("4bit") else TEXT["linear_value_head_dim"]
        text = transformers.Qwen3_5MoeTextConfig(**{**TEXT, "linear_value_head_dim": dv}).to_dict()
        cls, config_cls = transformers.Qwen3_5MoeForConditionalGeneration, transformers.Qwen3_5MoeConfig
    text["layer_types"] = kinds
    torch.manual_seed(6)
    full = randomised(cls(config_cls(text_config=text, vision_config=vision)))
    full.save_pretrained(tmp_path / "hf")
    vocab_tokenizer(V).save(tmp_path / "hf")
    if arch != "qwen3_5":
        fuse_experts(tmp_path / "hf" / "model.safetensors", TEXT["num_experts"])
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config["text_config"]["full_attention_interval"] = 2
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    quantize = dict(quantize=True, q_group_size=32, q_bits=4) if arch.endswith("4bit") else dict(dtype="float32")
    mlx_lm_convert(str(tmp_path / "hf"), str(tmp_path / "mlx"), **quantize)
    stored = {k: mx.array(v) for f in (tmp_path / "mlx").glob("*.safetensors") for k, v in load_file(f).items()}
    assert mlx_lm_converted(stored)  # mlx-lm's layout, told apart by its conv1d weights
    theirs, _ = mlx_lm_load(str(tmp_path / "mlx"))
    want = np.array(theirs(mx.array([PROMPT]))[0, -1])
    with torch.no_grad():
        hf = full(input_ids=torch.tensor([PROMPT])).logits[0, -1].numpy()
    if arch.endswith("4bit"):
        assert not np.allclose(want, hf, rtol=1e-3)  # really rounded
    else:
        assert_close(want, hf)
    convert(tmp_path / "mlx", tmp_path / "bundle", quantize="none", dtype="float32", progress=False)
    paths = [tmp_path / "mlx", tmp_path / "bundle"] + ([] if arch.endswith("4bit") else [tmp_path / "hf"])
    for path in paths:
        model = edgespec.load(path, drafter="none", progress=False, history="off").model
        assert_close(np.array(model(mx.array([PROMPT]))[0, -1]), want)
    if arch.endswith("4bit"):
        from edgespec.models.experts import QuantizedSwitchLinear

        block = model.layers[0].mlp
        assert isinstance(block.switch_mlp.gate_proj, QuantizedSwitchLinear) and block.gate.bits == 8


def fuse_experts(path, experts: int):
    """Rewrite per-expert tensors (transformers' save_pretrained) in the fused layout the
    published Qwen3.5-MoE checkpoints use, which mlx-lm's converter reads:
    `mlp.experts.gate_up_proj` (experts, 2F, E) and `mlp.experts.down_proj` (experts, E, F)."""
    from safetensors.numpy import load_file, save_file

    w = load_file(path)
    for prefix in sorted({k.split(".experts.")[0] for k in w if ".experts.0.gate_proj" in k}):
        parts = {p: np.stack([w.pop(f"{prefix}.experts.{e}.{p}.weight") for e in range(experts)])
                 for p in ("gate_proj", "up_proj", "down_proj")}
        w[f"{prefix}.experts.gate_up_proj"] = np.concatenate([parts["gate_proj"], parts["up_proj"]], axis=1)
        w[f"{prefix}.experts.down_proj"] = parts["down_proj"]
    save_file(w, path, metadata={"format": "pt"})


def test_mtp_head_with_a_sparse_layer_matches_the_published_definition_and_drafts_exactly(tmp_path):
    """A Qwen3.5-MoE checkpoint with an `mtp.*` head (its layer a full-attention layer with the
    sparse block, experts fused as published): the head's logits equal the published
    definition's (test_mtp.reference_mtp_logits over transformers' MoE layer), and speculative
    decoding with it equals plain."""
    import json

    from edgespec.models.qwen3_5_moe import SharedExpertMoE
    from safetensors.torch import save_file
    from test_mtp import reference_mtp_logits

    import edgespec
    from edgespec.drafters.mtp import MTPDrafter

    main = moe_checkpoint(tmp_path, seed=3)
    torch.manual_seed(5)
    layer = randomised(transformers.Qwen3_5MoeTextModel(
        transformers.Qwen3_5MoeTextConfig(**{**TEXT, "num_hidden_layers": 1, "layer_types": ["full_attention"]})))
    E = TEXT["hidden_size"]
    glue = {"fc.weight": torch.randn(E, 2 * E) * 0.15, "pre_fc_norm_embedding.weight": 0.3 * torch.randn(E),
            "pre_fc_norm_hidden.weight": 0.3 * torch.randn(E)}
    tensors = {f"mtp.{k}": v for k, v in glue.items()}
    tensors.update({f"mtp.{k}": v.detach().clone().contiguous() for k, v in layer.state_dict().items()
                    if k.startswith(("layers.", "norm."))})
    assert "mtp.layers.0.mlp.experts.gate_up_proj" in tensors  # fused, as transformers keeps them
    save_file(tensors, str(tmp_path / "mtp.safetensors"))
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "mtp_num_hidden_layers": 1}))
    engine = edgespec.load(tmp_path, progress=False, history="off")
    model = engine.model
    assert isinstance(engine.drafter, MTPDrafter) and isinstance(model.mtp.layers[0].mlp, SharedExpertMoE)
    ids = PROMPT[:20]
    want = reference_mtp_logits(main, layer, glue, ids)
    _, h = model(mx.array([ids]), return_hidden=True)
    got = model.project(model.mtp(model.embed(mx.array([ids[1:]])), h[:, :-1]))[0]
    np.testing.assert_allclose(np.array(got), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    ref = engine.generate(PROMPT[:9], max_tokens=24, mode="plain").tokens
    spec = engine.generate(PROMPT[:9], max_tokens=24, mode="speculative", draft_tokens=3)
    assert spec.tokens == ref and spec.stats.drafted > 0
