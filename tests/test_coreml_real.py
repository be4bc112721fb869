"""Core ML export of a real drafter-sized model: the first 2 layers of SmolLM2-135M-Instruct
(its residual stream overflows fp16 inside a naive RMSNorm, the trap this checks)."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("coremltools")

from coreml_support import (  # noqa: E402
    drafting_script,
    executor_drafter,
    executor_logits,
    export_package,
    fp16_weights,
    greedy_agreement,
    mlx_drafter,
    package_size,
    reference_logits,
    rel_err,
)

pytestmark = pytest.mark.real_model

N_LAYERS, CONTEXT, CHUNK, STEP = 2, 96, 16, 8
TEXT = (
    "The Neural Engine in Apple silicon runs small transformer models at low power. A drafter proposes "
    "several tokens, and the larger model checks them all in one pass, keeping only those it agrees with. "
    "Speculative decoding keeps the output distribution exactly the same as plain decoding, because every "
    "drafted token is verified by the target model before it is emitted to the user."
)
# Greedy agreement with the uncompressed fp32 slice over the text. A 2-layer slice has tiny
# top-1 margins (its head expects layer 30's residual), so this is harsh: int8 and asymmetric
# int4 meet the 0.95 (both measured 1.0 over 49 positions; the slice comes from a Q4 GGUF,
# whose per-32 grid int4 reproduces); the plain 4-bit palette measured 0.86 and is held to 0.8.
# Calibrated (converters/coreml_calibrate.py, 200 steps) it measured 0.974 on the held-out prompts,
# but that takes 21 min here, too long for this suite (docs/coreml.md, "Compression quality").
MIN_AGREEMENT = {"int8": 0.95, "int4": 0.95, "palette4": 0.8}


def truncated_real(bundle, n_layers: int):
    """The first n layers of the real model (plus its final norm and head) as a new MLX model."""
    from mlx.utils import tree_flatten

    from edgespec.weights.loader import build_model, load

    loaded = load(bundle, verify_hashes=False)
    cfg = {**loaded.model.args.to_dict(), "num_hidden_layers": n_layers}
    keep = {}
    for k, v in tree_flatten(loaded.model.parameters()):
        m = re.match(r"model\.layers\.(\d+)\.", k)
        if m is None or int(m.group(1)) < n_layers:
            keep[k] = v
    return (lambda: build_model(cfg, keep)), loaded.tokenizer


@pytest.fixture(scope="module")
def real_slice(real_bundle):
    make, tok = truncated_real(real_bundle, N_LAYERS)
    return make, tok, tok.encode(TEXT, add_special_tokens=False)


@pytest.fixture(scope="module")
def packages(real_slice, tmp_path_factory):
    make, tok, _ = real_slice
    tmp = tmp_path_factory.mktemp("cmlreal")
    return {
        c: export_package(
            tmp, make(), c, context_length=CONTEXT, prefill_chunk=CHUNK, decode_tokens=(1, 2, STEP),
            compress=c, vocab_hash=tok.vocab_hash(),
        )  # fmt: skip
        for c in ("none", "int8", "int4", "palette4")
    }


@pytest.mark.parametrize("fp16,tol", [(False, 1e-4), (True, 1e-2)])
def test_real_slice_matches_mlx(real_slice, packages, fp16, tol):
    from edgespec.converters.mil_executor import MILExecutor

    make, _, tokens = real_slice
    tokens = tokens[: CHUNK + 10]  # prefill chunk + 10 decode steps
    ref_model = fp16_weights(make()) if not fp16 else make()
    ref = reference_logits(ref_model, tokens)[CHUNK - 1 :]
    got = executor_logits(MILExecutor(packages["none"][0], fp16=fp16), tokens, CHUNK)
    assert rel_err(got, ref) < tol
    assert (got.argmax(-1) == ref.argmax(-1)).all()


def test_real_slice_drafts_like_the_mlx_drafter(real_slice, packages):
    make, _, tokens = real_slice
    path, info = packages["none"]
    rounds = [(4, 1), (4, None), (3, 0), (5, 2)]
    prompt = tokens[:20]
    assert drafting_script(
        executor_drafter(path, info, fp16=True), prompt, rounds
    ) == drafting_script(mlx_drafter(make()), prompt, rounds)


@pytest.mark.parametrize("compress", ["int8", "int4", "palette4"])
def test_compressed_keep_greedy_agreement(real_slice, packages, compress):
    from edgespec.converters.mil_executor import MILExecutor, load_program

    make, _, tokens = real_slice
    path, info = packages[compress]
    assert info["compression"] == compress
    _, prog = load_program(path)
    kinds = {op.op_type for op in prog.functions["decode"].operations}
    assert (
        "constexpr_lut_to_dense" if compress == "palette4" else "constexpr_blockwise_shift_scale"
    ) in kinds
    tokens = tokens[: CHUNK + STEP * ((len(tokens) - CHUNK) // STEP)]
    ref = reference_logits(make(), tokens)[CHUNK - 1 :]
    got = executor_logits(MILExecutor(path, fp16=False), tokens, CHUNK, step=STEP)
    agree = greedy_agreement(got, ref)
    assert agree >= MIN_AGREEMENT[compress], (
        f"{compress}: greedy agreement {agree:.3f} on {len(ref)} positions"
    )
    assert package_size(path) < package_size(packages["none"][0])
