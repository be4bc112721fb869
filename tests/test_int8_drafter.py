"""The verifier in int8 as auto's drafter (edgespec.drafters.quantized, edgespec/kernels/cpu_q8.c)."""

import mlx.core as mx
import numpy as np
import pytest
from conftest import make_tiny_engine, make_tiny_model
from stats_support import adaptive_continuations, chisq_pvalue, continuation_law

from edgespec.drafters import registry
from edgespec.drafters.quantized import QuantizedDrafter, available, quantize_model, unsupported
from edgespec.engine import make_options
from edgespec.errors import ModelLoadError
from edgespec.generate import prefill
from edgespec.kernels import q8
from edgespec.logits.sampling import Sampler, SamplingParams

# It drafts on the CPU device only: pinned there (a Mac's default device is its GPU).
pytestmark = [pytest.mark.skipif(q8.library() is None, reason="no C compiler for the native kernel"),
              pytest.mark.usefixtures("cpu_device")]


@pytest.mark.parametrize("traditional,rot", [(False, None), (True, None), (False, 4)])
@pytest.mark.parametrize("T,n_scr", [(1, 0), (3, 2), (6, 5)])
def test_the_kernel_computes_what_numpy_does(traditional, rot, T, n_scr):
    """The native pass against numpy (float64) on a random int8 model: a context read with the
    strides of a cache slice (capacity beyond its length), a scratch already holding positions."""
    q = q8.random_model(seed=T, traditional=traditional, rot=rot)
    rng = np.random.default_rng(T)
    n_ctx = 13
    ctx = [tuple(rng.standard_normal((q.Hk, 40, q.D)).astype(np.float32)[:, :n_ctx] for _ in range(2))
           for _ in range(q.L)]
    a, b = q.scratch(16), q.scratch(16)
    for s, t in zip(a, b, strict=True):
        s[:, :, :n_scr] = t[:, :, :n_scr] = rng.standard_normal((q.L, q.Hk, n_scr, q.D))
    toks = [int(x) for x in rng.integers(0, q.V, T)]
    rope = q8.random_rope(n_ctx + n_scr, T, q.rot)
    got = q.forward(toks, ctx, n_ctx, a, n_scr, rope, out_rows=T)
    want = q8.reference_forward(q, toks, ctx, n_ctx, b, n_scr, rope)
    assert np.abs(got - want).max() < 1e-4 * np.abs(want).max()
    assert np.allclose(a[0][:, :, : n_scr + T], b[0][:, :, : n_scr + T],
                       atol=2e-3)  # the new keys kept (activations in int16 on VNNI CPUs)


def test_quantize_rows_round_trips_within_half_a_step():
    w = np.random.default_rng(0).standard_normal((7, 33)).astype(np.float32)
    w[3] = 0.0
    q, s = q8.quantize_rows(w)
    assert q.dtype == np.int8 and np.abs(q).max() <= 127
    assert np.all(np.abs(q * s[:, None] - w) <= s[:, None] / 2 + 1e-7)


def _drafter_logits(model, prompt):
    """The int8 drafter's first draft row over the verifier's cache of prompt[:-1], and the
    float model's logits at the same position."""
    cache = model.make_cache()
    prefill(model, cache, prompt[:-1])
    d = QuantizedDrafter(model, quantize_model(model))
    d.bind_verifier_cache(cache)
    d.begin(prompt)
    draft = d.draft(3, Sampler(SamplingParams(temperature=1.0)))
    want = model(mx.array([prompt], dtype=mx.int32))[0, -1]
    return draft, np.array(want.astype(mx.float32) - mx.logsumexp(want.astype(mx.float32)))


def test_it_drafts_from_the_verifier_cache_close_to_the_float_model():
    """Reading the verifier's keys at the right positions (RoPE included), the int8 pass gives
    nearly the float model's distribution; a wrong position or layer would not."""
    model = make_tiny_model(3, scale=2.0)
    prompt = [5, 9, 12, 40, 7, 7, 30, 2, 19, 61, 8]
    draft, want = _drafter_logits(model, prompt)
    got = np.array(draft.logprobs[0])
    p, r = np.exp(want), np.exp(got)
    assert len(draft.tokens) == 3 and draft.logprobs.shape == (3, model.args.vocab_size)
    assert 0.5 * np.abs(p - r).sum() < 0.05  # total variation
    assert int(np.argmax(got)) == int(np.argmax(want))


