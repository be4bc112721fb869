"""LFM2-MoE (LFM2's convolution and attention layers, dense then sigmoid-routed sparse
feed-forwards) against transformers, from the HF folder, the converted bundle, a GGUF written
as llama.cpp's converter does and a folder written by mlx-lm's converter; speculation on it
through tests/test_recurrent.py's checks (every decoding mode equals plain with drafts rejected
mid-chain; recurrent states after rollbacks equal plain decoding's)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
import test_recurrent as rec
from test_recurrent import PROMPT, V

from edgespec.generate import prefill

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# 6 experts, 2 active; one dense layer then sparse ones; conv and attention interleaved; a
# dense width that LFM2's adjustment would change (LFM2-MoE takes it as written)
CONFIG = dict(vocab_size=V, hidden_size=64, intermediate_size=80, moe_intermediate_size=48, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, conv_L_cache=4, num_dense_layers=1, num_experts=6,
              num_experts_per_tok=2, routed_scaling_factor=1.7, norm_topk_prob=True, use_expert_bias=True,
              layer_types=["conv", "full_attention", "conv", "full_attention"], max_position_embeddings=512,
              norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 20000.0}, initializer_range=0.3,
              eos_token_id=0, bos_token_id=1, pad_token_id=0)
assert len(PROMPT) > 64 and len(PROMPT) > CONFIG["conv_L_cache"]


def randomise(model) -> None:
    """Norms and the expert bias away from their constant init (a bias that only selects, or a
    missed one, would show)."""
    for p in model.parameters():
        if p.ndim == 1:
            p.add_(0.2 * torch.randn_like(p))
    for name, b in model.named_buffers():
        if name.endswith("expert_bias"):
            b.copy_(0.3 * torch.randn_like(b))


def lfm2_moe_checkpoint(folder, seed: int = 1, **overrides):
    from test_architectures import save_random_checkpoint

    return save_random_checkpoint(folder, transformers.Lfm2MoeConfig(**{**CONFIG, **overrides}), seed, randomise)


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    import edgespec

    folder = tmp_path_factory.mktemp("lfm2_moe")
    ref = lfm2_moe_checkpoint(folder)
    return "lfm2_moe", folder, ref, edgespec.load(folder, drafter="none", progress=False, history="off")


def test_matches_transformers_from_folder_and_bundle(moe, tmp_path):
    """Last-token logits after an 80-token prompt (longer than the conv width and 64) within
    1e-4 relative, also prefilled in chunks of 30; 32 greedy tokens identical to transformers;
    from the HF folder and the converted bundle."""
    from edgespec.converters.convert import convert
    from edgespec.models.base import MLP
    from edgespec.models.lfm2 import ConvLayer
    from edgespec.models.lfm2_moe import SigmoidMoE
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
        assert model.args.model_type == "lfm2_moe"
        assert [type(layer.mlp) for layer in model.layers] == [MLP, SigmoidMoE, SigmoidMoE, SigmoidMoE]
        assert isinstance(model.layers[2], ConvLayer) and not isinstance(model.layers[3], ConvLayer)
        assert model.layers[0].mlp.gate_proj.weight.shape == (80, 64)  # no LFM2 width adjustment
        assert model.layers[1].mlp.switch_mlp.gate_proj.weight.shape == (6, 48, 64)
        assert_close(np.array(model(mx.array([PROMPT]))[0, -1]), want_logits)
        assert_close(np.array(prefill(model, model.make_cache(), PROMPT, chunk=30)), want_logits)
        assert engine.generate(PROMPT[:20], max_tokens=32, mode="plain").tokens == want_tokens, path.name


def test_fused_expert_layout_loads_as_the_per_expert_one(moe, tmp_path):
    """transformers 5's in-memory layout (`feed_forward.experts.gate_up_proj` (experts, 2F, E), gate
    rows first, and `experts.down_proj`) saved as such gives the same logits as the published
    per-expert w1/w3/w2."""
    import shutil

    from safetensors.numpy import load_file, save_file

    import edgespec

    _, folder, _, engine = moe
    shutil.copytree(folder, tmp_path / "fused")
    path = tmp_path / "fused" / "model.safetensors"
    w = load_file(path)
    for i in range(1, CONFIG["num_hidden_layers"]):
        pre = f"model.layers.{i}.feed_forward.experts"
        parts = {n: np.stack([w.pop(f"{pre}.{e}.{n}.weight") for e in range(CONFIG["num_experts"])])
                 for n in ("w1", "w3", "w2")}
        w[f"{pre}.gate_up_proj"] = np.concatenate([parts["w1"], parts["w3"]], axis=1)
        w[f"{pre}.down_proj"] = parts["w2"]
    save_file(w, path, metadata={"format": "pt"})
    model = edgespec.load(tmp_path / "fused", drafter="none", progress=False, history="off").model
    ids = mx.array([PROMPT[:30]])
    np.testing.assert_allclose(np.array(model(ids)), np.array(engine.model(ids)), rtol=1e-5, atol=1e-5)


def test_router_bias_selects_and_the_scale_weights(moe):
    """The expert bias changes which experts are picked, never their weights: a bias that makes
    expert 0 every token's pick gives expert 0's output weighted by its unbiased sigmoid score
    (times the scaling factor, renormalised); an expert no token picked changes nothing."""
    _, _, _, engine = moe
    block = engine.model.layers[1].mlp
    x = mx.random.normal((1, 3, 64), key=mx.random.key(0))
    before = np.array(block(x))
    scores = np.array(mx.sigmoid(block.gate(x)))
    chosen = np.argsort(-(scores + np.array(block.expert_bias)), axis=-1)[..., :2]
    unused = sorted(set(range(6)) - set(chosen.ravel().tolist()))
    assert unused
    w = block.switch_mlp.down_proj.weight
    block.switch_mlp.down_proj.weight = mx.where((mx.arange(6) == unused[0])[:, None, None], 0.0, w)
    try:
        np.testing.assert_array_equal(np.array(block(x)), before)
    finally:
        block.switch_mlp.down_proj.weight = w
    bias = block.expert_bias
    block.expert_bias = mx.array([100.0, 90.0, 0, 0, 0, 0])  # experts 0 and 1 for every token
    try:
        ys = np.array(block.switch_mlp(x, mx.broadcast_to(mx.array([0, 1]), (1, 3, 2))))
        s = scores[..., :2]
        want = ((s / (s.sum(-1, keepdims=True) + 1e-6) * 1.7)[..., None] * ys).sum(-2)
        np.testing.assert_allclose(np.array(block(x)), want, rtol=1e-5, atol=1e-6)
    finally:
        block.expert_bias = bias


def test_config_fields_that_would_change_the_math_are_refused():
    from edgespec.models import model_from_config

    base = transformers.Lfm2MoeConfig(**CONFIG).to_dict()
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        model_from_config({**base, "num_experts_per_tok": 7})
    with pytest.raises(ValueError, match="num_dense_layers"):
        model_from_config({**base, "num_dense_layers": -1})
    with pytest.raises(ValueError, match="n_group"):  # grouped routing (not in LFM2-MoE) is refused by name
        model_from_config({**base, "n_group": 2})
    model = model_from_config({**base, "use_expert_bias": False, "num_dense_layers": 0})
    assert all("expert_bias" not in layer.mlp for layer in model.layers)


# ---------------------------------------------------------------- speculation (test_recurrent's checks)


def test_every_mode_greedy_equals_plain_with_mid_chain_rejections(moe):
    rec.test_every_mode_greedy_equals_plain_with_mid_chain_rejections(moe)


def test_speculative_state_after_rejections_equals_plain(moe):
    rec.test_speculative_state_after_rejections_equals_plain(moe)


def test_rollback_and_tree_branches_restore_plain_states(moe):
    rec.test_rollback_and_tree_branches_restore_plain_states(moe)


def test_distributed_split_is_refused_by_name(moe, tmp_path):
    """Both splits refuse it, naming lfm2_moe and its recurrent layers."""
    from edgespec.distributed.errors import DistributedError
    from edgespec.distributed.shard import load_shard

    rec.test_distributed_split_of_a_hybrid_bundle_is_refused_by_name(moe, tmp_path)  # pipeline; writes the bundle
    with pytest.raises(DistributedError, match="lfm2_moe.*recurrent"):
        load_shard(tmp_path / "bundle", "tensor", 0, 2)


# ---------------------------------------------------------------- GGUF (llama.cpp's lfm2moe)


def test_gguf_equals_the_hf_folder(moe, tmp_path):
    """The GGUF llama.cpp's converter would write (experts stacked, the router as ffn_gate_inp,
    the expert bias as exp_probs_b.bias, the convolution squeezed, key/value heads per layer,
    leading_dense_block_count, the sigmoid gating func) loads as the HF folder: its logits after
    the 80-token prompt and its 32 greedy tokens; a GGUF without the expert bias runs without one."""
    from edgespec.models.lfm2_moe import SigmoidMoE
    from gguf_support import gpt2_tokenizer_meta, llama_cpp_config, llama_cpp_tensors, write_gguf
    from safetensors.numpy import load_file
    from test_architectures import assert_close

    import edgespec

    _, folder, ref, engine = moe
    config, kv = llama_cpp_config("lfm2moe", ref.config.to_dict())
    weights = load_file(folder / "model.safetensors")  # as published (and read by llama.cpp): per-expert w1/w3/w2
    tensors = llama_cpp_tensors("lfm2moe", config, weights)
    # llama.cpp's converter does not write routed_scaling_factor (1 in the published checkpoints);
    # the reader takes expert_weights_scale where a GGUF has it, as here for this model's 1.7
    assert "lfm2moe.expert_weights_scale" not in kv and "lfm2moe.leading_dense_block_count" in kv
    kv["lfm2moe.expert_weights_scale"] = CONFIG["routed_scaling_factor"]
    assert "blk.1.ffn_gate_exps.weight" in tensors and "blk.3.exp_probs_b.bias" in tensors
    path = write_gguf(tmp_path / "m.gguf", "lfm2moe", config, tensors, gpt2_tokenizer_meta(V), extra_kv=kv)
    gg = edgespec.load(path, drafter="none", progress=False, history="off")
    args = gg.model.args
    assert (args.model_type, args.num_dense_layers, args.num_experts, args.num_experts_per_tok) == ("lfm2_moe", 1, 6, 2)
    assert args.blocks == CONFIG["layer_types"] and args.use_expert_bias
    want = np.array(engine.model(mx.array([PROMPT]))[0, -1])
    assert_close(np.array(gg.model(mx.array([PROMPT]))[0, -1]), want)
    assert (gg.generate(PROMPT[:20], max_tokens=32, mode="plain").tokens
            == engine.generate(PROMPT[:20], max_tokens=32, mode="plain").tokens)
    no_bias = {k: v for k, v in tensors.items() if not k.endswith("exp_probs_b.bias")}
    path = write_gguf(tmp_path / "nb.gguf", "lfm2moe", config, no_bias, gpt2_tokenizer_meta(V), extra_kv=kv)
    model = edgespec.load(path, drafter="none", progress=False, history="off").model
    assert not model.args.use_expert_bias
    assert isinstance(model.layers[1].mlp, SigmoidMoE) and "expert_bias" not in model.layers[1].mlp


# ---------------------------------------------------------------- mlx-community folders


@pytest.mark.parametrize("quantized", [False, True], ids=["float32", "4bit"])
def test_mlx_community_folder_matches_hf_folder_and_mlx_lm(tmp_path, quantized):
    """A folder written by mlx-lm's own converter (its sanitize: conv weights to (C, K, 1), w1/w3/w2
    renamed gate/up/down, experts stacked as switch_mlp) loads with mlx-lm's forward's logits
    and, unquantized, the HF folder's; its bundle too. 4-bit: the experts, projections and (8-bit,
    as mlx-lm picks) the routers quantized, as mlx-lm runs it."""
    from edgespec.converters.convert import convert
    from edgespec.models.experts import QuantizedSwitchLinear
    from mlx_lm import load as mlx_lm_load
    from mlx_lm.convert import convert as mlx_lm_convert
    from test_architectures import assert_close

    import edgespec

    sizes = dict(intermediate_size=96, moe_intermediate_size=64) if quantized else {}  # inputs: multiples of 32
    ref = lfm2_moe_checkpoint(tmp_path / "hf", seed=6, **sizes)
    opts = dict(quantize=True, q_group_size=32, q_bits=4) if quantized else dict(dtype="float32")
    mlx_lm_convert(str(tmp_path / "hf"), str(tmp_path / "mlx"), **opts)
    theirs, _ = mlx_lm_load(str(tmp_path / "mlx"))
    want = np.array(theirs(mx.array([PROMPT]))[0, -1])
    with torch.no_grad():
        hf = ref(input_ids=torch.tensor([PROMPT])).logits[0, -1].numpy()
    if quantized:
        assert not np.allclose(want, hf, rtol=1e-3)  # really rounded
    else:
        assert_close(want, hf)
    convert(tmp_path / "mlx", tmp_path / "bundle", quantize="none", dtype="float32", progress=False)
    for path in [tmp_path / "mlx", tmp_path / "bundle"] + ([] if quantized else [tmp_path / "hf"]):
        model = edgespec.load(path, drafter="none", progress=False, history="off").model
        assert_close(np.array(model(mx.array([PROMPT]))[0, -1]), want)
    if quantized:
        block = model.layers[1].mlp
        assert isinstance(block.switch_mlp.gate_proj, QuantizedSwitchLinear) and block.gate.bits == 8
