"""DFlash block drafters (models/dflash.py, edgespec/drafters/dflash.py, converters/dflash_export.py).

The reference is the `dflash` package (dev extra): its PyTorch DFlashDraftModel / DFlash2DraftModel
built on random weights, saved in the published layout (config.json with dflash_config,
safetensors; DFlash2's codebooks without `.weight`, as published), loaded by edgespec from the
folder and from a bundle (`convert --drafter`), and compared block logit for block logit and block
for block. Drafting is checked exact: greedy `speculative` and `auto` equal plain on a dense and a
hybrid (Qwen3.5) verifier, with drafts rejected mid-block, alone and four at once; and the law of
sampled continuations is the verifier's (chi-square).
"""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from conftest import count_drafts, run_at_once, write_tiny_hf_folder
from stats_support import chisq_pvalue, continuation_counts, continuation_law

import edgespec
from edgespec.errors import ModelLoadError

V = 40  # a small vocabulary: random drafters still guess right now and then (mid-block rejections)
PROMPT = [int(t) for t in np.random.RandomState(5).randint(1, V, size=24)]
VERIFIER = dict(vocab_size=V, num_hidden_layers=4, tie_word_embeddings=False)


def two_way_head(folder, a: int = 5, b: int = 9, dim: int = 0, size: float = 8.0):
    """Make a verifier folder's output head favour token a or b by the sign of one hidden dimension:
    its greedy text is then mostly a and b, and a random drafter (through the same head) guesses
    each slot about half the time, so blocks are kept in part and rejected mid-block."""
    path = folder / "model.safetensors"
    w = dict(mx.load(str(path)))
    W = np.array(w["lm_head.weight"])
    W[a, dim] += size
    W[b, dim] -= size
    w["lm_head.weight"] = mx.array(W)
    mx.save_safetensors(str(path), w)
    return folder


def dflash_config(E: int, kind: str, target_ids, block: int, mask: int = V - 1, layers: int = 2, vocab: int = V,
                  **extra) -> dict:
    dcfg = dict(block_size=block, target_layer_ids=list(target_ids), mask_token_id=mask)
    if kind == "dflash2":
        dcfg.update(conv_kernel_size=3, conv_group_size=16, selector_rank=8, selector_top_k=6)
    cfg = dict(hidden_size=E, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
               intermediate_size=96, vocab_size=vocab, rms_norm_eps=1e-6, rope_theta=10000.0,
               max_position_embeddings=512, num_target_layers=4, attention_bias=False, tie_word_embeddings=False,
               hidden_act="silu", model_type="qwen3", dflash_config=dcfg,
               architectures=["DFlash2DraftModel" if kind == "dflash2" else "DFlashDraftModel"])
    cfg.update(extra)
    return cfg


def write_reference(folder, kind: str, target_ids, block: int, seed: int = 0, scale: float = 0.3, **extra):
    """The `dflash` package's model on random weights, saved as a published folder; returns it."""
    torch = pytest.importorskip("torch")
    ref = pytest.importorskip("dflash.model")
    from safetensors.torch import save_file
    from transformers.models.qwen3.modeling_qwen3 import Qwen3Config

    torch.manual_seed(seed)
    cfg = dflash_config(64, kind, target_ids, block, **extra)
    cls = ref.DFlash2DraftModel if kind == "dflash2" else ref.DFlashDraftModel
    model = cls(Qwen3Config(**cfg)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * scale + (1.0 if "norm" in name else 0.0))
    tensors = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    for name in ("predecessor_codebook", "successor_codebook"):  # the published names
        if f"candidate_selector.{name}.weight" in tensors:
            tensors[f"candidate_selector.{name}"] = tensors.pop(f"candidate_selector.{name}.weight")
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(cfg))
    return model


def write_random(folder, kind: str = "dflash", target_ids=(1, 2), block: int = 8, seed: int = 0, E: int = 64,
                 **extra):
    """A random DFlash folder written from MLX alone (no torch needed)."""
    from edgespec.models.dflash import Model, ModelArgs
    from mlx.utils import tree_flatten

    cfg = dflash_config(E, kind, target_ids, block, **extra)
    mx.random.seed(seed)
    model = Model(ModelArgs.from_dict(cfg))
    folder.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


