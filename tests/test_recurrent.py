"""Recurrent layers (LFM2 short convolutions, Qwen3.5 Gated DeltaNet): against transformers,
and speculation on them: every decoding mode equals plain decoding with drafts rejected
mid-chain, and the recurrent state after a rollback equals plain decoding's."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from stats_support import chisq_pvalue, continuation_counts, continuation_law

from edgespec.caches.recurrent import StateCache, delta_chunked, delta_recurrent, tree_parents
from edgespec.generate import GenerationStats, PlainMode, prefill

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

V = 320
ARCHS = {
    "lfm2": lambda vocab, init: transformers.Lfm2Config(
        vocab_size=vocab, hidden_size=64, intermediate_size=160, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, conv_L_cache=4, layer_types=["conv", "full_attention", "conv", "conv"],
        block_multiple_of=16, block_ffn_dim_multiplier=1.5, max_position_embeddings=512, initializer_range=init,
        norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 20000.0},
        eos_token_id=0, bos_token_id=1, pad_token_id=0),
    "qwen3_5_text": lambda vocab, init: transformers.Qwen3_5TextConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=8, linear_value_head_dim=12, linear_conv_kernel_dim=3,
        layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": 30000.0, "partial_rotary_factor": 0.5},
        initializer_range=init, eos_token_id=0, bos_token_id=1, pad_token_id=0),
}
PROMPT = [int(t) for t in np.random.RandomState(3).randint(1, V, size=80)]  # > chunk (64) and conv width


def hf_hybrid(folder, arch: str, seed: int = 1, vocab: int = V, init: float = 0.3):
    """A random fp32 transformers model of `arch` (every parameter random, norms included),
    saved to `folder` with a tokenizer."""
    from test_architectures import vocab_tokenizer

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(ARCHS[arch](vocab, init), dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.rand_like(p) * 2 - 1)
            elif p.ndim == 1:  # norms, dt_bias, conv bias: away from their constant init
                p.add_(0.2 * torch.randn_like(p))
    model.save_pretrained(folder)
    vocab_tokenizer(vocab).save(folder)
    return model


def recurrent_states(cache) -> list:
    return [c.export_span(0, c.offset) for c in cache if isinstance(c, StateCache)]


def assert_states_equal(got, want, atol=1e-5):
    assert len(got) == len(want) and got
    for a, b in zip(got, want, strict=True):
        assert a is not None and b is not None
        assert int(a[-1].item()) == int(b[-1].item())  # same position
        for x, y in zip(a[:-1], b[:-1], strict=True):
            np.testing.assert_allclose(np.array(x), np.array(y), atol=atol, rtol=1e-4)


def plain_cache(model, tokens):
    """Caches after plain decoding of `tokens`: the prompt's prefill, then one step per token."""
    cache = model.make_cache()
    prefill(model, cache, tokens[:1])
    for t in tokens[1:]:
        model(mx.array([[t]]), cache)
    return cache


class Perturbed:
    """A drafter model: the verifier's own logits, except that at every third position its top
    token is pushed down, so chains are accepted up to there and rejected mid-chain."""

    def __init__(self, model):
        self._model = model

    def __getattr__(self, name):
        return getattr(self._model, name)

    def __call__(self, inputs, cache=None, **kw):
        out = self._model(inputs, cache, **kw)
        T = inputs.shape[1]
        end = max(c.offset for c in cache)
        bad = ((mx.arange(end - T, end) + 1) % 3 == 0)[None, :, None]
        return mx.where(bad & (out == out.max(axis=-1, keepdims=True)), out - 30.0, out)


@pytest.fixture(scope="module", params=list(ARCHS))
def hybrid(request, tmp_path_factory):
    import edgespec

    folder = tmp_path_factory.mktemp(request.param)
    ref = hf_hybrid(folder, request.param)
    return request.param, folder, ref, edgespec.load(folder, drafter="none", progress=False, history="off")


# ---------------------------------------------------------------- the math against transformers


