"""Core ML drafter export on a tiny random model: the saved package, executed by the numpy
MIL executor, computes what the MLX drafter computes; spec checks; drafting and rollback."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("coremltools")

from conftest import make_tiny_model  # noqa: E402
from coreml_support import (  # noqa: E402
    ALLOWED_OPS,
    drafting_script,
    executor_drafter,
    executor_logits,
    export_package,
    fp16_weights,
    mlx_drafter,
    reference_logits,
    rel_err,
)

CONTEXT, CHUNK = 48, 8
PROMPT = [5, 9, 17, 3, 22, 41, 8, 8, 30, 2, 11, 60, 7]  # 13 tokens: one chunk + a remainder


@pytest.fixture(scope="module")
def tiny_package(tmp_path_factory):
    model = make_tiny_model(seed=3, scale=2.0)
    path, info = export_package(
        tmp_path_factory.mktemp("coreml"), model, context_length=CONTEXT, prefill_chunk=CHUNK,
        decode_tokens=(1, 2, 4), vocab_hash="tinyhash",
    )  # fmt: skip
    return model, path, info


def test_spec_functions_inputs_outputs_states(tiny_package):
    import coremltools as ct
    from coremltools.converters.mil.mil.types import builtin_to_string
    from edgespec.converters.mil_executor import load_program

    model, path, info = tiny_package
    a = model.args
    spec = ct.models.MLModel(str(path), skip_model_load=True).get_spec()
    assert spec.specificationVersion >= 9  # iOS18 / macOS15: needed for states
    fns = {f.name: f for f in spec.description.functions}
    assert set(fns) == {"prefill", "decode", "decode_2", "decode_4"} == set(info["functions"])
    assert spec.description.defaultFunctionName == "decode"
    FT = ct.proto.FeatureTypes_pb2.ArrayFeatureType
    cache = [a.num_hidden_layers, a.num_key_value_heads, a.head_dim, CONTEXT]
    for name, T, t_out in (
        ("prefill", CHUNK, 1),
        ("decode", 1, 1),
        ("decode_2", 2, 2),
        ("decode_4", 4, 4),
    ):
        f = fns[name]
        ins = {i.name: i.type.multiArrayType for i in f.input}
        assert list(ins) == ["input_ids", "position"]
        assert list(ins["input_ids"].shape) == [1, T] and ins["input_ids"].dataType == FT.INT32
        assert list(ins["position"].shape) == [1] and ins["position"].dataType == FT.INT32
        (out,) = f.output
        assert out.name == "logits" and out.type.multiArrayType.dataType == FT.FLOAT16
        assert list(out.type.multiArrayType.shape) == [1, a.vocab_size, 1, t_out]
        states = {s.name: s.type.stateType.arrayType for s in f.state}
        assert set(states) == {"key_cache", "value_cache"}
        for st in states.values():
            assert list(st.shape) == cache and st.dataType == FT.FLOAT16
    _, prog = load_program(path)
    for name, fn in prog.functions.items():
        used = {op.op_type for op in fn.operations}
        assert used <= ALLOWED_OPS, f"{name}: unexpected ops {used - ALLOWED_OPS}"
        # The fp16 trap: RMSNorm's mean of squares must stay fp32.
        means = [op for op in fn.operations if op.op_type == "reduce_mean"]
        assert len(means) == 2 * model.args.num_hidden_layers + 1
        assert all(builtin_to_string(op.outputs[0].dtype) == "fp32" for op in means)
    meta = json.loads(
        ct.models.MLModel(str(path), skip_model_load=True).user_defined_metadata["edgespec.coreml"]
    )
    assert (
        meta["vocab_hash"] == "tinyhash"
        and meta["context_length"] == CONTEXT
        and meta["prefill_chunk"] == CHUNK
    )


@pytest.mark.parametrize("fp16,tol", [(False, 1e-4), (True, 1e-2)])
def test_prefill_and_decode_match_mlx(tiny_package, fp16, tol):
    from edgespec.converters.mil_executor import MILExecutor

    model, path, _ = tiny_package
    tokens = PROMPT[:CHUNK] + [1, 4, 44, 13, 13, 50, 27, 6, 19, 33]  # prefill + 10 decode steps
    ref_model = fp16_weights(make_tiny_model(seed=3, scale=2.0)) if not fp16 else model
    ref = reference_logits(ref_model, tokens)[CHUNK - 1 :]
    got = executor_logits(MILExecutor(path, fp16=fp16), tokens, CHUNK)
    assert got.shape == ref.shape
    assert rel_err(got, ref) < tol
    assert (got.argmax(-1) == ref.argmax(-1)).all()


@pytest.mark.parametrize("fp16", [False, True])
def test_drafting_and_rollback_match_mlx_drafter(tiny_package, fp16):
    model, path, info = tiny_package
    # Rejections (rollback), full acceptances (two unseen tokens), k=1 rounds.
    rounds = [(4, 1), (4, None), (3, 0), (5, 2), (1, None), (4, None), (2, 0), (6, 3)]
    want = drafting_script(mlx_drafter(model), PROMPT, rounds)
    got = drafting_script(executor_drafter(path, info, fp16), PROMPT, rounds)
    assert got == want
    assert sum(len(t) for t in got) == sum(k for k, _ in rounds)


def test_rollback_then_decode_matches_fresh_run(tiny_package):
    """After drafting past a point and rolling back, the buffer's stale slots must not leak."""
    from edgespec.logits.sampling import Sampler, SamplingParams

    _, path, info = tiny_package
    sampler = Sampler(SamplingParams())
    a = executor_drafter(path, info, fp16=False)
    a.begin(PROMPT)
    d = a.draft(6, sampler)
    a.accept(2, (d.tokens[2] + 7) % 64)  # reject at 2: slots of drafted tokens 3..5 go stale
    after = a.draft(5, sampler)
    committed = PROMPT + d.tokens[:2] + [(d.tokens[2] + 7) % 64]
    b = executor_drafter(path, info, fp16=False)
    b.begin(committed)
    fresh = b.draft(5, sampler)
    assert after.tokens == fresh.tokens
    np.testing.assert_allclose(np.array(after.logprobs), np.array(fresh.logprobs))