@pytest.fixture(scope="module")
def verifier_folder(tmp_path_factory):
    return two_way_head(write_tiny_hf_folder(tmp_path_factory.mktemp("dflash_verifier") / "hf", seed=3, **VERIFIER))


def load(path, **kw):
    return edgespec.load(path, progress=False, history="off", **kw)


def recorded_states(engine, ids: list[int]):
    """Prefill `ids` with the drafter attached: (the drafter, its verifier cache, the recorded rows (T, n*E))."""
    d = engine.drafter.fork()
    cache = engine.model.make_cache()
    d.bind_verifier_cache(cache)
    engine.model(mx.array([ids]), cache)
    return d, cache, cache[d.tap].hidden[0, : len(ids)]


def reference_logits(ref, engine, feats: np.ndarray, last: int) -> np.ndarray:
    """The reference's block logits (block_size - 1, V) after context `feats` (S, n*E)."""
    import torch

    m = engine.model
    W = np.array(m.model.embed_tokens.weight if m.args.tie_word_embeddings else m.lm_head.weight)
    head = torch.nn.Linear(W.shape[1], W.shape[0], bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.tensor(W))
        block = [last] + [ref.mask_token_id] * (ref.block_size - 1)
        emb = torch.tensor(np.array(m.model.embed_tokens.weight))[torch.tensor([block])]
        S = feats.shape[0]
        out = ref(target_hidden=torch.tensor(feats)[None], noise_embedding=emb,
                  position_ids=torch.arange(S + ref.block_size)[None])
        return ref.compute_logits(out[:, 1:], head)[0].numpy(), out[:, 1:], head


# ---------------------------------------------------------------- the published math


@pytest.mark.parametrize("kind,target_ids,block", [("dflash", (1,), 4), ("dflash", (0, 2), 8),
                                                   ("dflash2", (1, 2, 3), 16), ("dflash2", (0, 3), 8)])
