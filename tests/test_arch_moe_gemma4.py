"""Qwen3-MoE and Gemma 4 (with its assistant drafter) against transformers, in every decoding mode.

Tiny random checkpoints built here with transformers (`from_config`, non-default sizes):
Qwen3-MoE with 8 experts of which 3 (or 2) are active, dense and sparse layers interleaved;
Gemma 4 with sliding and full layers of different head sizes interleaved, shared-KV layers,
per-layer inputs, the MoE block and proportional RoPE; Gemma 4's assistant beside it.
"""

from __future__ import annotations

import json
import random

import mlx.core as mx
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from conftest import count_drafts  # noqa: E402
from test_architectures import assert_close, hf_greedy, vocab_tokenizer  # noqa: E402

import edgespec  # noqa: E402
from edgespec.generate import PREFILL_CHUNK  # noqa: E402

V = 320
IDS = dict(eos_token_id=0, bos_token_id=1, pad_token_id=0)
CONFIGS = {
    # every layer windowed (8), routing weights renormalised, layer 2 dense
    "qwen3_moe": ("Qwen3MoeConfig", dict(
        vocab_size=V, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=3,
        norm_topk_prob=True, mlp_only_layers=[2], use_sliding_window=True, sliding_window=8,
        max_position_embeddings=2048, initializer_range=0.1,
        rope_parameters={"rope_type": "default", "rope_theta": 20000.0}, **IDS)),
    # every second layer sparse, routing weights as the softmax gives them, windows of 16
    "qwen3_moe-sparse-step": ("Qwen3MoeConfig", dict(
        vocab_size=V, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=False, decoder_sparse_step=2, max_position_embeddings=2048, initializer_range=0.2,
        use_sliding_window=True, sliding_window=16,
        rope_parameters={"rope_type": "default", "rope_theta": 30000.0}, **IDS)),
    # sliding (head 16, 2 kv heads) and full (head 32, 1 kv head, k = v) layers interleaved; the
    # last two share the keys of layers 2 and 3; per-layer inputs; MoE block; soft-capped logits
    "gemma4_text": ("Gemma4TextConfig", dict(
        vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
        attention_k_eq_v=True, num_kv_shared_layers=2, hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=V, enable_moe_block=True, num_experts=4, top_k_experts=2,
        moe_intermediate_size=16, use_double_wide_mlp=True, final_logit_softcapping=30.0, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"] * 3, max_position_embeddings=2048,
        initializer_range=0.05,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 5000.0},
                         "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.5,
                                            "rope_theta": 200000.0}}, **IDS)),
}
# Longer than the prefill chunk and every window: the logits are read after it.
LONG = [random.Random(7).randrange(2, V) for _ in range(PREFILL_CHUNK + 21)]
# Repeats itself, so prompt lookup and the n-gram sources find candidates.
SHORT = [1, 17, 250, 3, 99, 42, 42, 7, 300, 12, 5, 61, 77, 8, 190, 2, 33, 140, 9, 26] * 2 + [17, 250, 3]


def checkpoint(folder, arch: str, seed: int = 0, **overrides):
    cls_name, config = CONFIGS[arch]
    config = getattr(transformers, cls_name)(**{**config, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(folder)
    vocab_tokenizer(V).save(folder)
    return model


def last_logits(model, ids) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1].numpy()


@pytest.mark.parametrize("arch", list(CONFIGS))
def test_matches_transformers_from_folder_and_bundle(tmp_path, arch):
    from edgespec.converters.convert import convert

    ref = checkpoint(tmp_path / "hf", arch, seed=1)
    want_logits = last_logits(ref, LONG)
    want_tokens = hf_greedy(ref, LONG, 32)
    assert len(set(want_tokens)) > 3  # a real continuation, not one token repeated
    convert(tmp_path / "hf", tmp_path / "bundle", quantize="none", dtype="float32", progress=False)
    for path in (tmp_path / "hf", tmp_path / "bundle"):
        engine = edgespec.load(path, drafter="none", progress=False, history="off")
        assert engine.model.args.model_type == arch.split("-")[0]
        assert_close(np.array(engine.model(mx.array([LONG]))[0, -1]), want_logits)
        assert engine.generate(LONG, max_tokens=32, mode="plain").tokens == want_tokens, path.name


def test_gemma4_multimodal_folder_loads_its_language_model(tmp_path):
    """A `gemma4` (image-text) checkpoint: the text model under model.language_model loads and
    matches transformers on text; the vision tower's tensors are skipped, with a note."""
    text = transformers.Gemma4TextConfig(**CONFIGS["gemma4_text"][1])
    vision = transformers.Gemma4VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, num_key_value_heads=2, head_dim=16)
    torch.manual_seed(0)
    ref = transformers.Gemma4ForConditionalGeneration(transformers.Gemma4Config(text_config=text,
                                                                                vision_config=vision)).eval()
    ref.save_pretrained(tmp_path / "mm")
    vocab_tokenizer(V).save(tmp_path / "mm")
    with torch.no_grad():
        want = ref(input_ids=torch.tensor([SHORT])).logits[0, -1].numpy()
    model = edgespec.load(tmp_path / "mm", drafter="none", progress=False, history="off").model
    assert model.args.model_type == "gemma4_text" and "vision" in model.load_note
    assert_close(np.array(model(mx.array([SHORT]))[0, -1]), want)


