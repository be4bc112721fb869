"""The Gated DeltaNet and MoE kernels inside real model code, with Metal emulated: the dispatchers
are told they run on an Apple GPU and the kernels' exact Metal sources run as C++ (the launch
arguments are the ones the Metal path builds). Decoding matches the MLX path, and speculative
and tree decoding through the kernels equal plain decoding through them, states included
(within float32: a pass's projections round differently from single steps' anyway)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from edgespec.kernels import emulate

pytest.importorskip("torch")
pytest.importorskip("transformers")
if emulate.compiler() is None:
    pytest.skip("no C++ compiler to emulate Metal kernels", allow_module_level=True)

from test_recurrent import (  # noqa: E402
    PROMPT,
    Perturbed,
    assert_states_equal,
    hf_hybrid,
    plain_cache,
    recurrent_states,
)

import edgespec  # noqa: E402

F32, I32 = np.float32, np.int32


class Emulated:
    """Stand-ins for delta_rule_metal and expert_glu_metal that run the emulated kernels, and
    the calls they saw."""

    def __init__(self, folder):
        self.folder, self.built, self.calls = folder, {}, []

    def _kernel(self, spec, ins, n_out):
        key = (spec, tuple(a.dtype.str for a in ins))
        if key not in self.built:
            self.built[key] = emulate.EmulatedKernel(spec, [a.dtype for a in ins], [F32] * n_out, self.folder)
        return self.built[key]

    def delta(self, q, k, v, g, beta, S, parents=None):
        from edgespec.kernels.delta import delta_spec, emulator_inputs

        mx.eval(q, k, v, g, beta, S)
        ins, grid, shapes = emulator_inputs(*(np.array(a.astype(mx.float32)) for a in (q, k, v, g, beta, S)), parents)
        out, state, _ = self._kernel(delta_spec(k.shape[-1]), ins, 3)(ins, grid, shapes, init=np.nan)
        self.calls.append(("delta", q.shape[1], parents))
        return mx.array(out), mx.array(state)

    def experts(self, x, indices, gate, up, down, activation):
        from edgespec.kernels.experts import launch_args

        mx.eval(x, indices)
        npd = [{k: np.array(v) if isinstance(v, mx.array) else v for k, v in p.items()} for p in (gate, up, down)]
        h = None
        for spec, ins, grid, shape in launch_args(np.array(x), np.array(indices), *npd, activation):
            ins = ins if h is None else [h, *ins]
            (h,) = self._kernel(spec, ins, 1)(ins, grid, [shape], init=np.nan)
        self.calls.append(("experts", x.shape[0]))
        return mx.array(h)


@pytest.fixture
def metal(monkeypatch, tmp_path_factory):
    """Switches the Metal paths on, emulated; yields the Emulated recorder."""
    emu = Emulated(tmp_path_factory.mktemp("emu"))

    def on(value: bool):
        monkeypatch.setattr("edgespec.caches.recurrent.on_metal", lambda: value)
        monkeypatch.setattr("edgespec.caches.recurrent.delta_rule_metal", emu.delta)
        monkeypatch.setattr("edgespec.models.experts.on_metal", lambda: value)
        monkeypatch.setattr("edgespec.models.experts.expert_glu_metal", emu.experts)

    emu.on = on
    return emu


@pytest.fixture(scope="module")
def qwen35(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3_5")
    hf_hybrid(folder, "qwen3_5_text")
    return edgespec.load(folder, drafter="none", progress=False, history="off")


@pytest.fixture(scope="module")
def qwen3moe_folder(tmp_path_factory):
    from test_arch_moe_gemma4 import checkpoint

    folder = tmp_path_factory.mktemp("qwen3_moe")
    checkpoint(folder, "qwen3_moe")
    return folder


@pytest.fixture(scope="module")
def qwen3moe(qwen3moe_folder):
    return edgespec.load(qwen3moe_folder, drafter="none", progress=False, history="off")


def test_qwen3_5_decodes_through_the_kernel_like_mlx(qwen35, metal):
    """Prefill (chunked form, 80 positions) then decoding steps through the kernel: the same
    greedy tokens as MLX's loop, and recurrent states within float32 rounding."""
    prompt, n = PROMPT, 24
    metal.on(False)
    want = qwen35.generate(prompt, max_tokens=n, mode="plain").tokens
    want_states = recurrent_states(plain_cache(qwen35.model, prompt + want[:-1]))
    metal.on(True)
    assert qwen35.generate(prompt, max_tokens=n, mode="plain").tokens == want
    assert any(c[0] == "delta" and c[1] == 1 for c in metal.calls)  # the decoding steps took it
    got_states = recurrent_states(plain_cache(qwen35.model, prompt + want[:-1]))
    for a, b in zip(got_states, want_states, strict=True):
        for x, y in zip(a[:-1], b[:-1], strict=True):
            np.testing.assert_allclose(np.array(x), np.array(y), rtol=1e-4, atol=1e-5)