def test_delta_rule_recurrent_and_chunked_forms_match_transformers():
    """Both forms against transformers' reference functions, from a non-zero state, over 150
    positions (chunks of 64 with a partial last one)."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as ref

    rng = np.random.RandomState(0)
    B, T, H, Dk, Dv = 1, 150, 3, 8, 12
    q, k = (rng.randn(B, T, H, Dk).astype(np.float32) for _ in range(2))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.randn(B, T, H, Dv).astype(np.float32)
    g = -np.abs(rng.randn(B, T, H)).astype(np.float32) * 0.3
    beta = (1 / (1 + np.exp(-rng.randn(B, T, H)))).astype(np.float32)
    S0 = rng.randn(B, H, Dk, Dv).astype(np.float32) * 0.1
    t = [torch.tensor(a) for a in (q, k, v, g, beta, S0)]
    want_out, want_S = ref.torch_recurrent_gated_delta_rule(*t[:5], initial_state=t[5], output_final_state=True)
    chunk_out, chunk_S = ref.torch_chunk_gated_delta_rule(*t[:5], initial_state=t[5], output_final_state=True)
    np.testing.assert_allclose(chunk_out.numpy(), want_out.numpy(), atol=1e-4)  # the references agree
    m = [mx.array(a) for a in (q * Dk**-0.5, k, v, g, beta, S0)]
    for fn in (delta_recurrent, delta_chunked):
        out, S = fn(*m)
        np.testing.assert_allclose(np.array(out), want_out.numpy(), atol=1e-4, rtol=1e-4)
        np.testing.assert_allclose(np.array(S), want_S.numpy(), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_architecture_matches_transformers(tmp_path, arch):
    """HF folder and converted bundle: last-token logits after an 80-token prompt (longer than
    the convolution and the delta rule's chunk) within 1e-4 relative, also prefilled in chunks
    of 30; 32 greedy tokens identical to transformers in plain and auto."""
    from edgespec.converters.convert import convert
    from test_architectures import assert_close, hf_greedy, hf_last_logits

    import edgespec

    ref = hf_hybrid(tmp_path / "hf", arch)
    want_logits = hf_last_logits(ref, PROMPT)
    want_tokens = hf_greedy(ref, PROMPT[:20], 32)
    assert len(set(want_tokens)) > 3
    convert(tmp_path / "hf", tmp_path / "bundle", quantize="none", dtype="float32", progress=False)
    for path in (tmp_path / "hf", tmp_path / "bundle"):
        engine = edgespec.load(path, drafter="none", progress=False, history="off")
        model = engine.model
        assert model.args.model_type == arch
        assert_close(np.array(model(mx.array([PROMPT]))[0, -1]), want_logits)
        assert_close(np.array(prefill(model, model.make_cache(), PROMPT, chunk=30)), want_logits)
        for mode in ("plain", "auto"):
            got = engine.generate(PROMPT[:20], max_tokens=32, mode=mode).tokens
            assert got == want_tokens, f"{path.name} mode {mode}"


def test_qwen3_5_multimodal_checkpoint_loads_its_text_model(tmp_path):
    """A `qwen3_5` folder (text_config nested, weights under model.language_model, a vision
    tower) gives the text model's logits."""
    import edgespec

    text = ARCHS["qwen3_5_text"](V, 0.3)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                  patch_size=4, temporal_patch_size=1, spatial_merge_size=1)
    cfg = transformers.Qwen3_5Config(text_config=text.to_dict(), vision_config=vision)
    torch.manual_seed(4)
    full = transformers.Qwen3_5ForConditionalGeneration(cfg).eval()
    full.save_pretrained(tmp_path / "mm")
    from test_architectures import vocab_tokenizer

    vocab_tokenizer(V).save(tmp_path / "mm")
    with torch.no_grad():
        want = full(input_ids=torch.tensor([PROMPT])).logits[0, -1].numpy()
    engine = edgespec.load(tmp_path / "mm", drafter="none", progress=False, history="off")
    got = np.array(engine.model(mx.array([PROMPT]))[0, -1])
    assert float(np.abs(got - want).max() / np.abs(want).max()) < 1e-4