def test_moe_layers_route_to_a_few_of_more_experts(tmp_path):
    """The sparse layers are where the config puts them and hold every expert stacked; each
    token's output depends on its chosen experts only (zeroing another expert changes nothing)."""
    from edgespec.models.experts import SwitchGLU
    from edgespec.models.qwen3_moe import SparseMoE

    checkpoint(tmp_path / "a", "qwen3_moe")
    checkpoint(tmp_path / "b", "qwen3_moe-sparse-step")
    a = edgespec.load(tmp_path / "a", drafter="none", progress=False, history="off").model
    b = edgespec.load(tmp_path / "b", drafter="none", progress=False, history="off").model
    assert [isinstance(layer.mlp, SparseMoE) for layer in a.layers] == [True, True, False, True]
    assert [isinstance(layer.mlp, SparseMoE) for layer in b.layers] == [False, True, False, True]
    moe = a.layers[0].mlp
    assert isinstance(moe.switch_mlp, SwitchGLU) and moe.switch_mlp.gate_proj.weight.shape == (8, 32, 64)
    x = mx.random.normal((1, 5, 64))
    probs = mx.softmax(moe.gate(x), axis=-1)
    unused = sorted(set(range(8)) - set(np.argsort(-np.array(probs[0, 0]))[:3].tolist()))
    before = np.array(moe(x)[0, 0])
    w = moe.switch_mlp.down_proj.weight
    moe.switch_mlp.down_proj.weight = mx.where((mx.arange(8) == unused[0])[:, None, None], 0.0, w)
    np.testing.assert_array_equal(np.array(moe(x)[0, 0]), before)
    moe.switch_mlp.down_proj.weight = mx.where((mx.arange(8) == int(np.argmax(probs[0, 0])))[:, None, None], 0.0, w)
    assert not np.allclose(np.array(moe(x)[0, 0]), before)


@pytest.mark.parametrize("quantized", [False, True])
def test_experts_sorted_by_expert_equal_the_pairs_as_they_come(monkeypatch, quantized):
    """From SORT_MIN (token, expert) pairs the experts run on pairs sorted by expert: the
    same outputs, each in its token's place."""
    import edgespec.models.experts as ex
    import mlx.nn as nn

    mx.random.seed(3)
    layer = ex.SwitchGLU(64, 32, 8, "silu")
    if quantized:
        nn.quantize(layer, group_size=32, bits=4)
    x = mx.random.normal((2, 40, 64))
    idx = mx.array(np.random.default_rng(0).integers(0, 8, (2, 40, 3)).astype(np.int32))
    assert idx.size >= ex.SORT_MIN
    sorted_out = layer(x, idx)
    monkeypatch.setattr(ex, "SORT_MIN", 10**9)
    np.testing.assert_allclose(np.array(sorted_out), np.array(layer(x, idx)), rtol=1e-6, atol=1e-6)