def test_block_logits_match_the_reference_from_folder_and_bundle(verifier_folder, tmp_path, kind, target_ids, block):
    from edgespec.converters.convert import convert

    from edgespec.drafters.dflash import DFlashDrafter

    ref = write_reference(tmp_path / "dflash", kind, target_ids, block)
    convert(verifier_folder, tmp_path / "bundle", quantize="none", dtype="float32", progress=False,
            drafter=tmp_path / "dflash", drafter_options={"coreml": False})
    ids = PROMPT[:13]
    for src, kw in ((verifier_folder, {"drafter": tmp_path / "dflash"}), (tmp_path / "bundle", {})):
        engine = load(src, **kw)
        assert isinstance(engine.drafter, DFlashDrafter), src
        d, cache, feats = recorded_states(engine, ids)
        # the recorded rows are the target layers' outputs (HF hidden_states[l + 1]), concatenated
        h, outs = engine.model.embed(mx.array([ids])), []
        for layer in engine.model.layers:
            h = layer(h, "causal", None, None)
            outs.append(h)
        want = mx.concatenate([outs[i] for i in target_ids], axis=-1)[0]
        np.testing.assert_allclose(np.array(feats), np.array(want), atol=1e-5)
        feats = np.array(feats[:-1])  # positions 0..n-2; the last prompt token opens the block
        want, ref_out, head = reference_logits(ref, engine, feats, ids[-1])
        d.begin(ids)
        d._trim_to(0)
        got = d.logits(d.block(ids[-1], mx.array(feats)[None]))
        np.testing.assert_allclose(np.array(got), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
        # a whole drafting round: the block proposed after the prompt is the reference's
        from edgespec.logits.sampling import Sampler, SamplingParams

        d.begin(ids)
        draft = d.draft(block - 1, Sampler(SamplingParams(temperature=0.0)))
        if kind == "dflash2":
            import torch

            with torch.no_grad():
                path, _, _ = ref.propose(ref_out, torch.tensor([ids[-1]]), head, 0.0)
            assert draft.tokens == path[0].tolist()
        else:
            assert draft.tokens == want.argmax(-1).tolist()


def test_context_fed_in_pieces_equals_all_at_once(verifier_folder, tmp_path):
    """The drafter's context cache: fed over several rounds, the block equals one fed whole."""
    from edgespec.drafters.dflash import reference_round

    engine = load(verifier_folder, drafter=write_random(tmp_path / "d", "dflash2", (0, 3), 8))
    ids = PROMPT[:20]
    d, cache, feats = recorded_states(engine, ids)
    whole = reference_round(d, np.array(feats[:-1]), ids[-1])
    d.begin(ids[:6])
    for a, b in ((0, 5), (5, 6), (6, 19)):
        d._trim_to(a)
        d.block(ids[b], feats[a:b][None])
    d.seq = ids
    d.fed = 19
    from edgespec.logits.sampling import Sampler, SamplingParams

    assert d.draft(7, Sampler(SamplingParams(temperature=0.0))).tokens == whole


# ---------------------------------------------------------------- pairing


def test_pairing_refused_by_name(verifier_folder, tmp_path):
    bad_mask = write_random(tmp_path / "mask", mask=V + 5)
    with pytest.raises(ModelLoadError, match="mask_token_id"):
        load(verifier_folder, drafter=bad_mask)
    bad_layer = write_random(tmp_path / "layer", target_ids=(1, 7))
    with pytest.raises(ModelLoadError, match="target_layer_ids"):
        load(verifier_folder, drafter=bad_layer)
    from edgespec.converters.convert import convert

    with pytest.raises(ModelLoadError, match="mask_token_id"):
        convert(verifier_folder, tmp_path / "b", quantize="none", dtype="float32", progress=False, drafter=bad_mask,
                drafter_options={"coreml": False})
    engine = load(verifier_folder, drafter=write_random(tmp_path / "ok"))
    for mode in ("tree", "cascade"):
        with pytest.raises(Exception, match="dflash"):
            engine.generate(PROMPT[:5], max_tokens=4, mode=mode)
    from edgespec.caches.kv import HiddenKVCache
    from edgespec.drafters import attach_drafter

    assert any(isinstance(c, HiddenKVCache) for c in engine.model.make_cache())
    attach_drafter(engine, tmp_path / "ok")  # the same drafter again: the old one's close leaves the new recording
    assert any(isinstance(c, HiddenKVCache) for c in engine.model.make_cache())
    attach_drafter(engine, "none")  # replaced: the verifier's passes record nothing any more
    assert not any(isinstance(c, HiddenKVCache) for c in engine.model.make_cache())


# ---------------------------------------------------------------- exact drafting


def check_greedy_exact(engine, monkeypatch, prompts, max_tokens=30):
    refs = [engine.generate(p, max_tokens=max_tokens, mode="plain").tokens for p in prompts]
    calls = count_drafts(engine.drafter, monkeypatch)
    drafted = accepted = 0
    by_pos = None
    for p, ref in zip(prompts, refs, strict=True):
        spec = engine.generate(p, max_tokens=max_tokens, mode="speculative", draft_tokens=6)
        assert spec.tokens == ref
        drafted, accepted = drafted + spec.stats.drafted, accepted + spec.stats.accepted
        a = np.array(spec.stats.accepted_by_position, dtype=float)
        by_pos = a if by_pos is None else by_pos[: len(a)] + a[: len(by_pos)]
    assert drafted > accepted > 0, (drafted, accepted)
    assert by_pos[0] > by_pos[-1]  # some round kept its first draft and rejected a later one
    calls.clear()
    for p, ref in zip(prompts, refs, strict=True):
        assert engine.generate(p, max_tokens=max_tokens).tokens == ref  # mode auto
    assert calls  # auto drafted with it
    return refs


def peaky_folder(tmp_path, kind="dflash", target_ids=(3,)):
    return write_random(tmp_path / kind, kind, target_ids, 8)


def test_speculative_and_auto_equal_plain_on_a_dense_verifier(verifier_folder, tmp_path, monkeypatch):
    for kind in ("dflash", "dflash2"):
        engine = load(verifier_folder, drafter=peaky_folder(tmp_path, kind))
        check_greedy_exact(engine, monkeypatch, [PROMPT[:9], PROMPT[3:20], PROMPT[:2]])


def test_speculative_and_auto_equal_plain_on_a_hybrid_verifier(tmp_path, monkeypatch):
    from test_mtp import mtp_checkpoint

    folder = tmp_path / "qwen3_5"
    folder.mkdir()
    mtp_checkpoint(folder, vocab=V, mtp=False)
    two_way_head(folder)
    drafter = write_random(tmp_path / "d", "dflash", (1, 3), 8, E=48, head_dim=12)
    engine = load(folder, drafter=drafter)
    check_greedy_exact(engine, monkeypatch, [PROMPT[:9], PROMPT[3:20]], max_tokens=20)


def test_four_requests_at_once_draft_with_forks_of_their_own(verifier_folder, tmp_path, monkeypatch):
    engine = load(verifier_folder, drafter=peaky_folder(tmp_path, "dflash2", (0, 3)))
    prompts = [PROMPT[i : i + 8] for i in range(4)]
    refs = [engine.generate(p, max_tokens=24, mode="plain").tokens for p in prompts]
    calls = count_drafts(engine.drafter, monkeypatch)
    for mode in ("speculative", "auto"):
        got = run_at_once(lambda i, mode=mode: engine.generate(prompts[i], max_tokens=24, mode=mode))
        assert [g.tokens for g in got] == refs, mode
        assert sum(g.stats.accepted for g in got) > 0, mode  # the forks found their verifier states
    assert calls


def test_sampled_output_follows_the_verifiers_law(tmp_path):
    """Chi-square of 3-token continuations of speculative sampling with a DFlash2 drafter (its
    selector's q) against the law enumerated from plain decoding, on an 8-token verifier; and
    seeded sampling in auto equals plain's."""
    from edgespec.logits.sampling import SamplingParams
    from edgespec.modes.speculative import SpeculativeMode
    from edgespec.options import GenerateOptions

    verifier = write_tiny_hf_folder(tmp_path / "v", seed=4, vocab_size=8, num_hidden_layers=2)
    engine = load(verifier, drafter=write_random(tmp_path / "d", "dflash2", (0, 1), 4, vocab=8, mask=7, layers=1))
    prompt, params = [1, 5, 2, 7], dict(temperature=1.0)
    law = continuation_law(engine.model, prompt, SamplingParams(**params), 3)
    keys = list(law)
    mode = SpeculativeMode(engine.model, engine.drafter, GenerateOptions(draft_tokens=3))
    counts, accepted = continuation_counts(mode, prompt, params, keys, 300, 3)
    assert accepted > 0
    pv = chisq_pvalue(counts, np.array([law[k] for k in keys]))
    assert pv > 1e-3, f"speculative samples with a DFlash drafter differ from plain's law (p-value {pv:.2g})"
    wrong = np.array([law[k] for k in keys]) ** 0.5
    assert chisq_pvalue(counts, wrong / wrong.sum()) < 1e-3
    for seed in (1, 2):
        kw = dict(max_tokens=16, temperature=0.8, seed=seed)
        assert engine.generate(prompt, mode="auto", **kw).tokens == engine.generate(prompt, mode="plain", **kw).tokens


# ---------------------------------------------------------------- Core ML


class ExecutorBlockBackend:
    """PackageBlock backend running the package with the numpy MIL executor (a Mac runs Core ML)."""

    def __init__(self, path, fp16: bool):
        from edgespec.converters.mil_executor import MILExecutor

        self.executor = MILExecutor(path, fp16=fp16)
        self.calls: list[tuple[str, int]] = []
        self.reset()

    def reset(self) -> None:
        self.state = self.executor.make_state("feed_1")

    def call(self, function, rows, ids, position):
        from edgespec.drafters.dflash import package_features
        from edgespec.drafters.mtp import package_rows

        self.calls.append((function, position))
        out = self.executor.run(function, {"features": package_features(rows), "input_ids": ids,
                                           "position": np.array([position], np.int32)}, self.state)
        return package_rows(out["logits"]), package_rows(out["hidden_out"])


@pytest.fixture(scope="module", params=["dflash2"])  # DFlash2: the plain layers plus its convolutions
def package_bundle(request, verifier_folder, tmp_path_factory):
    """`edgespec convert MODEL OUT --drafter DFLASH_FOLDER`: drafter/ and drafter.mlpackage."""
    pytest.importorskip("coremltools")
    from edgespec.converters.convert import convert

    tmp = tmp_path_factory.mktemp(f"dflash_pkg_{request.param}")
    src = write_random(tmp / "src", request.param, (0, 3), 8)
    convert(verifier_folder, tmp / "bundle", quantize="none", dtype="float32", progress=False, drafter=src,
            drafter_options={"context_length": 48, "prefill_chunk": 8})
    return tmp / "bundle"


def test_exported_package_matches_the_mlx_forward_in_the_mil_executor(package_bundle):
    from coreml_support import ALLOWED_OPS, rel_err

    from edgespec.drafters.dflash import DFlashDrafter, PackageBlock

    manifest = json.loads((package_bundle / "manifest.json").read_text())
    info = manifest["drafter"]["coreml"]
    assert info["kind"] == "dflash" and info["functions"] == ["feed_1", "feed_2", "feed_4", "feed_8"]
    engine = load(package_bundle)
    assert isinstance(engine.drafter, DFlashDrafter) and engine.drafter.package is None  # no Core ML here
    ids = PROMPT[:20]
    d, cache, feats = recorded_states(engine, ids)
    want = []
    d.begin(ids)
    for a, b in ((0, 11), (11, 14), (14, 19)):  # context over three rounds, a block after each
        want.append(np.array(d.logits(d.block(ids[b], feats[a:b][None]))))
    package = package_bundle / "drafter.mlpackage"
    for fp16, tol in ((False, 3e-3), (True, 1e-2)):
        backend = ExecutorBlockBackend(package, fp16)
        ops = {op.op_type for f in backend.executor.functions.values() for op in f.operations}
        assert ops <= ALLOWED_OPS, ops - ALLOWED_OPS
        block = PackageBlock(backend, info)
        block.reset()
        for (a, b), w in zip(((0, 11), (11, 14), (14, 19)), want, strict=True):
            got = np.array(block.block(ids[b], feats[a:b][None])[0])
            assert rel_err(got, w) < tol, (fp16, rel_err(got, w))
            assert (got.argmax(-1) == w.argmax(-1)).all()
        assert [c[0] for c in backend.calls] == ["feed_8", "feed_2", "feed_1", "feed_2", "feed_1", "feed_4", "feed_1"]
        block.trim_to(14)  # a rollback: the last round again
        assert rel_err(np.array(block.block(ids[19], feats[14:19][None])[0]), want[-1]) < tol


def test_speculative_with_the_package_equals_plain(package_bundle):
    """The drafter over the package (MIL executor standing in for Core ML): greedy output identical
    to plain with blocks rejected mid-way, its proposals those of the MLX layers."""
    from edgespec.drafters.dflash import PackageBlock

    info = json.loads((package_bundle / "manifest.json").read_text())["drafter"]["coreml"]
    engine = load(package_bundle)
    ref = engine.generate(PROMPT[:9], max_tokens=24, mode="plain").tokens
    mlx_run = engine.generate(PROMPT[:9], max_tokens=24, mode="speculative", draft_tokens=6)
    backend = ExecutorBlockBackend(package_bundle / "drafter.mlpackage", fp16=False)
    engine.drafter.package = PackageBlock(backend, info)
    spec = engine.generate(PROMPT[:9], max_tokens=24, mode="speculative", draft_tokens=6)
    assert spec.tokens == ref and spec.stats.drafted > spec.stats.accepted > 0
    assert spec.stats.accepted_by_position == mlx_run.stats.accepted_by_position
    assert backend.calls