# ---------------------------------------------------------------- the state protocol


def test_rollback_and_tree_branches_restore_plain_states(hybrid):
    """A verify pass of 6 positions trimmed to 2 kept, and a tree pass whose accepted branch
    is not the first, leave exactly plain decoding's state; a rollback past the round is refused."""
    from edgespec.lookahead import StepTree
    from edgespec.lookahead.verify import tree_forward

    _, _, _, engine = hybrid
    model = engine.model
    seq = PROMPT[:30]
    cache = model.make_cache()
    prefill(model, cache, seq[:20])
    model(mx.array([seq[20:26]]), cache)  # 6 positions verified ...
    for c in cache:
        c.trim(4)  # ... 2 kept
    assert_states_equal(recurrent_states(cache), recurrent_states(plain_cache(model, seq[:22])))
    # a tree: root x0 = seq[22], branch A (wrong tokens), branch B = seq[23:26] below the root
    tree = StepTree.rooted(seq[22])
    tree.add_path([7, 8, 9])
    tree.add_path(seq[23:26])
    logits = tree_forward(model, cache, tree)
    chain = model(mx.array([seq[22:26]]), plain := plain_cache(model, seq[:22]))[0]
    branch = [0, 4, 5, 6]  # root, then branch B's nodes
    np.testing.assert_allclose(np.array(logits[mx.array(branch)]), np.array(chain), atol=1e-4, rtol=1e-4)
    from edgespec.kernels import commit_kv

    commit_kv(cache, 22, branch)
    assert cache[0].offset == 26
    assert_states_equal(recurrent_states(cache), recurrent_states(plain))
    # one more step from the committed branch matches plain's next step
    a = model(mx.array([[seq[26]]]), cache)[0, -1]
    b = model(mx.array([[seq[26]]]), plain)[0, -1]
    np.testing.assert_allclose(np.array(a), np.array(b), atol=1e-4, rtol=1e-4)
    # the log restarts at the current position once it holds LOG_LIMIT positions: a rollback
    # past that start is refused by name
    from edgespec.caches.recurrent import LOG_LIMIT

    long = model.make_cache()
    prefill(model, long, (PROMPT * 3)[: LOG_LIMIT + 10])
    model(mx.array([[5]]), long)
    with pytest.raises(ValueError, match="cannot roll back"):
        long[0].trim(2)
    assert long[0].trim(1) == 1  # within the round: fine


def test_a_drafting_round_across_the_log_restart_rolls_back_exactly(hybrid):
    """One-token passes past LOG_LIMIT: the log restarts mid-round at a snapshot, so a round
    of 12 single-token drafts is still undone exactly (the drafter's pattern)."""
    from edgespec.caches.recurrent import LOG_LIMIT

    _, _, _, engine = hybrid
    model = engine.model
    seq = (PROMPT * 4)[: LOG_LIMIT + 40]
    cache = model.make_cache()
    prefill(model, cache, seq[:4])
    for t in seq[4 : LOG_LIMIT - 5]:
        model(mx.array([[t]]), cache)
    for t in seq[LOG_LIMIT - 5 : LOG_LIMIT + 7]:  # 12 drafts, the restart among them
        model(mx.array([[t]]), cache)
    for c in cache:
        c.trim(9)  # 3 kept
    assert cache[0].offset == LOG_LIMIT - 2
    assert_states_equal(recurrent_states(cache), recurrent_states(plain_cache(model, seq[: LOG_LIMIT - 2])))


def test_export_import_span_continues_like_the_original(hybrid):
    """The prefix cache's protocol: a state exported at the end of a prompt, imported into
    fresh caches (attention spans with it), continues exactly; other spans give None."""
    _, _, _, engine = hybrid
    model = engine.model
    cache = model.make_cache()
    prefill(model, cache, PROMPT[:40])
    fresh = model.make_cache()
    for src, dst in zip(cache, fresh, strict=True):
        parts = src.export_span(0, 40)
        assert parts is not None
        dst.import_span(parts)
        if src.span_kind == "state":
            assert src.export_span(0, 39) is None and src.export_span(10, 40) is not None
    assert all(c.offset == 40 for c in fresh)
    a = model(mx.array([PROMPT[40:44]]), cache)[0, -1]
    b = model(mx.array([PROMPT[40:44]]), fresh)[0, -1]
    np.testing.assert_allclose(np.array(a), np.array(b), atol=1e-5, rtol=1e-5)