def test_qwen3_moe_quantized_bundle_and_mlx_community_folder(tmp_path):
    """`convert --quantize 4` quantizes the stacked experts (gather_qmm); an mlx-lm-converted
    (mlx-community) 4-bit folder loads as it is and equals mlx-lm's forward of it."""
    from edgespec.converters.convert import convert
    from edgespec.models.experts import QuantizedSwitchLinear
    from mlx_lm import load as mlx_lm_load
    from mlx_lm.convert import convert as mlx_lm_convert

    ref = checkpoint(tmp_path / "hf", "qwen3_moe-sparse-step", seed=3)
    convert(tmp_path / "hf", tmp_path / "q4", quantize="4", group_size=32, dtype="float32", progress=False)
    engine = edgespec.load(tmp_path / "q4", drafter="none", progress=False, history="off")
    gate = engine.model.layers[1].mlp.switch_mlp.gate_proj
    assert isinstance(gate, QuantizedSwitchLinear) and gate.bits == 4
    # the quantized forward equals the dense model's with the dequantized weights
    dense = dequantized(engine.model, json.loads((tmp_path / "q4" / "config.json").read_text()))
    assert_close(np.array(engine.model(mx.array([SHORT]))[0, -1]), np.array(dense(mx.array([SHORT]))[0, -1]))
    assert engine.generate(SHORT, max_tokens=16, mode="plain").tokens == \
        engine.generate(SHORT, max_tokens=16, mode="prompt_lookup").tokens
    assert not np.allclose(np.array(dense(mx.array([SHORT]))[0, -1]), last_logits(ref, SHORT))  # really rounded

    config = json.loads((tmp_path / "hf" / "config.json").read_text())  # mlx-lm reads v4 fields
    config["rope_theta"] = config.pop("rope_parameters")["rope_theta"]
    config["num_experts"] = config.pop("num_local_experts")
    config["use_sliding_window"] = False  # mlx-lm's qwen3_moe has no windows
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    mlx_lm_convert(str(tmp_path / "hf"), str(tmp_path / "mlx"), quantize=True, q_group_size=32, q_bits=4)
    theirs, _ = mlx_lm_load(str(tmp_path / "mlx"))
    ours = edgespec.load(tmp_path / "mlx", drafter="none", progress=False, history="off").model
    assert isinstance(ours.layers[3].mlp.switch_mlp.down_proj, QuantizedSwitchLinear)
    assert_close(np.array(ours(mx.array([SHORT]))[0, -1]), np.array(theirs(mx.array([SHORT]))[0, -1]))


def dequantized(model, config: dict):
    """The model of `config`, dense, with `model`'s quantized weights dequantized."""
    import mlx.nn as nn
    from edgespec.models import model_from_config
    from mlx.utils import tree_flatten

    weights = dict(tree_flatten(model.parameters()))
    for path, m in tree_flatten(model.leaf_modules(), is_leaf=nn.Module.is_module):
        if "scales" in m:
            weights[f"{path}.weight"] = mx.dequantize(m["weight"], m["scales"], m.get("biases"),
                                                      group_size=m.group_size, bits=m.bits)
            weights.pop(f"{path}.scales")
            weights.pop(f"{path}.biases", None)
    dense = model_from_config({k: v for k, v in config.items() if k != "quantization"})
    dense.load_weights(list(weights.items()), strict=True)
    return dense


def test_gemma4_quantized_bundle_equals_its_dequantized_weights(tmp_path):
    """`convert --quantize 4`: every projection, both embedding tables and the experts quantized;
    the forward equals the dense model's with the dequantized weights."""
    from edgespec.converters.convert import convert
    from edgespec.models.experts import QuantizedSwitchLinear

    checkpoint(tmp_path / "hf", "gemma4_text", seed=1, intermediate_size=128, moe_intermediate_size=32,
               hidden_size_per_layer_input=32)
    convert(tmp_path / "hf", tmp_path / "q4", quantize="4", group_size=32, dtype="float32", progress=False)
    engine = edgespec.load(tmp_path / "q4", drafter="none", progress=False, history="off")
    model = engine.model
    assert isinstance(model.layers[0].experts.switch_glu.down_proj, QuantizedSwitchLinear)
    assert "scales" in model.model.embed_tokens_per_layer and "scales" in model.layers[5].mlp.down_proj
    dense = dequantized(model, json.loads((tmp_path / "q4" / "config.json").read_text()))
    assert_close(np.array(model(mx.array([SHORT]))[0, -1]), np.array(dense(mx.array([SHORT]))[0, -1]))
    assert engine.generate(SHORT, max_tokens=16, mode="plain").tokens == \
        engine.generate(SHORT, max_tokens=16, mode="auto").tokens


def _modes(arch: str) -> list[tuple[str, dict]]:
    tree_src = "drafter+prompt_lookup+pool" if arch.startswith("qwen") else "prompt_lookup+pool"
    return [("speculative", {}), ("lookahead", {}), ("prompt_lookup", {}), ("tree", {"sources": tree_src}),
            ("cascade", {"mid_layers": "0+1+3"}), ("auto", {}), ("adaptive", {})]


