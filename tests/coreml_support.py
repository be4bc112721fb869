"""Helpers shared by the Core ML tests: exporting, references, and drafting runs."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from mlx.utils import tree_map

from edgespec.drafters.base import ModelDrafter
from edgespec.drafters.coreml import CoreMLDrafter
from edgespec.logits.sampling import Sampler, SamplingParams

# Every op an exported drafter program may contain (after coremltools' passes).
ALLOWED_OPS = {
    "const", "reshape", "transpose", "gather", "greater", "greater_equal", "select", "add", "sub", "mul",
    "cast", "reduce_mean", "rsqrt", "conv", "split", "concat", "slice_update", "slice_by_index", "matmul",
    "softmax", "silu", "read_state", "coreml_update_state", "identity",
    "constexpr_blockwise_shift_scale", "constexpr_lut_to_dense",
}  # fmt: skip


def export_package(folder, model, name: str = "drafter", **options):
    """Export `model` to folder/<name>.mlpackage; -> (path, info). Options go to export_drafter."""
    from edgespec.converters.coreml_export import export_drafter

    path = folder / f"{name}.mlpackage"
    return path, export_drafter(model, path, **options)


def package_size(path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def greedy_agreement(got: np.ndarray, ref: np.ndarray) -> float:
    return float((got.argmax(-1) == ref.argmax(-1)).mean())


def fp16_weights(model):
    """The same model with every weight rounded through fp16: what the package stores."""
    model.update(tree_map(lambda p: p.astype(mx.float16).astype(mx.float32), model.parameters()))
    mx.eval(model.parameters())
    return model


def reference_logits(model, tokens: list[int]) -> np.ndarray:
    """(T, V) causal logits of an MLX model over `tokens`."""
    return np.array(model(mx.array([tokens], dtype=mx.int32))[0].astype(mx.float32))


def executor_logits(executor, tokens: list[int], prefill: int, step: int = 1) -> np.ndarray:
    """Prefill the first `prefill` tokens (one chunk), then decode the rest `step` at a time
    (function decode / decode_{step}).

    Returns (1 + len(tokens) - prefill, V) rows: the prefill's last-slot logits, then one per token.
    """
    from edgespec.drafters.coreml import logits_rows

    state = executor.make_state()
    ids = np.array([tokens[:prefill]], np.int32)
    out = executor.run("prefill", {"input_ids": ids, "position": np.array([0], np.int32)}, state)
    rows = [logits_rows(out["logits"])]
    fn = "decode" if step == 1 else f"decode_{step}"
    for i in range(prefill, len(tokens), step):
        ids = np.array([tokens[i : i + step]], np.int32)
        out = executor.run(fn, {"input_ids": ids, "position": np.array([i], np.int32)}, state)
        rows.append(logits_rows(out["logits"]))
    return np.concatenate(rows)


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    """max |a - b| / max |b| (per run)."""
    return float(np.abs(a - b).max() / np.abs(b).max())


def drafting_script(
    drafter, prompt: list[int], rounds: list[tuple[int, int | None]]
) -> list[list[int]]:
    """Run begin + rounds of (k, n_accepted) greedily; the correction token is the drafted one + 1 (a
    rejection) or, when n_accepted == k, a bonus token 1. Returns each round's draft tokens."""
    sampler = Sampler(SamplingParams())
    drafter.begin(prompt)
    out = []
    for k, n in rounds:
        d = drafter.draft(k, sampler)
        out.append(d.tokens)
        n = len(d.tokens) if n is None else min(n, len(d.tokens))
        nxt = (d.tokens[n] + 1) % drafter.vocab_size if n < len(d.tokens) else 1
        drafter.accept(n, nxt)
    return out


def mlx_drafter(model) -> ModelDrafter:
    return ModelDrafter(model)


def executor_drafter(package, info: dict, fp16: bool, vocab_map=None) -> CoreMLDrafter:
    from edgespec.converters.mil_executor import ExecutorBackend, MILExecutor

    backend = ExecutorBackend(MILExecutor(package, fp16=fp16))
    return CoreMLDrafter(backend, info, device="cpu", vocab_map=vocab_map)