def test_tree_parents_are_read_off_the_mask_and_bad_masks_are_refused():
    from edgespec.kernels import tree_mask

    mask, _ = tree_mask(mx.array([-1, 0, 0, 2, 1], dtype=mx.int32), 5)
    assert tree_parents(mask, 5, 5) == [-1, 0, 0, 2, 1]
    chain, _ = tree_mask(mx.array([-1, 0, 1], dtype=mx.int32), 5)
    assert tree_parents(chain, 5, 3) is None and tree_parents("causal", 5, 3) is None
    hole = np.array(mask)
    hole[1, 2] = False  # node 1 does not see the cached position 2: a tree across passes
    with pytest.raises(ValueError, match="whole cached prefix"):
        tree_parents(mx.array(hole), 5, 5)
    odd = np.array(mask)
    odd[3, 6] = True  # node 3 also sees node 1, not on its path
    with pytest.raises(ValueError, match="tree mask"):
        tree_parents(mx.array(odd), 5, 5)


# ---------------------------------------------------------------- every decoding mode


MODES = [("speculative", {"draft_tokens": 4}), ("cascade", {"draft_tokens": 4}), ("auto", {}),
         ("adaptive", {}), ("prompt_lookup", {"draft_tokens": 4}), ("lookahead", {}),
         ("tree", {"sources": "prompt_lookup+pool"}),
         # the default tree's controller may choose plain steps from its timings (exact, checked
         # above); its always-full form must speculate, so the rejection path is reached
         ("tree", {"sources": "prompt_lookup+pool", "adaptive": 0})]
MAY_NOT_DRAFT = {("tree", (("sources", "prompt_lookup+pool"),))}  # timing-driven
DRAFTING = ("speculative", "cascade", "auto")  # chains from the perturbed drafter: some accepted


def test_every_mode_greedy_equals_plain_with_mid_chain_rejections(hybrid):
    from edgespec.drafters.mlx_drafter import MLXDrafter

    _, _, _, engine = hybrid
    engine.drafter = MLXDrafter(Perturbed(engine.model))
    prompts = [PROMPT[:7], PROMPT[:25], PROMPT[3:9] * 4]
    try:
        refs = [engine.generate(p, max_tokens=30, mode="plain").tokens for p in prompts]
        for mode, opts in MODES:
            drafted = accepted = 0
            for p, ref in zip(prompts, refs, strict=True):
                res = engine.generate(p, max_tokens=30, mode=mode, **opts)
                assert res.tokens == ref, (mode, p)
                drafted += res.stats.drafted
                accepted += res.stats.accepted
            if (mode, tuple(sorted(opts.items()))) in MAY_NOT_DRAFT:
                continue
            assert drafted > accepted, (mode, opts)  # drafts were rejected
            if mode in DRAFTING:
                assert accepted > 0, mode  # ... after accepted ones: mid-chain
        # the batch (one pass per sequence for recurrent layers) gives each prompt's reply
        many = engine.generate_many(prompts, max_tokens=30, mode="plain")
        assert [r.tokens for r in many] == refs
    finally:
        engine.drafter = None


