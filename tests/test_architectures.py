"""Architectures: the model contract, every registered architecture against transformers."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from conftest import make_tiny_model
from edgespec.models import get_architecture, model_from_config, supported_model_types

from edgespec.errors import ModelLoadError

# ---------------------------------------------------------------- the model contract


def _batch_mask(valid: np.ndarray, T: int) -> mx.array:
    """(B, S) key validity -> (B, 1, T, S) bool: causal over the last T slots, padding masked.

    A padded query row still sees itself so no row is all-False (softmax of nothing is NaN)."""
    B, S = valid.shape
    q = np.arange(S - T, S)[:, None]  # slot of each new token
    k = np.arange(S)[None, :]
    causal = k <= q  # (T, S)
    m = causal[None] & (valid[:, None, :] | (k == q)[None])
    return mx.array(m[:, None])


def _run_alone(model, ids: list[int], steps: list[int]) -> list[np.ndarray]:
    cache = model.make_cache()
    outs = [np.array(model(mx.array([ids]), cache)[0, -1])]
    for t in steps:
        outs.append(np.array(model(mx.array([[t]]), cache)[0, -1]))
    return outs


def test_batched_rows_at_different_offsets_equal_each_row_alone():
    """(B, T) positions + per-row masks: two left-padded prompts in one batch, prefill and
    three decode steps, give each row's logits as if it ran alone."""
    model = make_tiny_model(3)
    a, b = [5, 9, 2, 7, 1], [3, 8, 8, 4, 6, 2, 9, 11]
    steps_a, steps_b = [12, 13, 14], [21, 22, 23]
    alone_a, alone_b = _run_alone(model, a, steps_a), _run_alone(model, b, steps_b)

    S = max(len(a), len(b))
    pad = [S - len(a), S - len(b)]
    ids = mx.array([[0] * pad[0] + a, [0] * pad[1] + b])
    valid = np.array([[j >= p for j in range(S)] for p in pad])
    positions = mx.array([[max(j - p, 0) for j in range(S)] for p in pad])
    cache = model.make_cache()
    out = model(ids, cache, mask=_batch_mask(valid, S), positions=positions)
    got = [[np.array(out[0, -1])], [np.array(out[1, -1])]]
    for i in range(3):
        valid = np.concatenate([valid, np.ones((2, 1), bool)], axis=1)
        pos = mx.array([[len(a) + i], [len(b) + i]])
        step = mx.array([[steps_a[i]], [steps_b[i]]])
        out = model(step, cache, mask=_batch_mask(valid, 1), positions=pos)
        got[0].append(np.array(out[0, -1]))
        got[1].append(np.array(out[1, -1]))
    for g, want in ((got[0], alone_a), (got[1], alone_b)):
        for x, y in zip(g, want, strict=True):
            np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("model_type, extra", [
    ("gemma2", dict(head_dim=16, sliding_window=4, attn_logit_softcapping=5.0, final_logit_softcapping=3.0)),
    ("gemma3_text", dict(head_dim=16, sliding_window=4, layer_types=["sliding_attention", "full_attention"])),
    ("mistral", dict(sliding_window=4)),
    ("smollm3", dict(no_rope_layer_interval=2)),
])
def test_batched_rows_equal_alone_with_windows_softcaps_and_nope(model_type, extra):
    """The same contract for layers that narrow the mask themselves (windows of 4, shorter
    than the rows) and for soft-capped and NoPE attention."""
    mx.random.seed(5)
    model = model_from_config(dict(model_type=model_type, hidden_size=64, num_hidden_layers=2,
                                   intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                                   vocab_size=64, **extra))
    a, b = [5, 9, 2, 7, 1, 30], [3, 8, 8, 4, 6, 2, 9, 11, 40]
    alone = [_run_alone(model, a, [12, 13]), _run_alone(model, b, [21, 22])]
    S = len(b)
    pad = [S - len(a), 0]
    valid = np.array([[j >= p for j in range(S)] for p in pad])
    positions = mx.array([[max(j - p, 0) for j in range(S)] for p in pad])
    cache = model.make_cache()
    out = model(mx.array([[0] * pad[0] + a, b]), cache, mask=_batch_mask(valid, S), positions=positions)
    got = [[np.array(out[0, -1])], [np.array(out[1, -1])]]
    for i, step in enumerate([(12, 21), (13, 22)]):
        valid = np.concatenate([valid, np.ones((2, 1), bool)], axis=1)
        out = model(mx.array([[step[0]], [step[1]]]), cache, mask=_batch_mask(valid, 1),
                    positions=mx.array([[len(a) + i], [len(b) + i]]))
        got[0].append(np.array(out[0, -1]))
        got[1].append(np.array(out[1, -1]))
    for g, want in zip(got, alone, strict=True):
        for x, y in zip(g, want, strict=True):
            np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-4)


