"""An EAGLE-3 head's Core ML package (converters/eagle3_coreml.py, drafters/eagle3_coreml.py).

Nothing here runs Core ML: the package `edgespec convert MODEL OUT --drafter HEAD` writes is read
back and run by the numpy MIL executor (converters/mil_executor.py), through the backend a Mac's
Core ML stands behind (the assistant package's `call(function, inputs)`). Checked: the package's
logits against the MLX head's over committed feeds, drafted steps and a rollback (fp32 and fp16
executors), greedy `speculative` and `auto` with the package as drafter equal to plain, the
package's info against the head beside it, and a chain cut to the package's context. The last
test loads the package with Core ML itself (macOS only, skipped here).
"""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from conftest import write_tiny_hf_folder
from test_eagle3 import PROMPT, VERIFIER, load, recorded_states, two_way_head, write_random

from edgespec.errors import ModelLoadError

CONTEXT = 40


HEADS = {"llama": ("llama", 1, {}), "qwen3-norms": ("qwen3", 2, {"norm_before_fc": True, "norm_output": True})}
_BUILT: dict = {}


def make_bundle(name: str, tmp_path_factory):
    """`edgespec convert MODEL OUT --drafter HEAD`: drafter/ and drafter.mlpackage (once per module)."""
    if name in _BUILT:
        return _BUILT[name]
    pytest.importorskip("coremltools")
    from edgespec.converters.convert import convert

    kind, layers, flags = HEADS[name]
    tmp = tmp_path_factory.mktemp(f"eagle3_pkg_{kind}")
    verifier = two_way_head(write_tiny_hf_folder(tmp / "v", seed=3, **VERIFIER))
    head = write_random(tmp / "head", kind=kind, layers=layers, targets=(5, 9, 1, 2, 17, 30), scale=0.5)
    cfg = json.loads((head / "config.json").read_text())
    cfg.update(flags)
    (head / "config.json").write_text(json.dumps(cfg))
    if flags.get("norm_before_fc"):  # the norm over the concatenated aux states: weights of its own
        w = dict(mx.load(str(head / "model.safetensors")))
        w["input_norm.weight"] = mx.array(1.0 + 0.2 * np.random.RandomState(1).randn(3 * 64).astype(np.float32))
        mx.save_safetensors(str(head / "model.safetensors"), w)
    two_way_head(head, a=0, b=1)  # draft ids 0, 1 are the verifier's 5 and 9
    convert(verifier, tmp / "bundle", quantize="none", dtype="float32", progress=False, drafter=head,
            drafter_options={"context_length": CONTEXT, "prefill_chunk": 8})
    _BUILT[name] = tmp / "bundle"
    return _BUILT[name]