def test_speculative_state_after_rejections_equals_plain(hybrid):
    """After rounds with mid-chain rejections, the verifier's and the drafter's recurrent
    states equal those of plain decoding over the same tokens."""
    from edgespec.drafters.mlx_drafter import MLXDrafter
    from edgespec.logits.sampling import Sampler, SamplingParams
    from edgespec.modes.speculative import SpeculativeMode
    from edgespec.options import GenerateOptions

    _, _, _, engine = hybrid
    model = engine.model
    drafter = MLXDrafter(Perturbed(model))
    mode = SpeculativeMode(model, drafter, GenerateOptions(draft_tokens=5))
    stats = GenerationStats()
    steps = mode.steps(PROMPT[:20], Sampler(SamplingParams(temperature=0.0)), stats)
    out = [next(steps).id for _ in range(26)]
    assert 0 < stats.accepted < stats.drafted
    assert any(0 < a < d for a, d in zip(stats.accepted_by_position, stats.drafted_by_position, strict=True))
    seq = PROMPT[:20] + out
    n = mode.cache[0].offset
    assert_states_equal(recurrent_states(mode.cache), recurrent_states(plain_cache(model, seq[:n])))
    d = drafter.cache[0].offset
    assert_states_equal(recurrent_states(drafter.cache), recurrent_states(plain_cache(model, seq[:d])))
    steps.close()


def test_tree_drafting_with_a_recurrent_drafter_is_refused_by_name(hybrid):
    from edgespec.drafters.mlx_drafter import MLXDrafter

    _, _, _, engine = hybrid
    engine.drafter = MLXDrafter(Perturbed(engine.model))
    try:
        with pytest.raises(ValueError, match="recurrent layers.*speculative"):
            engine.generate(PROMPT[:7], max_tokens=4, mode="tree")
    finally:
        engine.drafter = None


# ---------------------------------------------------------------- sampling


def test_seeded_sampling_in_auto_equals_plain(hybrid):
    from edgespec.drafters.mlx_drafter import MLXDrafter

    _, _, _, engine = hybrid
    engine.drafter = MLXDrafter(Perturbed(engine.model))
    try:
        for seed in (1, 2):
            kw = dict(max_tokens=24, temperature=0.8, top_k=20, seed=seed)
            plain = engine.generate(PROMPT[:12], mode="plain", **kw).tokens
            auto = engine.generate(PROMPT[:12], mode="auto", **kw)
            assert auto.tokens == plain
    finally:
        engine.drafter = None


def test_speculative_sampling_on_a_hybrid_model_matches_the_exact_law(tmp_path):
    """Chi-square of 3-token continuations of speculative sampling (K=2, perturbed drafter)
    against the law enumerated from plain decoding, on an 8-token Qwen3.5."""
    import edgespec
    from edgespec.drafters.mlx_drafter import MLXDrafter
    from edgespec.modes.speculative import SpeculativeMode
    from edgespec.options import GenerateOptions

    hf_hybrid(tmp_path, "qwen3_5_text", seed=5, vocab=8, init=0.6)
    model = edgespec.load(tmp_path, drafter="none", progress=False, history="off").model
    prompt, params = [1, 5, 2, 7], dict(temperature=1.0)
    from edgespec.logits.sampling import SamplingParams

    law = continuation_law(model, prompt, SamplingParams(**params), 3)
    keys = list(law)
    mode = SpeculativeMode(model, MLXDrafter(Perturbed(model)), GenerateOptions(draft_tokens=2))
    counts, accepted = continuation_counts(mode, prompt, params, keys, 600, 3)
    assert accepted > 0
    pv = chisq_pvalue(counts, np.array([law[k] for k in keys]))
    assert pv > 1e-3, f"speculative samples on a hybrid model differ from plain's law (p-value {pv:.2g})"
    # the same counts against a wrong law (the first token's distribution flattened) fail
    wrong = np.array([law[k] for k in keys]) ** 0.5
    assert chisq_pvalue(counts, wrong / wrong.sum()) < 1e-3


def test_plain_mode_on_a_hybrid_model_streams_like_prefill_and_steps(hybrid):
    """PlainMode's tokens are argmaxes of prefill then single steps (the reference the
    other tests compare against is itself the recurrent decode path)."""
    _, _, ref, engine = hybrid
    model = engine.model
    stats = GenerationStats()
    from edgespec.logits.sampling import Sampler, SamplingParams

    steps = PlainMode(model).steps(PROMPT[:10], Sampler(SamplingParams(temperature=0.0)), stats)
    got = [next(steps).id for _ in range(8)]
    steps.close()
    with torch.no_grad():
        want = ref.generate(torch.tensor([PROMPT[:10]]), max_new_tokens=8, do_sample=False,
                            pad_token_id=0, eos_token_id=None)[0, 10:].tolist()
    assert got == want