def test_positions_1d_and_2d_agree_and_embed_head_compose():
    model = make_tiny_model(4)
    ids = mx.array([[4, 5, 6, 7]])
    pos = mx.array([3, 4, 5, 6])
    one = model(ids, positions=pos)
    two = model(ids, positions=pos[None])
    np.testing.assert_allclose(np.array(one), np.array(two), rtol=1e-6, atol=1e-6)
    # shifting every position by a constant leaves a causal forward unchanged (RoPE is relative)
    np.testing.assert_allclose(np.array(one), np.array(model(ids)), rtol=1e-4, atol=1e-4)
    # embed -> layers -> head equals the forward pass
    h = model.embed(ids)
    for layer in model.layers:
        h = layer(h, "causal", None, None)
    np.testing.assert_allclose(np.array(model.head(h)), np.array(model(ids)), rtol=1e-5, atol=1e-5)


def test_registry_refuses_unknown_model_type_listing_supported():
    with pytest.raises(ModelLoadError, match="unsupported architecture.*'gpt_neox'.*llama"):
        get_architecture("gpt_neox")
    assert "llama" in supported_model_types()
    model = model_from_config(dict(model_type="mistral", hidden_size=64, num_hidden_layers=1,
                                   intermediate_size=64, num_attention_heads=4, vocab_size=32))
    assert len(model.layers) == 1 and model.args.model_type == "mistral"


# ---------------------------------------------------------------- every architecture vs transformers

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

V = 320  # vocabulary of the tiny checkpoints
COMMON = dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
              initializer_range=0.1, eos_token_id=0, bos_token_id=1, pad_token_id=0)