def test_greedy_auto_with_it_equals_plain_and_it_drafts(monkeypatch):
    engine = make_tiny_engine(2, scale=2.0)
    engine.auto_drafter = QuantizedDrafter.load(engine)
    calls = []
    draft = QuantizedDrafter.draft

    def counted(self, k, sampler):
        out = draft(self, k, sampler)
        calls.append(len(out.tokens))
        return out

    monkeypatch.setattr(QuantizedDrafter, "draft", counted)
    rng = np.random.default_rng(0)
    for i in range(4):
        prompt = [int(x) for x in rng.integers(1, 64, 6 + 3 * i)]
        plain = engine.generate(prompt, max_tokens=40, mode="plain").tokens
        auto = engine.generate(prompt, max_tokens=40, mode="auto").tokens
        assert auto == plain
    assert sum(calls) > 0  # auto drafted with it


def test_sampled_auto_with_it_follows_the_verifier_law():
    """Chi-square of 3-token continuations of `auto` drafting with it against the exact law."""
    params = dict(temperature=1.0, top_k=3)
    engine = make_tiny_engine(1, scale=1.5, vocab_size=8)
    engine.history = None
    engine.auto_drafter = QuantizedDrafter.load(engine)
    prompt = [1, 2, 3] * 4 + [1, 2]
    n = 3
    law = continuation_law(engine.model, prompt, SamplingParams(**params), n)
    opts = make_options(mode="adaptive", sources="drafter", **params)
    runs = 400
    counts, accepted = adaptive_continuations(engine, prompt, opts, params, n, runs)
    assert accepted > runs // 10  # its drafts were verified
    keys = sorted(law)
    assert sum(counts.values()) == sum(counts.get(k, 0) for k in keys)  # nothing outside the support
    p = chisq_pvalue(np.array([counts.get(k, 0) for k in keys], float), np.array([law[k] for k in keys]))
    assert p > 1e-3, p


def test_which_models_it_takes():
    assert unsupported(make_tiny_model()) is None
    assert "bias" in unsupported(make_tiny_model(attention_bias=True))
    assert available(make_tiny_model()) is None  # the CPU device, the kernel built
    engine = make_tiny_engine(0, mlp_bias=True)
    with pytest.raises(ModelLoadError, match="cannot draft for this model: layer 0 has a bias"):
        registry.load_drafter(engine, "int8")
    assert registry.auto_drafter(engine) is None  # auto keeps the attached drafter there


def test_auto_drafts_with_it_unless_a_drafter_is_named(monkeypatch):
    engine = make_tiny_engine(0)
    engine.auto_drafter = registry.auto_drafter(engine)
    assert isinstance(engine.auto_drafter, QuantizedDrafter)
    registry.attach_drafter(engine, "prompt_lookup")
    assert engine.auto_drafter is None
    monkeypatch.setenv("EDGESPEC_INT8_DRAFTER", "off")
    assert registry.auto_drafter(make_tiny_engine(0)) is None


def test_a_context_it_cannot_read_gives_no_draft():
    model = make_tiny_model()
    d = QuantizedDrafter(model, quantize_model(model))
    d.begin([1, 2, 3])
    assert d.draft(2, Sampler(SamplingParams())).tokens == []  # no verifier cache bound
    d.bind_verifier_cache([object()])  # another layer count
    assert d.draft(2, Sampler(SamplingParams())).tokens == []


def test_a_memory_budget_it_does_not_fit_lets_it_go():
    from edgespec.lookahead.memory import tree_bytes

    engine = make_tiny_engine(0)
    engine.auto_drafter = QuantizedDrafter.load(engine)
    engine.limit_memory(1 << 30)  # room enough: kept
    assert engine.auto_drafter is not None and engine.memory_budget == 1 << 30
    engine.limit_memory(tree_bytes(engine.model) + 1024)  # the verifier's weights and little else
    assert engine.auto_drafter is None and "does not fit" in engine.load_notes[-1]