def test_distributed_split_of_a_hybrid_bundle_is_refused_by_name(hybrid, tmp_path):
    from edgespec.converters.convert import convert

    from edgespec.distributed.errors import DistributedError
    from edgespec.distributed.shard import load_shard

    arch, folder, _, _ = hybrid
    convert(folder, tmp_path / "bundle", quantize="none", dtype="float32", progress=False)
    with pytest.raises(DistributedError, match=f"{arch}.*recurrent"):
        load_shard(tmp_path / "bundle", "pipeline", 0, 2)


@pytest.mark.parametrize("mode", ["plain", "speculative", "auto"])
def test_prefix_cache_restores_recurrent_states(hybrid, mode):
    """The engine's prefix cache on a hybrid model: a second request sharing a long prefix
    restores it (recurrent states at a block boundary, attention spans) and replies exactly as
    without the cache."""
    import edgespec
    from edgespec.drafters.mlx_drafter import MLXDrafter

    _, folder, _, _ = hybrid
    first, second = PROMPT[:70] + [5, 6, 7], PROMPT[:70] + [9, 9, 2, 4]
    kw = dict(max_tokens=16, mode=mode, draft_tokens=3 if mode == "speculative" else "auto")
    replies = []
    for size in (0, 1 << 26):
        engine = edgespec.load(folder, drafter="none", progress=False, history="off", prompt_cache_bytes=size)
        engine.drafter = MLXDrafter(Perturbed(engine.model)) if mode != "plain" else None
        engine.generate(first, **kw)
        res = engine.generate(second, **kw)
        assert (res.stats.cached_tokens >= 32) == (size > 0)
        replies.append(res.tokens)
    assert replies[0] == replies[1]


def test_saved_session_of_a_hybrid_model_restores_and_continues_exactly(hybrid, tmp_path):
    """A saved prompt cache (edgespec.caches.sessions: the prefix cache's parts in safetensors) of a
    hybrid model loads into a fresh engine and the reply equals one computed without it."""
    import edgespec
    from edgespec.caches import sessions

    _, folder, _, _ = hybrid
    prompt = PROMPT[:75]

    def fresh(size):
        return edgespec.load(folder, drafter="none", progress=False, history="off", prompt_cache_bytes=size)

    want = fresh(0).generate(prompt + [3, 4], max_tokens=12, mode="plain").tokens
    first = fresh(1 << 26)
    first.generate(prompt, max_tokens=4, mode="plain")
    assert sessions.save(first, tmp_path / "s.cache", prompt) >= 32
    second = fresh(1 << 26)
    _, _, positions = sessions.load(second, tmp_path / "s.cache")
    assert positions >= 32
    res = second.generate(prompt + [3, 4], max_tokens=12, mode="plain")
    assert res.stats.cached_tokens >= 32 and res.tokens == want


def test_tree_mode_with_an_attention_drafter_verifies_branches_on_a_hybrid_model(hybrid):
    """Tree mode grows branches with an attention-only drafter; the hybrid verifier scores
    them with per-branch recurrent states and keeps the accepted one: output equals plain."""
    from conftest import make_tiny_model

    from edgespec.drafters.mlx_drafter import MLXDrafter

    _, _, _, engine = hybrid
    engine.drafter = MLXDrafter(make_tiny_model(3, vocab_size=V, num_hidden_layers=1))
    try:
        for p in (PROMPT[:9], PROMPT[5:30]):
            want = engine.generate(p, max_tokens=20, mode="plain").tokens
            res = engine.generate(p, max_tokens=20, mode="tree", shape="static", branching="3x2x1",
                                  sources="drafter+prompt_lookup", adaptive=0)
            assert res.tokens == want
            assert res.stats.drafted > res.stats.accepted
    finally:
        engine.drafter = None