# Per architecture: config class and what makes it differ from the defaults: a non-default
# RoPE base, rope scaling where the architecture supports it, windows (8) shorter than the
# test prompt (20 tokens + 32 generated) so windowing is exercised.
ARCHS = {
    "llama": ("LlamaConfig", dict(rope_parameters={
        "rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 32})),
    "mistral": ("MistralConfig", dict(rope_parameters={"rope_type": "default", "rope_theta": 20000.0},
                                      sliding_window=8)),
    "qwen2": ("Qwen2Config", dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 30000.0})),
    "qwen3": ("Qwen3Config", dict(head_dim=32, rope_parameters={"rope_type": "default", "rope_theta": 25000.0},
                                  use_sliding_window=True, sliding_window=8, max_window_layers=1)),
    "gemma2": ("Gemma2Config", dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=8,
                                    attn_logit_softcapping=5.0, final_logit_softcapping=3.0,
                                    rope_parameters={"rope_type": "default", "rope_theta": 20000.0})),
    "gemma3_text": ("Gemma3TextConfig", dict(
        head_dim=16, query_pre_attn_scalar=16, sliding_window=8, num_hidden_layers=4, initializer_range=0.04,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 5000.0},
                         "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 200000.0}})),
    "phi3": ("Phi3Config", dict(sliding_window=8, rope_parameters={
        "rope_type": "default", "rope_theta": 20000.0, "partial_rotary_factor": 0.5})),
    # LongRoPE runs within the original context (capped there): 20 + 32 tokens < 64
    "phi3-longrope": ("Phi3Config", dict(max_position_embeddings=256, original_max_position_embeddings=64,
                                         rope_parameters={"rope_type": "longrope", "rope_theta": 20000.0,
                                                          "partial_rotary_factor": 0.5,
                                                          "short_factor": [1.0, 1.5, 2.5, 4.0],
                                                          "long_factor": [2.0, 4.0, 8.0, 16.0]})),
    "smollm3": ("SmolLM3Config", dict(no_rope_layer_interval=2, tie_word_embeddings=True,
                                      rope_parameters={"rope_type": "default", "rope_theta": 30000.0})),
}
PROMPT = [1, 17, 250, 3, 99, 42, 42, 7, 300, 12, 5, 61, 77, 8, 190, 2, 33, 140, 9, 26]


def vocab_tokenizer(vocab_size: int):
    """Word-level tokenizer over every id: 0 = </s> (EOS), then letters, then <tN> fillers."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, pre_tokenizers
    from tokenizers import models as tk_models

    from edgespec.tokenizer import Tokenizer

    vocab = {"</s>": 0}
    for c in "abcdefghijklmnopqrstuvwxyz":
        vocab[c] = len(vocab)
    while len(vocab) < vocab_size:
        vocab[f"<t{len(vocab)}>"] = len(vocab)
    backend = HFTokenizer(tk_models.WordLevel(vocab=vocab, unk_token="</s>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    backend.decoder = decoders.Fuse()
    return Tokenizer(backend, {"eos_token": "</s>", "tokenizer_class": "PreTrainedTokenizerFast"})


def save_random_checkpoint(folder, config, seed: int = 0, randomise=None):
    """A random fp32 transformers model of `config` (`randomise(model)` then moves what its init
    leaves constant), saved to `folder` with a tokenizer of its vocabulary; the model, in eval mode."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if randomise is not None:
        with torch.no_grad():
            randomise(model)
    model.eval().save_pretrained(folder)
    vocab_tokenizer(config.vocab_size).save(folder)
    return model


def hf_checkpoint(folder, arch: str, seed: int = 0, **overrides):
    """A random fp32 transformers model of `arch`, saved to `folder` with a tokenizer."""
    cls_name, extra = ARCHS[arch]
    return save_random_checkpoint(folder, getattr(transformers, cls_name)(**{**COMMON, **extra, **overrides}), seed)


def hf_last_logits(model, ids) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1].numpy()


def hf_greedy(model, ids, n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=0,
                             pad_token_id=0, attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    return out[0, len(ids):].tolist()


def assert_close(got: np.ndarray, want: np.ndarray, rel: float = 1e-4):
    err = float(np.abs(got - want).max() / np.abs(want).max())
    assert err < rel, f"relative error {err:.2e}"


@pytest.mark.parametrize("arch", list(ARCHS))
def test_architecture_matches_transformers(tmp_path, arch):
    from edgespec.converters.convert import convert

    import edgespec

    # seeds (and Gemma 3's smaller init) picked so greedy continuations are varied
    ref = hf_checkpoint(tmp_path / "hf", arch, seed=2 if arch == "gemma3_text" else 1)
    want_logits = hf_last_logits(ref, PROMPT)
    want_tokens = hf_greedy(ref, PROMPT, 32)
    assert len(set(want_tokens)) > 3  # a real continuation, not one token repeated
    convert(tmp_path / "hf", tmp_path / "bundle", quantize="none", dtype="float32", progress=False)
    for path in (tmp_path / "hf", tmp_path / "bundle"):
        engine = edgespec.load(path, drafter="none", progress=False, history="off")
        model = engine.model
        assert model.args.model_type == arch.split("-")[0]
        assert_close(np.array(model(mx.array([PROMPT]))[0, -1]), want_logits)
        for mode in ("plain", "auto"):
            got = engine.generate(PROMPT, max_tokens=32, mode=mode).tokens
            assert got == want_tokens, f"{path.name} mode {mode}"


# ---------------------------------------------------------------- config fields: read or refused


LLAMA = dict(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
             num_attention_heads=4, num_key_value_heads=2, vocab_size=V, max_position_embeddings=512)
SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 32}