def test_speculation_and_trees_through_the_kernel_equal_plain(qwen35, metal):
    from edgespec.drafters.mlx_drafter import MLXDrafter
    from edgespec.generate import GenerationStats
    from edgespec.logits.sampling import Sampler, SamplingParams
    from edgespec.modes.speculative import SpeculativeMode
    from edgespec.options import GenerateOptions

    metal.on(True)
    model, prompt = qwen35.model, PROMPT[:20]
    mode = SpeculativeMode(model, MLXDrafter(Perturbed(model)), GenerateOptions(draft_tokens=5))
    stats = GenerationStats()
    steps = mode.steps(prompt, Sampler(SamplingParams(temperature=0.0)), stats)
    out = [next(steps).id for _ in range(26)]
    assert 0 < stats.accepted < stats.drafted  # drafts rejected mid-chain: states recomputed
    assert out == qwen35.generate(prompt, max_tokens=26, mode="plain").tokens
    n = mode.cache[0].offset
    # the projections of a pass and of single steps round differently (BLAS), so within float32
    assert_states_equal(recurrent_states(mode.cache), recurrent_states(plain_cache(model, (prompt + out)[:n])))
    steps.close()
    assert any(c[0] == "delta" and c[1] == 6 for c in metal.calls)  # verify passes of 5 drafts + 1
    # a tree pass (two branches below the root; the second accepted), committed: plain's state
    from edgespec.generate import prefill
    from edgespec.kernels import commit_kv
    from edgespec.lookahead import StepTree
    from edgespec.lookahead.verify import tree_forward

    seq = PROMPT[:30]
    cache = model.make_cache()
    prefill(model, cache, seq[:22])
    tree = StepTree.rooted(seq[22])
    tree.add_path([7, 8, 9])
    tree.add_path(seq[23:26])
    metal.calls.clear()
    logits = tree_forward(model, cache, tree)
    assert [c[2] for c in metal.calls if c[0] == "delta"][0] == [-1, 0, 1, 2, 0, 4, 5]
    plain = plain_cache(model, seq[:22])
    chain = model(mx.array([seq[22:26]]), plain)[0]
    branch = [0, 4, 5, 6]
    np.testing.assert_allclose(np.array(logits[mx.array(branch)]), np.array(chain), atol=1e-4, rtol=1e-4)
    commit_kv(cache, 22, branch)
    assert_states_equal(recurrent_states(cache), recurrent_states(plain))


def test_qwen3_moe_through_the_expert_kernels_decodes_like_gather_mm(qwen3moe, metal):
    from edgespec.drafters.mlx_drafter import MLXDrafter
    from edgespec.kernels.experts import MAX_TOKENS

    prompt = PROMPT[:30]
    metal.on(False)
    want = qwen3moe.generate(prompt, max_tokens=20, mode="plain").tokens
    cache = qwen3moe.model.make_cache()
    ref = qwen3moe.model(mx.array([prompt[:12]]), cache)
    metal.on(True)
    cache = qwen3moe.model.make_cache()
    got = qwen3moe.model(mx.array([prompt[:12]]), cache)  # a 12-token pass: the kernels
    assert metal.calls and all(c == ("experts", 12) for c in metal.calls)
    np.testing.assert_allclose(np.array(got), np.array(ref), rtol=1e-4, atol=1e-4)
    assert qwen3moe.generate(prompt, max_tokens=20, mode="plain").tokens == want
    assert not any(c[0] == "experts" and c[1] > MAX_TOKENS for c in metal.calls)  # the prompt took gather_mm
    qwen3moe.drafter = MLXDrafter(Perturbed(qwen3moe.model))
    try:
        res = qwen3moe.generate(prompt, max_tokens=20, mode="speculative", draft_tokens=4)
    finally:
        qwen3moe.drafter = None
    assert res.tokens == want and res.stats.drafted > res.stats.accepted > 0


def test_qwen3_moe_with_4bit_experts_through_the_kernels_matches_gather_qmm(qwen3moe_folder, metal):
    import mlx.nn as nn
    from edgespec.models.experts import QuantizedSwitchLinear, SwitchLinear

    model = edgespec.load(qwen3moe_folder, drafter="none", progress=False, history="off").model
    nn.quantize(model, group_size=32, bits=4, class_predicate=lambda _, m: isinstance(m, SwitchLinear))
    assert any(isinstance(m, QuantizedSwitchLinear) for _, m in model.named_modules())
    x = mx.array([PROMPT[:6]])
    metal.on(False)
    want = model(x, model.make_cache())
    metal.on(True)
    got = model(x, model.make_cache())
    assert metal.calls and all(c == ("experts", 6) for c in metal.calls)
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-4, atol=1e-4)
