"""Core ML export of a reduced-vocabulary distilled drafter: the package speaks reduced ids and
N logits; the CoreMLDrafter maps ids in and expands q to the full vocabulary (q = 0 outside the
kept set) exactly as DistilledDrafter does. Tiny model here; the shipped one is real_model-marked."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip("coremltools")

from conftest import make_tiny_model, write_tiny_hf_folder  # noqa: E402
from coreml_support import (  # noqa: E402
    drafting_script,
    executor_drafter,
    export_package,
    fp16_weights,
)

from edgespec.drafters.distilled import DistilledDrafter, VocabMap  # noqa: E402
from edgespec.errors import ModelLoadError, VocabularyMismatchError  # noqa: E402

V, N, CONTEXT, CHUNK = 64, 24, 48, 8
KEPT = [7, 3, 60, 12, 5, 9, 41, 22, 17, 30, 2, 11, 8, 44, 13, 50, 27, 6, 19, 33, 1, 4, 63]  # 23 + "other"
PROMPT = [5, 9, 17, 3, 22, 41, 8, 8, 30, 2, 11, 60, 7]  # all inside the kept set but 8 (inside too)
PROMPT_OUT = [5, 9, 40, 3, 22, 41, 35, 8, 30, 2, 11, 60, 7]  # 40 and 35 are outside: "other"
ROUNDS = [(4, 1), (4, None), (3, 0), (5, 2), (1, None), (4, None)]


def make_student(seed=5):
    return make_tiny_model(seed=seed, scale=2.0, vocab_size=N)


@pytest.fixture(scope="module")
def distilled(tmp_path_factory):
    vmap = VocabMap([-1] + KEPT, V)
    path, info = export_package(
        tmp_path_factory.mktemp("cmldist"), make_student(), context_length=CONTEXT, prefill_chunk=CHUNK,
        decode_tokens=(1, 2), vocab_hash="tinyhash", vocab_map=vmap,
    )  # fmt: skip
    return vmap, path, info


def test_package_is_reduced_and_records_its_map(distilled):
    import coremltools as ct

    from edgespec.drafters.coreml import package_vocab_map

    vmap, path, info = distilled
    assert info["vocab_size"] == V and info["reduced_vocab"] == {"size": N, "sha256": vmap.digest()}
    assert "ids" not in info["reduced_vocab"]  # the manifest entry stays small
    model = ct.models.MLModel(str(path), skip_model_load=True)
    meta = json.loads(model.user_defined_metadata["edgespec.coreml"])
    assert meta["reduced_vocab"]["ids"] == [-1] + KEPT
    for f in model.get_spec().description.functions:
        assert list(f.output[0].type.multiArrayType.shape)[:2] == [1, N]
    # A bare package (no bundle beside it) carries its own map.
    assert package_vocab_map(path, info).ids.tolist() == [-1] + KEPT


@pytest.mark.parametrize("fp16", [False, True])
@pytest.mark.parametrize("prompt", [PROMPT, PROMPT_OUT])
def test_drafts_like_distilled_drafter(distilled, fp16, prompt):
    vmap, path, info = distilled
    ref = DistilledDrafter(make_student() if fp16 else fp16_weights(make_student()), vmap)
    want = drafting_script(ref, prompt, ROUNDS)
    got = drafting_script(executor_drafter(path, info, fp16, vmap), prompt, ROUNDS)
    assert got == want
    assert all(t in KEPT for r in got for t in r)


def test_q_matches_and_is_zero_outside_the_kept_set(distilled):
    from edgespec.logits.sampling import Sampler, SamplingParams

    vmap, path, info = distilled
    a = executor_drafter(path, info, False, vmap)
    b = DistilledDrafter(fp16_weights(make_student()), vmap)
    b.cache = b.model.make_cache()
    la = a._feed(PROMPT_OUT)  # (V,) after the whole prompt, expanded to the full vocabulary
    lb = np.array(b._forward(mx.array([PROMPT_OUT], dtype=mx.int32))[-1])
    outside = np.setdiff1d(np.arange(V), KEPT)
    assert la.shape == (V,) and np.all(np.isneginf(la[outside])) and np.all(np.isneginf(lb[outside]))
    np.testing.assert_allclose(la[KEPT], lb[KEPT], rtol=1e-4, atol=1e-4)
    s = Sampler(SamplingParams(temperature=0.8, top_p=0.9))
    qa, qb = np.array(s.logprobs(mx.array(la))), np.array(s.logprobs(mx.array(lb)))
    assert np.all(np.isneginf(qa[outside])) and np.exp(qa).sum() == pytest.approx(1.0, abs=1e-5)
    np.testing.assert_allclose(np.exp(qa), np.exp(qb), atol=1e-5)


def test_wrong_or_missing_map_is_refused(distilled):
    from edgespec.converters.mil_executor import ExecutorBackend, MILExecutor

    from edgespec.drafters.coreml import CoreMLDrafter

    vmap, path, info = distilled
    backend = ExecutorBackend(MILExecutor(path))
    with pytest.raises(ModelLoadError, match="needs its vocab map"):
        CoreMLDrafter(backend, info)
    other = VocabMap([-1] + KEPT[::-1], V)
    with pytest.raises(ModelLoadError, match="does not match the one the package was exported with"):
        CoreMLDrafter(backend, info, vocab_map=other)


def _distilled_folder(folder, vocab_hash):
    from edgespec.converters.bundle import write_model_files
    from mlx.utils import tree_flatten

    student = make_student()
    write_model_files(folder, student.args.to_dict(), dict(tree_flatten(student.parameters())), None)
    VocabMap([-1] + KEPT, V).save(folder, vocab_hash=vocab_hash)
    return folder


def test_convert_bundles_the_distilled_drafter(tmp_path):
    from conftest import make_tiny_tokenizer
    from edgespec.converters.convert import convert

    import edgespec
    from edgespec.drafters.coreml import package_vocab_map, read_package_info

    verifier = write_tiny_hf_folder(tmp_path / "v", seed=0)
    src = _distilled_folder(tmp_path / "dist", make_tiny_tokenizer(V).vocab_hash())
    out = tmp_path / "bundle"
    manifest = convert(verifier, out, quantize="none", dtype="float32", progress=False, drafter=src,
                       drafter_options={"context_length": 32, "prefill_chunk": 8})  # fmt: skip
    d = manifest["drafter"]
    assert d["reduced_vocab"]["map"] == "drafter/vocab_map.json" and d["reduced_vocab"]["size"] == N
    assert d["coreml"]["reduced_vocab"]["sha256"] == d["reduced_vocab"]["sha256"]
    assert "drafter/vocab_map.json" in manifest["files"]
    pkg = out / "drafter.mlpackage"
    info = read_package_info(pkg)
    assert info["vocab_size"] == V and package_vocab_map(pkg, info).ids.tolist() == [-1] + KEPT
    engine = edgespec.load(out, progress=False)  # off macOS: the MLX copy, still reduced-vocab
    assert isinstance(engine.drafter, DistilledDrafter) and engine.drafter.vocab_size == V
    # A map naming another tokenizer is refused before anything is written.
    bad = _distilled_folder(tmp_path / "bad", "0123456789abcdef")
    with pytest.raises(VocabularyMismatchError, match="differs from the verifier"):
        convert(verifier, tmp_path / "b2", quantize="none", dtype="float32", progress=False, drafter=bad)
    assert not (tmp_path / "b2").exists()


@pytest.mark.real_model
def test_shipped_distilled_drafter_exports_exactly(real_bundle, tmp_path):
    """The shipped reduced-vocab drafter: executor (fp32 and fp16 emulation) vs its MLX logits,
    greedy tokens, and a short drafting script through the CoreMLDrafter. Values are not assumed:
    the weights may be retrained; only the shape (a Llama with a vocab map) is."""
    from coreml_support import executor_logits, reference_logits, rel_err
    from edgespec.converters.mil_executor import MILExecutor

    from edgespec.drafters import DATA
    from edgespec.weights.loader import load, load_model_folder

    folder = DATA / "smollm2-135m-instruct"
    tok = load(real_bundle, verify_hashes=False).tokenizer
    vmap = VocabMap.load(folder)
    make = lambda: load_model_folder(folder, dtype=mx.float32)  # noqa: E731
    chunk = 16
    path, info = export_package(tmp_path, make(), context_length=64, prefill_chunk=chunk,
                                decode_tokens=(1, 2), vocab_hash=tok.vocab_hash(), vocab_map=vmap)  # fmt: skip
    text = "Speculative decoding drafts several tokens and the verifier checks them in one pass."
    full = tok.encode(text, add_special_tokens=False)[: chunk + 8]
    reduced = vmap.to_reduced[np.array(full)].tolist()
    ref = reference_logits(make(), reduced)[chunk - 1 :]  # shipped weights are fp16 already
    top2 = np.sort(ref, -1)[:, -2:]
    for fp16, tol in ((False, 1e-4), (True, 1e-2)):
        got = executor_logits(MILExecutor(path, fp16=fp16), reduced, chunk)
        assert rel_err(got, ref) < tol
        # Same greedy token wherever the reference's top-1 margin exceeds twice the error
        # (this drafter has near-ties, ~1e-3, that fp16 rounding may legitimately flip).
        clear = top2[:, 1] - top2[:, 0] > 2 * np.abs(got - ref).max()
        assert (got.argmax(-1) == ref.argmax(-1))[clear].all() and clear.mean() > 0.5
    want = drafting_script(DistilledDrafter(make(), vmap), full[:20], [(3, 1), (3, None)])
    assert drafting_script(executor_drafter(path, info, False, vmap), full[:20], [(3, 1), (3, None)]) == want
