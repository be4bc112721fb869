"""Gemma 4's assistant package under Core ML itself (macOS 15+ only; skipped elsewhere with the
reason): predict with state agrees with the numpy MIL executor, the bundle loads it as its
drafter and speculative decoding with it equals plain, and its 1x1 convs land on the Neural Engine."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.macos
pytest.importorskip("torch")
pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    from edgespec.converters.convert import convert
    from test_arch_moe_gemma4 import (
        SHORT,
        assistant_checkpoint,
        checkpoint,
        hf_greedy,
        teach_assistant,
    )

    tmp = tmp_path_factory.mktemp("cml_assistant_mac")
    verifier = checkpoint(tmp / "hf", "gemma4_text", seed=1)
    plain = hf_greedy(verifier, SHORT, 24)
    teach_assistant(assistant_checkpoint(tmp / "assistant", seed=5, ordered=False), verifier,
                    SHORT[-1:] + plain).save_pretrained(tmp / "assistant")
    manifest = convert(tmp / "hf", tmp / "bundle", quantize="none", dtype="float32", progress=False,
                       drafter=tmp / "assistant", drafter_options={"context_length": 96, "prefill_chunk": 16})
    return tmp / "bundle", manifest["drafter"]["coreml"], plain


def test_predict_with_state_matches_executor(bundle):
    from edgespec.converters.mil_executor import MILExecutor
    from test_coreml_assistant import KINDS

    from edgespec.drafters.coreml_assistant import CoreMLAssistantBackend

    path, info, _ = bundle
    package = path / "drafter.mlpackage"
    backend = CoreMLAssistantBackend(package, info["functions"], "CPU_AND_NE")
    ex = MILExecutor(package, fp16=True)
    state = ex.make_state("draft")
    rng = np.random.default_rng(0)
    appends = {"position": np.array([0], np.int32)}
    for t, (h, d) in KINDS.items():
        for kv in ("keys", "values"):
            appends[f"{t}_{kv}_new"] = rng.standard_normal((h, d, 16)).astype(np.float32)
    backend.call("append_16", appends)
    ex.run("append_16", appends, state)
    for p in (5, 12, 16):
        x = {"embedding": rng.standard_normal((1, 64, 1, 1)).astype(np.float32) * 4,
             "hidden": rng.standard_normal((1, 64, 1, 1)).astype(np.float32), "position": np.array([p], np.int32)}
        got = backend.call("draft", x)
        want = ex.run("draft", x, state)
        for name in ("logits", "next_hidden"):
            g, w = np.asarray(got[name], np.float32), np.asarray(want[name], np.float32)
            assert np.abs(g - w).max() / np.abs(w).max() < 2e-2, name
        assert np.argmax(got["logits"]) == np.argmax(want["logits"])


def test_bundle_drafts_with_the_package_and_equals_plain(bundle):
    from test_arch_moe_gemma4 import SHORT

    import edgespec
    from edgespec.drafters.coreml_assistant import CoreMLAssistantDrafter

    path, _, plain = bundle
    engine = edgespec.load(path, progress=False, history="off")
    assert isinstance(engine.drafter, CoreMLAssistantDrafter)
    spec = engine.generate(SHORT, max_tokens=24, mode="speculative", draft_tokens=3)
    assert spec.tokens == plain and spec.stats.accepted > 0
    assert engine.generate(SHORT, max_tokens=24).tokens == plain  # auto, no options


def test_compute_plan_puts_convs_on_the_neural_engine(bundle):
    import coremltools as ct
    from coremltools.models.compute_plan import MLComputePlan

    path, _, _ = bundle
    compiled = ct.utils.compile_model(str(path / "drafter.mlpackage"))
    plan = MLComputePlan.load_from_path(path=compiled, compute_units=ct.ComputeUnit.CPU_AND_NE)
    fn = plan.model_structure.program.functions["draft"]
    on_ne = total = 0
    for op in fn.block.operations:
        if op.operator_name == "ios18.conv":
            usage = plan.get_compute_device_usage_for_mlprogram_operation(op)
            total += 1
            on_ne += usage is not None and "NeuralEngine" in type(usage.preferred_compute_device).__name__
    assert total > 0 and on_ne / total >= 0.5, f"{on_ne} of {total} convs on the Neural Engine"