@pytest.mark.parametrize("arch", ["qwen3_moe", "gemma4_text"])
def test_every_mode_is_greedy_identical_to_plain(tmp_path, arch):
    """Qwen3-MoE drafts with a one-layer Qwen3-MoE of the same vocabulary; Gemma 4 with prompt
    lookup (its assistant: the tests below). Drafts are rejected mid-chain."""
    checkpoint(tmp_path / "hf", arch, seed=1)
    if arch.startswith("qwen"):
        checkpoint(tmp_path / "drafter", arch, seed=2, num_hidden_layers=1, mlp_only_layers=[])
        drafter = tmp_path / "drafter"
    else:
        drafter = "prompt_lookup"
    engine = edgespec.load(tmp_path / "hf", drafter=drafter, progress=False, history="off")
    ref = engine.generate(SHORT, max_tokens=32, mode="plain").tokens
    rejected = 0
    for mode, opts in _modes(arch):
        out = engine.generate(SHORT, max_tokens=32, mode=mode, **opts)
        assert out.tokens == ref, mode
        rejected += out.stats.drafted - out.stats.accepted
    assert rejected > 0
    # requests decoded together in one batch (rows at different offsets, windows shorter than
    # them) equal each alone
    prompts = [SHORT, SHORT[5:30], LONG[:50]]
    alone = [engine.generate(p, max_tokens=16, mode="plain").tokens for p in prompts]
    for mode in ("plain", "auto"):
        assert [r.tokens for r in engine.generate_many(prompts, max_tokens=16, mode=mode)] == alone, mode


@pytest.mark.parametrize("arch", ["mistral", "gemma3_text"])
def test_batched_requests_keep_sliding_windows(tmp_path, arch):
    """Every windowed architecture: requests of different lengths decoded in one batch equal
    each alone once their context passes the window (the batched pass's keys sit at their
    positions' slots; the window is measured from them)."""
    from test_architectures import hf_checkpoint

    hf_checkpoint(tmp_path / "hf", arch, seed=1)
    engine = edgespec.load(tmp_path / "hf", drafter="none", progress=False, history="off")
    prompts = [SHORT, SHORT[5:30], LONG[:50]]
    alone = [engine.generate(p, max_tokens=16, mode="plain").tokens for p in prompts]
    assert [r.tokens for r in engine.generate_many(prompts, max_tokens=16, mode="plain")] == alone


# ---------------------------------------------------------------- Gemma 4's assistant

ASSISTANT_TEXT = dict(vocab_size=V, hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, global_head_dim=32, sliding_window=8,
                      layer_types=["sliding_attention", "full_attention"], hidden_size_per_layer_input=0,
                      vocab_size_per_layer_input=0, initializer_range=0.1,
                      rope_parameters=CONFIGS["gemma4_text"][1]["rope_parameters"], **IDS)


def assistant_checkpoint(folder, seed: int = 0, ordered: bool = True):
    text = transformers.Gemma4TextConfig(**ASSISTANT_TEXT)
    config = transformers.Gemma4AssistantConfig(text_config=text, backbone_hidden_size=64,
                                                use_ordered_embeddings=ordered, num_centroids=8,
                                                centroid_intermediate_top_k=3)
    torch.manual_seed(seed)
    model = transformers.Gemma4AssistantForCausalLM(config).eval()
    if ordered:
        model.masked_embedding.token_ordering.copy_(torch.randperm(V, generator=torch.Generator().manual_seed(seed)))
    model.save_pretrained(folder)
    return model


@pytest.mark.parametrize("ordered", [False, True])
def test_assistant_forward_matches_transformers(tmp_path, ordered):
    from edgespec.drafters.assistant import load_assistant_model

    ref = assistant_checkpoint(tmp_path / "a", seed=4, ordered=ordered)
    ours = load_assistant_model(tmp_path / "a")
    g = torch.Generator().manual_seed(1)
    for S in (5, 9, 30):  # shorter and longer than the sliding window + 1
        kv = {"sliding_attention": (torch.randn(1, 2, S, 16, generator=g), torch.randn(1, 2, S, 16, generator=g)),
              "full_attention": (torch.randn(1, 1, S, 32, generator=g), torch.randn(1, 1, S, 32, generator=g))}
        x = torch.randn(1, 1, 128, generator=g)
        with torch.no_grad():
            want = ref(inputs_embeds=x, position_ids=torch.tensor([[S]]), shared_kv_states=kv,
                       attention_mask=torch.ones(1, S + 1, dtype=torch.long))
        logits, hidden = ours(mx.array(x.numpy()), {k: (mx.array(a.numpy()), mx.array(b.numpy()))
                                                    for k, (a, b) in kv.items()}, S)
        assert_close(np.array(logits[0, -1]), want.logits[0, -1].numpy())
        assert_close(np.array(hidden[0, -1]), want.last_hidden_state[0, -1].numpy())