def test_feed_plan_uses_chunks_and_k_token_decodes(tiny_package):
    _, path, info = tiny_package
    d = executor_drafter(path, info, fp16=False)
    prompt = list(range(1, 22))  # 21 tokens: 20 prefilled in begin
    d.begin(prompt)
    calls = list(d.backend.calls)
    # 20 = chunk [0, 8) + chunk [8, 16) + remainder 4 -> one decode_4 at 16
    assert calls == [("prefill", 0), ("prefill", 8), ("decode_4", 16)]
    d.backend.calls.clear()
    from edgespec.logits.sampling import Sampler, SamplingParams

    d.draft(3, Sampler(SamplingParams()))
    d.accept(3, 9)  # all accepted: draft token 3 and the bonus are both unseen
    d.backend.calls.clear()
    d.draft(1, Sampler(SamplingParams()))
    assert d.backend.calls == [("decode_2", 23)]


def test_context_end_drafts_fewer_then_none(tiny_package):
    from edgespec.logits.sampling import Sampler, SamplingParams

    _, path, info = tiny_package
    d = executor_drafter(path, info, fp16=False)
    s = Sampler(SamplingParams())
    d.begin([3] * (CONTEXT - 2))
    assert (
        len(d.draft(8, s).tokens) == 3
    )  # slots for the last prompt token and 2 drafts; the 3rd needs none
    d.accept(3, 1)
    assert d.draft(4, s).tokens == []  # 50 committed tokens > 48 slots


def test_export_refuses_unsupported_architecture(tmp_path):
    from edgespec.converters.coreml_export import export_drafter

    from edgespec.errors import ModelLoadError

    class NotLlama:
        args = None

    with pytest.raises(ModelLoadError, match="only edgespec's Llama-family"):
        export_drafter(NotLlama(), tmp_path / "x.mlpackage")
    with pytest.raises(ValueError, match="prefill_chunk"):
        export_drafter(
            make_tiny_model(), tmp_path / "x.mlpackage", context_length=8, prefill_chunk=16
        )
    with pytest.raises(ValueError, match="int8, int4, palette4"):
        export_drafter(make_tiny_model(), tmp_path / "x.mlpackage", compress="int2")
    assert not (tmp_path / "x.mlpackage").exists()


def test_executor_refuses_unknown_ops(tiny_package, monkeypatch):
    from edgespec.converters import mil_ops
    from edgespec.converters.mil_executor import MILExecutor, MILExecutorError

    _, path, _ = tiny_package
    monkeypatch.delitem(mil_ops.OPS, "softmax")
    ex = MILExecutor(path)
    with pytest.raises(MILExecutorError, match="unsupported MIL op 'softmax'"):
        executor_logits(ex, PROMPT, CHUNK)