def _logits_with(config, params) -> np.ndarray:
    model = model_from_config(config)
    model.load_weights(params)
    return np.array(model(mx.array([PROMPT])))


def test_rope_parameters_v5_and_rope_theta_v4_give_identical_logits():
    from mlx.utils import tree_flatten

    mx.random.seed(0)
    params = list(tree_flatten(model_from_config(LLAMA).parameters()))
    v4 = _logits_with({**LLAMA, "rope_theta": 50000.0, "rope_scaling": SCALING}, params)
    v5 = _logits_with({**LLAMA, "rope_parameters": {"rope_theta": 50000.0, **SCALING}}, params)
    np.testing.assert_array_equal(v4, v5)
    # and the base and scaling are really read: the defaults give other logits
    assert not np.allclose(v5, _logits_with(LLAMA, params), atol=1e-3)
    assert not np.allclose(v5, _logits_with({**LLAMA, "rope_theta": 50000.0}, params), atol=1e-3)
    with pytest.raises(ValueError, match="rope_theta=10000.0 and rope_parameters gives 50000.0"):
        model_from_config({**LLAMA, "rope_theta": 10000.0, "rope_parameters": {"rope_theta": 50000.0}})


def test_gemma3_v4_and_v5_rope_layouts_give_identical_logits():
    """Gemma 3's per-layer-type RoPE: v4's rope_theta + rope_scaling + rope_local_base_freq +
    sliding_window_pattern equals v5's rope_parameters per layer type + layer_types."""
    from mlx.utils import tree_flatten

    base = dict(model_type="gemma3_text", hidden_size=64, num_hidden_layers=4, intermediate_size=128,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=V, sliding_window=8)
    v4 = {**base, "rope_theta": 200000.0, "rope_scaling": {"rope_type": "linear", "factor": 2.0},
          "rope_local_base_freq": 5000.0, "sliding_window_pattern": 2}
    v5 = {**base, "layer_types": ["sliding_attention", "full_attention"] * 2, "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 5000.0},
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 200000.0}}}
    mx.random.seed(1)
    params = list(tree_flatten(model_from_config(v5).parameters()))
    np.testing.assert_array_equal(_logits_with(v4, params), _logits_with(v5, params))
    assert not np.allclose(_logits_with(v5, params), _logits_with(base, params), atol=1e-3)


@pytest.mark.parametrize("extra, named", [
    ({"attention_multiplier": 0.5}, "attention_multiplier"),  # a field no supported arch reads
    ({"attn_logit_softcapping": 30.0}, "attn_logit_softcapping"),  # Gemma's, not Llama's
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, "'yarn'"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
])
def test_math_changing_fields_not_implemented_are_refused_by_name(tmp_path, extra, named):
    import json

    from edgespec.weights.loader import load

    folder = tmp_path / "hf"
    hf_checkpoint(folder, "llama")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **extra}))
    with pytest.raises(ModelLoadError, match=named):
        load(folder)