def test_assistant_drafts_as_transformers_drafts_from_the_verifier(tmp_path):
    """One drafting round after a prompt: the drafter reads the verifier's store-layer keys and
    values, its hidden state and embedding as transformers' assistant generator does; the
    same tokens and log-probabilities come out."""
    from edgespec.drafters.assistant import AssistantDrafter
    from edgespec.logits.sampling import Sampler, SamplingParams

    verifier = checkpoint(tmp_path / "hf", "gemma4_text", seed=1)
    assistant = assistant_checkpoint(tmp_path / "hf" / "drafter", seed=5)
    engine = edgespec.load(tmp_path / "hf", progress=False, history="off")
    drafter = engine.drafter
    assert isinstance(drafter, AssistantDrafter)
    prompt = SHORT[:30]
    with torch.no_grad():
        out = verifier(torch.tensor([prompt]), output_hidden_states=True, return_shared_kv_states=True, use_cache=True)
        x0 = int(out.logits[0, -1].argmax())
        kv = {k: (a[:, :, : len(prompt)], b[:, :, : len(prompt)]) for k, (a, b) in out.shared_kv_states.items()}
        hidden, tok, want, want_lp = out.hidden_states[-1][:, -1:], torch.tensor([[x0]]), [], []
        for _ in range(4):
            emb = verifier.get_input_embeddings()(tok)
            step = assistant(inputs_embeds=torch.cat([emb, hidden], -1), position_ids=torch.tensor([[len(prompt)]]),
                             shared_kv_states=kv, attention_mask=torch.ones(1, len(prompt) + 1, dtype=torch.long))
            tok, hidden = step.logits.argmax(-1), step.last_hidden_state
            want.append(int(tok))
            want_lp.append(torch.log_softmax(step.logits[0, -1], -1).numpy())
    cache = engine.model.make_cache()
    assert np.argmax(np.array(engine.model(mx.array([prompt]), cache)[0, -1])) == x0
    drafter.bind_verifier_cache(cache)
    drafter.begin(prompt + [x0])
    d = drafter.draft(4, Sampler(SamplingParams(temperature=0.0)))
    assert d.tokens == want
    sampler = Sampler(SamplingParams(temperature=1.0))
    drafter.sync(prompt + [x0])
    lp = np.array(mx.stack([sampler.logprobs(r) for r in _assistant_logits(drafter, 4, want)]))
    for got_row, want_row in zip(lp, want_lp, strict=True):
        assert_close(np.exp(got_row), np.exp(want_row))


def _assistant_logits(drafter, k: int, tokens: list[int]) -> list[mx.array]:
    """The assistant's logits along the given tokens (teacher-forced), from the drafter's inputs."""
    kv, hidden, p = drafter._inputs()
    tok, out = drafter.seq[-1], []
    for t in tokens[:k]:
        x = mx.concatenate([drafter.verifier.embed(mx.array([[tok]])), hidden], axis=-1)
        logits, hidden = drafter.assistant(x, kv, p)
        out.append(logits[0, -1])
        tok = t
    return out