def test_damaged_packages_give_clear_errors(tiny_package, tmp_path):
    import shutil

    from edgespec.converters.mil_executor import MILExecutor

    from edgespec.errors import ModelLoadError

    _, path, _ = tiny_package
    bad = tmp_path / "bad.mlpackage"
    shutil.copytree(path, bad)
    weights = bad / "Data" / "com.apple.CoreML" / "weights" / "weight.bin"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 3])
    with pytest.raises(ModelLoadError, match="cannot read the Core ML package"):
        MILExecutor(bad)
    shutil.rmtree(bad)
    shutil.copytree(path, bad)
    spec = bad / "Data" / "com.apple.CoreML" / "model.mlmodel"
    spec.write_bytes(b"\x00garbage" + spec.read_bytes()[100:])
    with pytest.raises(ModelLoadError, match="cannot read the Core ML package"):
        MILExecutor(bad)
    with pytest.raises(ModelLoadError, match="not an .mlpackage"):
        MILExecutor(tmp_path)


@pytest.mark.parametrize("compress", ["int8", "int4", "palette4"])
def test_compressed_weights_decode_exactly(tmp_path, compress):
    """The executor's constexpr decoding rebuilds exactly what the exporter packed, and only
    linear layers are compressed (embedding, tied head, norms and RoPE stay plain consts)."""
    from edgespec.converters.coreml_compress import compress_linear
    from edgespec.converters.coreml_export import drafter_shape, prepare_weights
    from edgespec.converters.mil_executor import MILExecutor

    model = make_tiny_model(seed=4, hidden_size=64, intermediate_size=128)
    path, _ = export_package(tmp_path, model, compress, context_length=16, prefill_chunk=4, compress=compress)
    ex = MILExecutor(path)
    ops = {
        op.name: op
        for op in ex.functions["decode"].operations
        if op.op_type.startswith("constexpr")
    }
    assert len(ops) == 7 * model.args.num_hidden_layers
    w = prepare_weights(model, drafter_shape(model, 16))["model.layers.1.mlp.down_proj.weight"]
    packed = compress_linear(w, compress)
    (got,) = ex._eval(ops["l1_down_weight"], {}, {})
    if compress == "palette4":
        lut = packed["lut"][:, 0, 0, 0, :, 0].astype(np.float32)
        lut = np.repeat(lut, w.shape[0] // lut.shape[0], axis=0)
        want = np.take_along_axis(lut, packed["indices"][:, :, 0, 0].astype(np.int64), axis=1)
    else:
        scale = packed["scale"][:, :, 0, 0].astype(np.float32)
        data = packed["data"][:, :, 0, 0].astype(np.float32)
        if "offset" in packed:
            off = packed["offset"][:, :, 0, 0].astype(np.float32)
            data = data - np.repeat(off, w.shape[1] // off.shape[1], axis=1)
        want = data * np.repeat(scale, w.shape[1] // scale.shape[1], axis=1)
    np.testing.assert_array_equal(got[:, :, 0, 0], want)
    assert np.abs(want - w).max() < 0.5 * np.abs(w).max()  # a real approximation, not garbage


def test_forks_of_one_package_draft_independently(tiny_package):
    """Requests of a batch draft with forks of the engine's Core ML drafter (one package, a
    state each): two forks whose rounds interleave draft exactly what each does alone."""
    from edgespec.logits.sampling import Sampler, SamplingParams

    _, path, info = tiny_package
    rounds = [(4, 1), (3, None), (4, 0), (2, None)]
    prompts = [PROMPT, PROMPT[7:] + [3, 9]]
    alone = [drafting_script(executor_drafter(path, info, fp16=False), p, rounds) for p in prompts]
    engine_drafter = executor_drafter(path, info, fp16=False)
    forks = [engine_drafter.fork(), engine_drafter.fork()]
    assert forks[0].backend.state is not forks[1].backend.state
    sampler = Sampler(SamplingParams())
    for f, p in zip(forks, prompts, strict=True):
        f.begin(p)
    got: list[list] = [[], []]
    for k, n in rounds:
        for i, f in enumerate(forks):  # one round of each in turn, as greenlets switch in a batch
            d = f.draft(k, sampler)
            got[i].append(d.tokens)
            m = len(d.tokens) if n is None else min(n, len(d.tokens))
            f.accept(m, (d.tokens[m] + 1) % f.vocab_size if m < len(d.tokens) else 1)
    assert got == alone