def test_longrope_context_is_capped_at_the_original_length():
    factors = {"short_factor": [1.0] * 4, "long_factor": [2.0] * 4}
    cfg = {**LLAMA, "model_type": "phi3", "max_position_embeddings": 4096, "original_max_position_embeddings": 512,
           "partial_rotary_factor": 0.5, "rope_scaling": {"type": "su", **factors}}
    model = model_from_config(cfg)
    assert model.args.max_position_embeddings == 512 and model.args.rope_scaling["factor"] == 8.0
    with pytest.raises(ValueError, match="short_factor must list 4"):
        model_from_config({**cfg, "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 3}})


# ---------------------------------------------------------------- Hugging Face folder layouts


def test_sharded_and_half_precision_folders_load(tmp_path):
    from edgespec.weights.loader import load

    ref = hf_checkpoint(tmp_path / "one", "qwen2", seed=3)
    ref.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    vocab_tokenizer(V).save(tmp_path / "sharded")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 2
    got = np.array(load(tmp_path / "sharded").model(mx.array([PROMPT]))[0, -1])
    assert_close(got, hf_last_logits(ref, PROMPT))
    for dtype in (torch.bfloat16, torch.float16):
        folder = tmp_path / str(dtype)
        ref.to(dtype).save_pretrained(folder)  # (.to casts in place)
        vocab_tokenizer(V).save(folder)
        # the reference: the rounded weights read back in fp32 (with fp32 RoPE tables, which
        # a module cast to half precision and back would not have)
        back = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        got = np.array(load(folder).model(mx.array([PROMPT]))[0, -1])
        assert_close(got, hf_last_logits(back, PROMPT))


@pytest.mark.parametrize("arch", ["llama", "phi3", "gemma2"])
def test_mlx_community_quantized_folder_matches_mlx_lm(tmp_path, arch):
    """A folder written by mlx-lm's own converter (4-bit, with per-module overrides: v_proj
    and down_proj 8-bit in groups of 32, the embedding left dense) loads as it is, and its
    forward equals mlx-lm's forward of the same folder."""
    import json

    from mlx_lm import load as mlx_lm_load
    from mlx_lm.convert import convert as mlx_lm_convert

    from edgespec.weights.loader import load

    # mlx-lm reads neither v5 rope_parameters nor (for these two) sliding windows: give it a
    # v4-style config and windows longer than the prompt, so both sides compute the same model
    hf_checkpoint(tmp_path / "hf", arch, seed=4, **({"sliding_window": 512} if arch != "llama" else {}))
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    rope = dict(config.pop("rope_parameters"))
    config["rope_theta"] = rope.pop("rope_theta")
    if "partial_rotary_factor" in rope:
        config["partial_rotary_factor"] = rope.pop("partial_rotary_factor")
    config["rope_scaling"] = rope if rope.get("rope_type", "default") != "default" else None
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))

    def predicate(path, module, config=None):
        if "embed_tokens" in path:
            return False
        if "v_proj" in path or "down_proj" in path or "qkv_proj" in path:
            return {"group_size": 32, "bits": 8}
        return True

    mlx_lm_convert(str(tmp_path / "hf"), str(tmp_path / "mlx"), quantize=True, q_group_size=64, q_bits=4,
                   quant_predicate=predicate)
    ref, _ = mlx_lm_load(str(tmp_path / "mlx"))
    want = np.array(ref(mx.array([PROMPT]))[0, -1])
    model = load(tmp_path / "mlx").model
    assert model.layers[0].mlp.up_proj.bits == 4 and model.layers[0].mlp.down_proj.bits == 8
    assert not hasattr(model.model.embed_tokens, "scales")
    assert_close(np.array(model(mx.array([PROMPT]))[0, -1]), want, rel=1e-4)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_windowed_model_written_from_its_args_keeps_its_windows(tmp_path, arch):
    """A model saved from its parsed args (ModelArgs.to_dict: a bundle's drafter/, distillation)
    keeps `use_sliding_window`: the drafter written into a bundle has the HF folder's logits
    after a prompt longer than its window (8), and they differ from unwindowed ones."""
    from edgespec.converters.convert import convert

    from edgespec.weights.loader import load_model_folder

    window = dict(use_sliding_window=True, sliding_window=8, max_window_layers=1)
    ref = hf_checkpoint(tmp_path / "hf", arch, seed=2, **window)
    convert(tmp_path / "hf", tmp_path / "bundle", quantize="none", dtype="float32", progress=False,
            drafter=tmp_path / "hf", drafter_options={"coreml": False})
    drafter = load_model_folder(tmp_path / "bundle" / "drafter")
    assert drafter.args.layer_types == ["full_attention"] + ["sliding_attention"] * 2
    got = np.array(drafter(mx.array([PROMPT]))[0, -1])
    assert_close(got, hf_last_logits(ref, PROMPT))
    unwindowed = load_model_folder(tmp_path / "bundle" / "drafter")
    for layer in unwindowed.layers:
        layer.self_attn.window = None
    assert not np.allclose(np.array(unwindowed(mx.array([PROMPT]))[0, -1]), got, rtol=1e-3, atol=1e-4)
