"""The Mac's numerics on any device (edgespec.weights.numerics, docs/numerics.md): numerics="metal"
loads a model as Metal would (4-bit weights kept quantized, float16 activations and KV caches),
and `auto` picks its drafter as on a Mac (edgespec.drafters.registry.auto_drafter_choice).

The tier: tiny models in Metal's numerics (every mode equal to plain, seeded sampling, prefix
cache and sessions, the exactness fuzzer at a small budget), and the default model in them
(`real_model`). `EDGESPEC_METAL_FUZZ_CASES=N` runs N fuzzer cases instead of the CI budget.
"""

from __future__ import annotations

import argparse
import os

import mlx.core as mx
import pytest
from conftest import make_tiny_model, make_tiny_tokenizer, write_tiny_hf_folder
from exact_fuzz import Verifiers, run_cases
from mlx.utils import tree_map

import edgespec
from edgespec.caches import sessions
from edgespec.drafters import registry
from edgespec.drafters.quantized import QuantizedDrafter
from edgespec.errors import ModelLoadError
from edgespec.weights import numerics
from edgespec.weights.loader import LoadedModel, gguf_device_defaults, quantize_dense

MODES = ("auto", "speculative", "lookahead", "prompt_lookup", "tree", "cascade")
# The default model: cascade first searches the verifier layers it skips (once per model, minutes
# here), so the tiny tier covers it.
REAL_MODES = tuple(m for m in MODES if m != "cascade")
FUZZ_CASES = int(os.environ.get("EDGESPEC_METAL_FUZZ_CASES", "10"))


def test_a_bad_setting_is_one_line_naming_the_valid_ones_before_any_load(monkeypatch, tmp_path):
    missing = tmp_path / "no-such-model"  # a load would say "no such file": the setting fails first
    with pytest.raises(ValueError, match=r"^numerics must be one of native, metal, got 'cuda'$"):
        edgespec.load(missing, numerics="cuda", progress=False)
    monkeypatch.setenv("EDGESPEC_NUMERICS", "fp8")
    with pytest.raises(ValueError, match=r"^EDGESPEC_NUMERICS must be one of native, metal, got 'fp8'$"):
        edgespec.load(missing, progress=False)
    monkeypatch.setenv("EDGESPEC_NUMERICS", "Metal")
    assert numerics.resolve() == "metal" and numerics.resolve("native") == "native"
    with pytest.raises(ModelLoadError, match="no such file"):  # a good setting: the load goes on
        edgespec.load(missing, progress=False)


def test_every_loading_command_takes_numerics(monkeypatch):
    from edgespec.apps import common

    p = argparse.ArgumentParser()
    common.add_model_arguments(p)
    assert "--numerics" in p.format_help()
    with pytest.raises(SystemExit):
        p.parse_args(["--numerics", "fp8"])
    seen = {}

    class Loaded(Exception):
        pass

    def load(*args, **kw):
        seen.update(kw)
        raise Loaded

    monkeypatch.setattr(edgespec, "load", load)
    with pytest.raises(Loaded):
        common.load_engine(p.parse_args(["--numerics", "metal"]), progress=False)
    assert seen["numerics"] == "metal"


def test_metal_numerics_loads_a_folder_as_convert_would_on_a_mac(tmp_path):
    folder = write_tiny_hf_folder(tmp_path / "hf", 0, scale=3.0)
    native = edgespec.load(folder, drafter="none", progress=False, history="off")
    metal = edgespec.load(folder, drafter="none", progress=False, history="off", numerics="metal")
    assert native.loaded.numerics == "native" and metal.loaded.numerics == "metal"
    assert native.model.model.norm.weight.dtype == mx.float32
    assert "scales" not in native.model.layers[0].self_attn.q_proj
    q = metal.model.layers[0].self_attn.q_proj
    assert q.bits == 4 and q.group_size == 64 and q.scales.dtype == mx.float16
    assert type(q).__name__ == "HalfQuantizedLinear"  # Metal's float16 products, also on the CPU
    assert metal.model.model.norm.weight.dtype == mx.float16
    cache = metal.model.make_cache()
    logits = metal.model(mx.array([[1, 2, 3]]), cache=cache)
    assert logits.dtype == mx.float16 and cache[0].keys.dtype == mx.float16  # half KV caches
    assert gguf_device_defaults("metal")["keep_quantized"] and gguf_device_defaults("metal")["dtype"] == mx.float16
    assert gguf_device_defaults("native") == {"keep_quantized": False, "dtype": None, "numerics": "native"}