def test_assistant_speculative_equals_plain_and_auto_uses_it_without_options(tmp_path, monkeypatch):
    """A verifier folder carrying its assistant (drafter/): speculative decoding with it is
    identical to plain, drafts rejected mid-chain; `auto` drafts with it, no option given;
    the converted bundle (`convert --drafter`) carries it too."""
    from edgespec.converters.convert import convert
    from edgespec.models.gemma4 import HiddenKVCache

    from edgespec.drafters.assistant import AssistantDrafter

    verifier = checkpoint(tmp_path / "hf", "gemma4_text", seed=1)
    plain = hf_greedy(verifier, SHORT, 32)
    taught = teach_assistant(assistant_checkpoint(tmp_path / "assistant", seed=5, ordered=False), verifier,
                             SHORT[-1:] + plain)
    taught.save_pretrained(tmp_path / "hf" / "drafter")
    taught.save_pretrained(tmp_path / "assistant")
    convert(tmp_path / "hf", tmp_path / "bundle", quantize="none", dtype="float32", progress=False,
            drafter=tmp_path / "assistant", drafter_options={"coreml": False})
    manifest = json.loads((tmp_path / "bundle" / "manifest.json").read_text())
    assert manifest["drafter"]["kind"] == "gemma4_assistant"
    named = edgespec.load(tmp_path / "bundle", drafter=tmp_path / "assistant", progress=False, history="off")
    assert isinstance(named.drafter, AssistantDrafter)  # the folder named as the drafter
    for path in (tmp_path / "hf", tmp_path / "bundle"):
        engine = edgespec.load(path, progress=False, history="off")
        assert isinstance(engine.drafter, AssistantDrafter), path.name
        assert isinstance(engine.model.make_cache()[0], HiddenKVCache)
        monkeypatch.undo()  # the last engine's counter
        calls = count_drafts(engine.drafter, monkeypatch)
        ref = engine.generate(SHORT, max_tokens=32, mode="plain").tokens
        assert ref == plain
        spec = engine.generate(SHORT, max_tokens=32, mode="speculative", draft_tokens=3)
        assert spec.tokens == ref and spec.stats.drafted > spec.stats.accepted > 0
        acc = spec.stats.accepted_by_position
        assert acc[0] > acc[-1]  # some round kept its first draft and rejected a later one
        calls.clear()
        auto = engine.generate(SHORT, max_tokens=32)  # mode auto, no options
        assert auto.tokens == ref and calls and auto.stats.draft_s > 0
        # sampled: auto keeps plain's seeded draws (its drafts are point-mass candidates)
        seeded = [engine.generate(SHORT, max_tokens=24, temperature=0.8, seed=3, mode=m).tokens
                  for m in ("plain", "auto")]
        assert seeded[0] == seeded[1]


def teach_assistant(assistant, verifier, seq: list[int]):
    """Weights that make the assistant predict the successor its input token has in `seq`
    (a bigram table), so its drafts along that sequence are mostly right: every layer adds
    nothing (o_proj and down_proj zero), pre_projection maps the verifier's embedding of each
    token of `seq` onto a direction of its own, which the tied output rows turn into that
    token's successor. A token followed by different tokens in `seq` drafts one of them."""
    nxt = {}
    for a, b in zip(seq, seq[1:], strict=False):
        nxt.setdefault(a, b)
    targets = sorted(set(nxt.values()))
    E = assistant.config.text_config.hidden_size
    assert len(targets) <= E
    with torch.no_grad():
        for layer in assistant.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        table = torch.zeros(V, E)
        for j, t in enumerate(targets):
            table[t, j] = 1.0
        assistant.model.embed_tokens.weight.copy_(table)
        src = list(nxt)
        emb = verifier.get_input_embeddings()(torch.tensor(src))  # (n, backbone)
        goal = torch.stack([table[nxt[a]] for a in src]) * 10.0  # (n, E)
        A = torch.linalg.lstsq(emb, goal).solution.T  # (E, backbone): A @ emb(a) = goal(a)
        pre = torch.zeros_like(assistant.pre_projection.weight)
        pre[:, : emb.shape[1]] = A
        assistant.pre_projection.weight.copy_(pre)
    return assistant


def test_assistant_refused_where_it_cannot_draft(tmp_path):
    from edgespec.errors import DrafterRequiredError, ModelLoadError

    checkpoint(tmp_path / "hf", "gemma4_text", seed=1)
    assistant_checkpoint(tmp_path / "hf" / "drafter", seed=5)
    engine = edgespec.load(tmp_path / "hf", progress=False, history="off")
    with pytest.raises(DrafterRequiredError, match="drafts from the verifier's cache"):
        engine.generate(SHORT, max_tokens=4, mode="tree")
    with pytest.raises(DrafterRequiredError, match="tiny level"):
        engine.generate(SHORT, max_tokens=4, mode="cascade", mid_layers="0+1")
    checkpoint(tmp_path / "other", "qwen3_moe", seed=1)
    with pytest.raises(ModelLoadError, match="drafts for Gemma 4"):
        edgespec.load(tmp_path / "other", drafter=tmp_path / "hf" / "drafter", progress=False, history="off")
    with pytest.raises(ModelLoadError, match="gemma4_assistant.*drafter"):
        edgespec.load(tmp_path / "hf" / "drafter", progress=False, history="off")
