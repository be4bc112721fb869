"""Core ML runtime checks that only a Mac (macOS 15+) can run: predict with state, the compute
plan (which ops land on the Neural Engine), and decode latency. Skipped elsewhere with the reason."""

from __future__ import annotations

import time

import numpy as np
import pytest

pytestmark = pytest.mark.macos

CONTEXT, CHUNK = 64, 8
PROMPT = [5, 9, 17, 3, 22, 41, 8, 8, 30, 2, 11, 60, 7]


@pytest.fixture(scope="module")
def package(tmp_path_factory):
    from conftest import make_tiny_model
    from edgespec.converters.coreml_export import export_drafter

    model = make_tiny_model(seed=3, scale=2.0)
    path = tmp_path_factory.mktemp("cmlmac") / "drafter.mlpackage"
    info = export_drafter(
        model, path, context_length=CONTEXT, prefill_chunk=CHUNK, decode_tokens=(1, 2)
    )
    return model, path, info


def test_predict_with_state_matches_executor(package):
    """Core ML's own run of prefill + 8 decode steps agrees with the numpy executor (fp16)."""
    from coreml_support import executor_logits
    from edgespec.converters.mil_executor import MILExecutor

    from edgespec.drafters.coreml import CoreMLBackend

    _, path, info = package
    tokens = PROMPT[:CHUNK] + [1, 4, 44, 13, 13, 50, 27, 6]
    backend = CoreMLBackend(path, info["functions"], "CPU_AND_NE")
    rows = [backend.call("prefill", np.array([tokens[:CHUNK]], np.int32), 0)[-1]]
    for i in range(CHUNK, len(tokens)):
        rows.append(backend.call("decode", np.array([[tokens[i]]], np.int32), i)[-1])
    got = np.stack(rows)
    ref = executor_logits(MILExecutor(path, fp16=True), tokens, CHUNK)
    assert np.abs(got - ref).max() / np.abs(ref).max() < 2e-2
    assert (got.argmax(-1) == ref.argmax(-1)).all()


def test_coreml_drafter_drafts_like_mlx_drafter(package):
    from coreml_support import drafting_script, mlx_drafter

    from edgespec.drafters.coreml import CoreMLBackend, CoreMLDrafter

    model, path, info = package
    rounds = [(4, 1), (4, None), (3, 0), (5, 2)]
    drafter = CoreMLDrafter(CoreMLBackend(path, info["functions"], "CPU_AND_NE"), info)
    assert drafting_script(drafter, PROMPT, rounds) == drafting_script(
        mlx_drafter(model), PROMPT, rounds
    )


def test_compute_plan_puts_matmuls_on_the_neural_engine(package):
    import coremltools as ct
    from coremltools.models.compute_plan import MLComputePlan

    _, path, _ = package
    compiled = ct.utils.compile_model(str(path))
    plan = MLComputePlan.load_from_path(path=compiled, compute_units=ct.ComputeUnit.CPU_AND_NE)
    fn = plan.model_structure.program.functions["decode"]
    on_ne = total = 0
    for op in fn.block.operations:
        if op.operator_name in ("ios18.conv", "ios18.matmul"):
            usage = plan.get_compute_device_usage_for_mlprogram_operation(op)
            total += 1
            on_ne += (
                usage is not None
                and "NeuralEngine" in type(usage.preferred_compute_device).__name__
            )
    assert total > 0 and on_ne / total >= 0.5, (
        f"{on_ne} of {total} conv/matmul ops on the Neural Engine"
    )


def test_decode_latency_is_measured(package, record_property):
    from edgespec.drafters.coreml import CoreMLBackend

    _, path, info = package
    backend = CoreMLBackend(path, info["functions"], "CPU_AND_NE")
    backend.call("prefill", np.array([PROMPT[:CHUNK]], np.int32), 0)
    times = []
    for i in range(CHUNK, CHUNK + 20):
        t = time.perf_counter()
        logits = backend.call("decode", np.array([[PROMPT[i % len(PROMPT)]]], np.int32), i)
        times.append(time.perf_counter() - t)
    record_property("decode_ms_median", 1000 * float(np.median(times)))
    assert np.isfinite(logits).all()