@pytest.fixture(scope="module", params=list(HEADS))
def any_bundle(request, tmp_path_factory):
    """A Llama head of one layer; a Qwen3 head of two with the norms before fc and on its output."""
    return make_bundle(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    return make_bundle("llama", tmp_path_factory)


def executor_backend(package, fp16: bool):
    from edgespec.converters.coreml_assistant import AssistantExecutorBackend
    from edgespec.converters.mil_executor import MILExecutor

    return AssistantExecutorBackend(MILExecutor(package, fp16=fp16))


def package_drafter(bundle, engine, fp16: bool = False):
    """The bundle's package as the engine's drafter, the MIL executor standing in for Core ML."""
    from edgespec.drafters.eagle3_coreml import from_package

    info = json.loads((bundle / "manifest.json").read_text())["drafter"]["coreml"]
    package = bundle / "drafter.mlpackage"
    backend = executor_backend(package, fp16)
    return from_package(package, engine, info, "CPU_AND_NE", backend=backend), backend


def test_the_package_gives_the_mlx_heads_logits_in_the_mil_executor(any_bundle):
    from coreml_support import ALLOWED_OPS, fp16_weights

    from edgespec.drafters.eagle3 import Eagle3Drafter

    manifest = json.loads((any_bundle / "manifest.json").read_text())
    entry, info = manifest["drafter"], manifest["drafter"]["coreml"]
    assert entry["kind"] == "eagle3" and entry["coreml_note"] is None
    assert info["kind"] == "eagle3" and info["functions"] == ["draft", "feed_1", "feed_2", "feed_4", "feed_8"]
    assert info["draft_vocab_size"] == 6 and info["context_length"] == CONTEXT
    files = manifest["files"]  # every file's size and sha256, the package's included
    assert "drafter.mlpackage/Manifest.json" in files and "drafter/model.safetensors" in files
    assert all(len(files[k]["sha256"]) == 64 for k in files if k.startswith("drafter.mlpackage/"))
    engine = load(any_bundle)
    assert type(engine.drafter) is Eagle3Drafter  # no Core ML here: the MLX head from drafter/
    ids = PROMPT[:20]
    mlx_d, feats = recorded_states(engine, ids)
    feats = feats[None]

    def run(d, chain=None):
        """Three committed feeds (11, 3, 5 entries), each followed by a chain of three drafted steps
        (the MLX head's greedy draft ids, or `chain`'s), then a rollback and the last feed again:
        every logits row, and the draft ids fed."""
        out, fed = [], []
        d.begin(ids)
        for a, b in ((0, 11), (11, 14), (14, 19)):
            d._trim_to(a)
            logits, g = d.feed(ids[a + 1 : b + 1], feats[:, a:b], fused=False)
            out.append(np.array(logits.astype(mx.float32)))
            for _ in range(3):
                t = int(np.argmax(out[-1])) if chain is None else chain[len(fed)]
                fed.append(t)
                logits, g = d.feed([int(d._targets[t].item())], g, fused=True)
                out.append(np.array(logits.astype(mx.float32)))
        d._trim_to(14)
        logits, _ = d.feed(ids[15:20], feats[:, 14:19], fused=False)
        out.append(np.array(logits.astype(mx.float32)))
        return np.stack(out), fed

    want, chain = run(mlx_d)
    fp16_weights(mlx_d.model)  # the weights the package stores (its inputs are fp16 too)
    want16, _ = run(mlx_d, chain)
    for fp16, tol in ((False, 2e-3), (True, 3e-2)):
        pkg, backend = package_drafter(any_bundle, engine, fp16)
        ops = {op.op_type for f in backend.executor.functions.values() for op in f.operations}
        assert ops <= ALLOWED_OPS, ops - ALLOWED_OPS
        got, _ = run(pkg, chain)
        diff, diff16 = float(np.abs(got - want).max()), float(np.abs(got - want16).max())
        print(f"{'fp16' if fp16 else 'fp32'} executor: max abs diff {diff:.2e} from the MLX head, {diff16:.2e} from it "
              f"with fp16-rounded weights (logits up to {np.abs(want).max():.1f})")
        assert diff16 < (1e-3 if not fp16 else tol) * max(1.0, float(np.abs(want).max()))
        assert diff < tol * max(1.0, float(np.abs(want).max()))
        assert (got.argmax(-1) == want.argmax(-1)).all()
        # feeds in pieces of the package's sizes; the rollback wrote slot 14 again
        fns = [c[0] for c in backend.calls]
        assert fns[:4] == ["feed_8", "feed_2", "feed_1", "draft"] and ("feed_4", 14) in backend.calls


def test_speculative_and_auto_with_the_package_equal_plain(bundle, monkeypatch):
    engine = load(bundle)
    prompts = [PROMPT[:9], PROMPT[3:20]]
    refs = [engine.generate(p, max_tokens=24, mode="plain").tokens for p in prompts]
    mlx_runs = [engine.generate(p, max_tokens=24, mode="speculative", draft_tokens=5) for p in prompts]
    engine.drafter, backend = package_drafter(bundle, engine)
    drafted = accepted = 0
    for p, ref, mlx_run in zip(prompts, refs, mlx_runs, strict=True):
        spec = engine.generate(p, max_tokens=24, mode="speculative", draft_tokens=5)
        assert spec.tokens == ref
        assert spec.stats.accepted_by_position == mlx_run.stats.accepted_by_position  # the MLX head's proposals
        drafted, accepted = drafted + spec.stats.drafted, accepted + spec.stats.accepted
        assert engine.generate(p, max_tokens=24).tokens == ref  # auto
    assert drafted > accepted > 0, (drafted, accepted)
    assert {c[0] for c in backend.calls} >= {"draft", "feed_1"}


def test_four_requests_at_once_draft_with_package_states_of_their_own(bundle):
    from conftest import run_at_once

    engine = load(bundle)
    prompts = [PROMPT[i : i + 8] for i in range(4)]
    refs = [engine.generate(p, max_tokens=16, mode="plain").tokens for p in prompts]
    engine.drafter, backend = package_drafter(bundle, engine)
    got = run_at_once(lambda i: engine.generate(prompts[i], max_tokens=16, mode="speculative", draft_tokens=4))
    assert [g.tokens for g in got] == refs
    assert sum(g.stats.accepted for g in got) > 0 and backend.calls  # forks drafted through the package


def test_a_chain_is_cut_to_the_packages_context(bundle):
    """Past the package's slots the chain is shortened, then nothing is drafted; output still plain's."""
    from edgespec.logits.sampling import Sampler, SamplingParams

    engine = load(bundle)
    d, _ = package_drafter(bundle, engine)
    ids = (PROMPT * 3)[: CONTEXT - 1]
    cache = engine.model.make_cache()
    d.bind_verifier_cache(cache)
    engine.model(mx.array([ids]), cache)
    greedy = Sampler(SamplingParams(temperature=0.0))
    d.begin(ids)
    assert len(d.draft(5, greedy).tokens) == 3  # 38 committed entries + 2 drafted steps fill 40 slots
    d.sync(ids + [3])
    engine.model(mx.array([[3]]), cache)
    assert len(d.draft(5, greedy).tokens) == 2
    d.sync(ids + [3, 4, 5])
    engine.model(mx.array([[4, 5]]), cache)
    assert d.draft(5, greedy).tokens == []
    engine.drafter = d
    long = (PROMPT * 3)[: CONTEXT - 4]
    assert engine.generate(long, max_tokens=12, mode="speculative", draft_tokens=5).tokens == \
        engine.generate(long, max_tokens=12, mode="plain").tokens


def test_a_package_from_another_head_and_unexportable_heads_are_refused_by_name(bundle, tmp_path):
    from edgespec.converters.convert import convert

    from edgespec.drafters.eagle3_coreml import from_package

    engine = load(bundle)
    info = dict(json.loads((bundle / "manifest.json").read_text())["drafter"]["coreml"])
    info["draft_vocab_size"] = 7
    with pytest.raises(ModelLoadError, match="draft_vocab_size is 7"):
        from_package(bundle / "drafter.mlpackage", engine, info, "CPU_AND_NE", backend=object())
    verifier = write_tiny_hf_folder(tmp_path / "v", seed=3, **VERIFIER)
    head = write_random(tmp_path / "head", attention_bias=True)
    with pytest.raises(ValueError, match="--drafter-compress: .*biases"):
        convert(verifier, tmp_path / "b1", quantize="none", dtype="float32", progress=False, drafter=head,
                drafter_options={"context_length": CONTEXT, "compress": "int8"})
    manifest = convert(verifier, tmp_path / "b2", quantize="none", dtype="float32", progress=False, drafter=head,
                       drafter_options={"context_length": CONTEXT})
    assert manifest["drafter"]["coreml"] is None and "biases" in manifest["drafter"]["coreml_note"]
    assert not (tmp_path / "b2" / "drafter.mlpackage").exists()


@pytest.mark.macos
def test_core_ml_loads_the_package_and_drafts_as_the_executor(bundle):
    """On a Mac (macOS 15+): the bundle's drafter is the package under Core ML, its logits the
    executor's, and greedy speculative output plain's."""
    pytest.importorskip("coremltools")
    from edgespec.drafters.coreml_runtime import require_coreml
    from edgespec.drafters.eagle3_coreml import Eagle3PackageDrafter

    require_coreml()
    engine = load(bundle)
    assert isinstance(engine.drafter, Eagle3PackageDrafter)
    ids = PROMPT[:12]
    ref = engine.generate(ids, max_tokens=20, mode="plain").tokens
    assert engine.generate(ids, max_tokens=20, mode="speculative", draft_tokens=4).tokens == ref
    d, feats = recorded_states(engine, ids)
    ex, _ = package_drafter(bundle, engine, fp16=True)
    ex.bind_verifier_cache(d.vcache)
    got = []
    for drafter in (d, ex):
        drafter.begin(ids)
        got.append(np.array(drafter.feed(ids[1:], feats[None, :-1], fused=False)[0].astype(mx.float32)))
    assert np.abs(got[0] - got[1]).max() < 5e-2


def test_compressed_packages_keep_the_heads_greedy_choices(bundle, tmp_path):
    """--drafter-compress packs fc and the layers' projections (lm_head and norms stay fp16): the
    executor decodes them and the package's logits stay near the MLX head's."""
    from coreml_support import ALLOWED_OPS
    from edgespec.converters.eagle3_coreml import export_eagle3

    from edgespec.drafters.eagle3_coreml import Eagle3PackageDrafter, PackageHead

    engine = load(bundle)
    ids = PROMPT[:5]
    mlx_d, feats = recorded_states(engine, ids)
    mlx_d.begin(ids)
    want = np.array(mlx_d.feed(ids[1:5], feats[None, :4], fused=False)[0])
    for method, tol in (("int8", 0.05),):  # int4 and palette4 take the same path (coreml_compress)
        path = tmp_path / f"{method}.mlpackage"
        info = export_eagle3(mlx_d.model, path, context_length=4, prefill_chunk=4, compress=method)
        assert info["compression"] == method and info["functions"] == ["draft", "feed_1", "feed_2", "feed_4"]
        backend = executor_backend(path, fp16=True)
        ops = {op.op_type for f in backend.executor.functions.values() for op in f.operations}
        assert ops <= ALLOWED_OPS and ops & {"constexpr_blockwise_shift_scale", "constexpr_lut_to_dense"}, ops
        d = Eagle3PackageDrafter(mlx_d.model, mlx_d.verifier, PackageHead(backend, info))
        d.begin(ids)
        got = np.array(d.feed(ids[1:5], feats[None, :4], fused=False)[0])
        print(f"{method}: max abs diff {np.abs(got - want).max():.2e} (logits up to {np.abs(want).max():.1f})")
        assert np.abs(got - want).max() < tol * np.abs(want).max() and got.argmax() == want.argmax()
    with pytest.raises(ValueError, match="--drafter-compress must be one of"):
        export_eagle3(mlx_d.model, tmp_path / "x.mlpackage", context_length=4, prefill_chunk=4, compress="int2")