def test_half_products_on_the_cpu_sum_in_float32_and_round_once():
    """Metal's way (float16 in, float32 sums, one rounding) against the float32 product of the
    dequantized weights, and near MLX's own float16 CPU product (which rounds as it sums)."""
    model = make_tiny_model(1, scale=3.0)
    model.update(tree_map(lambda p: p.astype(mx.float16), model.parameters()))
    quantize_dense(model, 64, 4)
    lin = model.layers[0].mlp.down_proj
    x = mx.random.normal((3, lin.weight.shape[1] * 32 // lin.bits)).astype(mx.float16)
    want = mx.quantized_matmul(x, lin.weight, lin.scales, lin.biases, transpose=True, group_size=64, bits=4)
    assert numerics.emulate_half_products(model) > 0
    got = lin(x)
    assert got.dtype == mx.float16
    w32 = mx.dequantize(lin.weight, lin.scales.astype(mx.float32), lin.biases.astype(mx.float32), 64, 4)
    exact = (x.astype(mx.float32) @ w32.T).astype(mx.float16)
    assert mx.allclose(got.astype(mx.float32), exact.astype(mx.float32), rtol=1e-3, atol=1e-3).item()
    assert mx.allclose(got, want, rtol=1e-2, atol=1e-2).item()
    assert not mx.array_equal(got, mx.zeros_like(got)).item()


def _metal_engine(tmp_path, **kw):
    folder = write_tiny_hf_folder(tmp_path / "hf", 0, scale=3.0)
    drafter = write_tiny_hf_folder(tmp_path / "drafter", 5, scale=3.0, num_hidden_layers=1)
    return edgespec.load(folder, drafter=drafter, progress=False, history="off", numerics="metal", **kw)


def test_every_mode_equals_plain_and_sessions_round_trip_in_metal_numerics(tmp_path):
    engine = _metal_engine(tmp_path)
    prompts = [[5, 9, 12, 40, 7, 7, 30, 2], [3, 4, 5, 3, 4, 5, 3, 4]]
    for prompt in prompts:
        plain = engine.generate(prompt, max_tokens=20, mode="plain").tokens
        for mode in MODES:
            assert engine.generate(prompt, max_tokens=20, mode=mode).tokens == plain, mode
        sampled = dict(max_tokens=20, temperature=0.9, top_k=8, seed=7)
        assert engine.generate(prompt, mode="auto", **sampled).tokens == \
            engine.generate(prompt, mode="plain", **sampled).tokens
    # the prefix cache: a request that starts the same way reuses it, and says the same
    prompt = (prompts[0] + [11, 12]) * 5  # prefix cache blocks are 32 positions
    first = engine.generate(prompt, max_tokens=12, mode="plain")
    again = engine.generate(prompt, max_tokens=12, mode="auto")
    assert again.tokens == first.tokens and engine.last_stats.cached_tokens > 0
    # sessions: saved half-precision caches load back into an empty prefix cache
    path = tmp_path / "talk.session"
    assert sessions.save(engine, path, prompt + first.tokens) > 0
    engine.prefix_cache.clear()
    sessions.load(engine, path)
    cont = engine.generate(prompt + first.tokens, max_tokens=12, mode="auto")
    assert engine.last_stats.cached_tokens > 0
    engine.prefix_cache.clear()
    assert engine.generate(prompt + first.tokens, max_tokens=12, mode="plain").tokens == cont.tokens


def test_auto_s_drafter_per_device_as_the_registry_declares(monkeypatch):
    model = make_tiny_model(0)
    tok = make_tiny_tokenizer(model.args.vocab_size)
    from edgespec.engine import Engine

    cpu = Engine(LoadedModel(model, tok, None))
    chosen, passed = registry.auto_drafter_choice(cpu)
    assert chosen == "int8" and set(passed) == {"bundle", "mtp", "shipped"}
    assert "ships no distilled drafter" in passed["shipped"]
    metal = Engine(LoadedModel(model, tok, None, numerics="metal"))
    chosen, passed = registry.auto_drafter_choice(metal)
    assert chosen is None and passed["int8"] == registry.NEVER[("metal", "int8")]
    assert registry.auto_drafter(metal) is None
    with pytest.raises(ModelLoadError, match="CPU device only"):
        QuantizedDrafter.load(metal)
    # a shipped drafter for the model: the CPU still drafts with int8 first, Metal with it
    monkeypatch.setattr(registry, "shipped_drafter_path", lambda engine: "somewhere")
    assert registry.auto_drafter_choice(metal)[0] == "shipped"
    chosen, passed = registry.auto_drafter_choice(cpu)
    assert chosen == "int8" and "int8 comes first" in passed["shipped"]
    # a simulated Mac: the GPU device in its own numerics
    real = mx.default_device
    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(mx.gpu))
    try:
        assert numerics.computes_as("native") == "metal"
        chosen, passed = registry.auto_drafter_choice(cpu)
    finally:
        monkeypatch.setattr(mx, "default_device", real)
    assert chosen == "shipped" and "CPU device only" in passed["int8"]
    monkeypatch.setenv("EDGESPEC_INT8_DRAFTER", "off")
    assert registry.auto_drafter_choice(cpu) == ("shipped", {**passed, "int8": "turned off (EDGESPEC_INT8_DRAFTER=off)"})


def as_metal(model):
    """A tiny model as Metal would run it: float16, 4-bit groups of 64, Metal's products."""
    model.update(tree_map(lambda p: p.astype(mx.float16), model.parameters()))
    quantize_dense(model, 64, 4)
    numerics.emulate_half_products(model)
    return model


class MetalVerifiers(Verifiers):
    """The fuzzer's verifiers in Metal's numerics; its int8 drafter (CPU-only) drafts as `model`."""

    def loaded(self, name):
        fresh = name not in self._models
        loaded = super().loaded(name)
        if fresh and name in ("tiny", "tiny_q", "tiny_dflash", "tiny_json"):
            loaded = self._models[name] = LoadedModel(as_metal(loaded.model), loaded.tokenizer, None,
                                                      numerics="metal")
        return loaded

    def engine(self, case):
        if case.drafter == "int8":
            case.drafter = "model"
        return super().engine(case)


def test_the_exactness_fuzzer_in_metal_numerics(tmp_path):
    rep = run_cases(MetalVerifiers(tmp=tmp_path), range(FUZZ_CASES), ["tiny"])
    print(f"{rep.cases} cases, {len(rep.errors)} errors, {len(rep.near_ties)} near-ties")
    assert rep.cases == FUZZ_CASES
    assert not rep.errors, "\n".join(rep.errors[:3])


# The default model as a Mac runs it: the GGUF's 4-bit blocks, float16, the shipped drafter.
@pytest.fixture(scope="module")
def metal_engine(real_gguf):
    return edgespec.load(real_gguf, progress=False, history="off", numerics="metal")


@pytest.mark.real_model
def test_the_default_model_in_metal_numerics_is_the_mac_s(metal_engine):
    m = metal_engine.model
    assert type(m.layers[0].self_attn.q_proj).__name__ == "HalfQuantizedLinear"
    assert m.model.norm.weight.dtype == mx.float16
    assert registry.auto_drafter_choice(metal_engine)[0] == "shipped"
    assert metal_engine.auto_drafter is None and metal_engine.drafter.name.startswith("distilled:")


@pytest.mark.real_model
def test_every_mode_of_the_default_model_equals_plain_in_metal_numerics(metal_engine):
    tok = metal_engine.tokenizer
    prompts = [tok.encode("The capital of France is"), tok.encode("def fib(n):\n    if n < 2:\n        return n\n")]
    for prompt in prompts:
        plain = metal_engine.generate(prompt, max_tokens=16, mode="plain").tokens
        for mode in REAL_MODES:
            assert metal_engine.generate(prompt, max_tokens=16, mode=mode).tokens == plain, mode
    sampled = dict(max_tokens=12, temperature=0.8, seed=3)
    assert metal_engine.generate(prompts[0], mode="auto", **sampled).tokens == \
        metal_engine.generate(prompts[0], mode="plain", **sampled).tokens


@pytest.mark.real_model
def test_the_default_model_s_half_caches_round_trip_in_metal_numerics(metal_engine, tmp_path):
    """Prefix cache and sessions: the conversation goes on from a saved half-precision cache."""
    prompt = metal_engine.tokenizer.encode("A list of the planets, from the Sun outwards: Mercury, Venus, Earth, "
                                           "Mars, Jupiter, Saturn, Uranus and Neptune. The largest of them, by far, is")
    assert len(prompt) > 32  # more than a prefix cache block
    first = metal_engine.generate(prompt, max_tokens=8, mode="plain").tokens
    path = tmp_path / "talk.session"
    assert sessions.save(metal_engine, path, prompt + first) > 0
    metal_engine.prefix_cache.clear()
    sessions.load(metal_engine, path)
    cont = metal_engine.generate(prompt + first, max_tokens=8, mode="auto")
    assert metal_engine.last_stats.cached_tokens > 0
    metal_engine.prefix_cache.clear()
    assert metal_engine.generate(prompt + first, max_tokens=8, mode="plain").tokens == cont.tokens
