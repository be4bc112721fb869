"""Qwen3.5's multi-token-prediction head (`mtp.*`) as a drafter (models/qwen3_5.MTPHead,
edgespec/drafters/mtp.py).

transformers (5.x) drops `mtp.*` weights on load (`_keys_to_ignore_on_load_unexpected`), so
the head's reference is written here from the published definition (vLLM's
Qwen3_5MultiTokenPredictor): (1 + w) RMSNorms of the embedding of x_{t+1} and of the
verifier's final-norm hidden state h_t, fc over [embedding; hidden], one Qwen3.5
full-attention decoder layer (transformers' own, run through a one-layer Qwen3_5TextModel
whose final norm is `mtp.norm`), and the verifier's lm_head.
"""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from conftest import count_drafts, run_at_once
from stats_support import chisq_pvalue, continuation_counts, continuation_law

import edgespec
from edgespec.errors import ModelLoadError

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

V = 40  # a small vocabulary: random heads still guess right now and then (mid-chain rejections)
PROMPT = [int(t) for t in np.random.RandomState(7).randint(1, V, size=24)]


def text_config(vocab: int, layers: list[str], init: float):
    return transformers.Qwen3_5TextConfig(
        vocab_size=vocab, hidden_size=48, intermediate_size=80, num_hidden_layers=len(layers),
        num_attention_heads=4, num_key_value_heads=2, head_dim=12, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=10, linear_conv_kernel_dim=3,
        layer_types=layers, rope_parameters={"rope_type": "default", "rope_theta": 20000.0,
                                             "partial_rotary_factor": 0.5},
        initializer_range=init, eos_token_id=0, bos_token_id=1, pad_token_id=0, tie_word_embeddings=False)


def randomize(model) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.rand_like(p) * 2 - 1)
            elif p.ndim == 1:  # norms, dt_bias: away from their constant init
                p.add_(0.2 * torch.randn_like(p))


def mtp_checkpoint(folder, seed: int = 1, vocab: int = V, init: float = 0.3, mtp: bool = True, drop=None,
                   reshape=None):
    """A random Qwen3.5 (linear and full attention interleaved) saved to `folder` with a
    tokenizer and, with `mtp`, an MTP head in mtp.safetensors (config: mtp_num_hidden_layers 1).
    Returns (main model, one-layer model holding the MTP layer and norm, the head's glue tensors)."""
    from safetensors.torch import save_file
    from test_architectures import vocab_tokenizer

    torch.manual_seed(seed)
    main = transformers.AutoModelForCausalLM.from_config(
        text_config(vocab, ["linear_attention", "full_attention", "linear_attention", "full_attention"], init),
        dtype=torch.float32).eval()
    randomize(main)
    main.save_pretrained(folder)
    vocab_tokenizer(vocab).save(folder)
    if not mtp:
        return main, None, None
    layer = transformers.Qwen3_5TextModel(text_config(vocab, ["full_attention"], init)).eval()
    randomize(layer)
    E = main.config.hidden_size
    glue = {"fc.weight": torch.randn(E, 2 * E) * 0.15, "pre_fc_norm_embedding.weight": 0.3 * torch.randn(E),
            "pre_fc_norm_hidden.weight": 0.3 * torch.randn(E)}
    tensors = {f"mtp.{k}": v for k, v in glue.items()}
    for k, v in layer.state_dict().items():
        if k.startswith(("layers.", "norm.")):
            tensors[f"mtp.{k}"] = v.detach().clone().contiguous()
    for k in drop or ():
        tensors.pop(k)
    for k, shape in (reshape or {}).items():
        tensors[k] = torch.zeros(shape)
    save_file(tensors, str(folder / "mtp.safetensors"))
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(mtp_num_hidden_layers=1, mtp_use_dedicated_embeddings=False)
    (folder / "config.json").write_text(json.dumps(cfg))
    return main, layer, glue


def reference_mtp_logits(main, layer, glue, ids: list[int]) -> np.ndarray:
    """Logits (T-1, V) the head gives for x_{t+2} from (x_{t+1}, h_t), t = 0..T-2, as published."""

    def norm(x, w, eps=main.config.rms_norm_eps):  # Qwen3.5's RMSNorm: (1 + w), computed in fp32
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w)

    with torch.no_grad():
        x = torch.tensor([ids])
        h = main.model(input_ids=x).last_hidden_state  # after the final norm
        e = main.model.embed_tokens(x[:, 1:])
        z = torch.cat([norm(e, glue["pre_fc_norm_embedding.weight"]),
                       norm(h[:, :-1], glue["pre_fc_norm_hidden.weight"])], dim=-1) @ glue["fc.weight"].T
        out = layer(inputs_embeds=z).last_hidden_state  # the full-attention layer at 0..T-2, then mtp.norm
        return main.lm_head(out)[0].numpy()


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_5_mtp")
    return path, mtp_checkpoint(path)


def load(path, **kw):
    return edgespec.load(path, progress=False, history="off", **kw)


# ---------------------------------------------------------------- the head's math


def test_mtp_head_matches_the_published_definition(folder):
    path, (main, layer, glue) = folder
    engine = load(path, drafter="none")
    model = engine.model
    assert model.mtp is not None
    ids = PROMPT[:20]
    want = reference_mtp_logits(main, layer, glue, ids)
    _, h = model(mx.array([ids]), return_hidden=True)
    got = model.project(model.mtp(model.embed(mx.array([ids[1:]])), h[:, :-1]))[0]
    np.testing.assert_allclose(np.array(got), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    # through its KV cache, entries appended in pieces: the same rows (RoPE positions 0, 1, ...)
    cache = model.mtp.make_cache()
    e, hh = model.embed(mx.array([ids[1:]])), h[:, :-1]
    rows = [model.mtp(e[:, a:b], hh[:, a:b], cache) for a, b in ((0, 11), (11, 12), (12, 19))]
    got = model.project(mx.concatenate(rows, axis=1))[0]
    np.testing.assert_allclose(np.array(got), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


# ---------------------------------------------------------------- drafting is exact


def test_mtp_drafting_equals_plain_from_the_folder_and_the_bundle(folder, tmp_path, monkeypatch):
    """The head loads with the verifier (folder and converted bundle), `speculative` and `auto`
    draft with it unasked, greedy output equals plain with drafts rejected mid-chain, and the
    head's cache after those rounds holds exactly the entries of the committed path."""
    from edgespec.converters.convert import convert

    from edgespec.drafters.mtp import MTPDrafter

    path, _ = folder
    convert(path, tmp_path / "bundle", quantize="none", dtype="float32", progress=False)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "bundle" / "model.safetensors"), "np") as f:
        assert "mtp.fc.weight" in f.keys()  # the bundle keeps the head
    prompts = [PROMPT[:9], PROMPT[4:20]]
    for src in (path, tmp_path / "bundle"):
        engine = load(src)
        assert isinstance(engine.drafter, MTPDrafter), src.name
        refs = [engine.generate(p, max_tokens=30, mode="plain").tokens for p in prompts]
        calls = count_drafts(engine.drafter, monkeypatch)
        drafted = accepted = 0
        by_pos = np.zeros(4)
        for p, ref in zip(prompts, refs, strict=True):
            spec = engine.generate(p, max_tokens=30, mode="speculative", draft_tokens=4)
            assert spec.tokens == ref, src.name
            drafted, accepted = drafted + spec.stats.drafted, accepted + spec.stats.accepted
            by_pos[: len(spec.stats.accepted_by_position)] += spec.stats.accepted_by_position
        assert drafted > accepted > 0, (drafted, accepted)
        assert by_pos[0] > by_pos[-1]  # some round kept its first draft and rejected a later one
        calls.clear()
        for p, ref in zip(prompts, refs, strict=True):
            auto = engine.generate(p, max_tokens=30)  # mode auto, no options
            assert auto.tokens == ref, src.name
        assert calls  # auto asked the head for drafts
    check_head_cache_is_the_committed_paths(engine)


def check_head_cache_is_the_committed_paths(engine):
    """After speculative rounds with rejections, the head's kept entries equal the entries built
    from scratch along the committed sequence (the rollback left nothing of a rejected guess)."""
    from edgespec.generate import GenerationStats
    from edgespec.logits.sampling import Sampler, SamplingParams
    from edgespec.modes.speculative import SpeculativeMode
    from edgespec.options import GenerateOptions

    model, drafter = engine.model, engine.drafter
    mode = SpeculativeMode(model, drafter, GenerateOptions(draft_tokens=3))
    stats = GenerationStats()
    prompt = PROMPT[:9]
    steps = mode.steps(prompt, Sampler(SamplingParams(temperature=0.0)), stats)
    out = [next(steps).id for _ in range(29)]
    assert 0 < stats.accepted < stats.drafted
    seq = prompt + out
    fed = drafter.fed
    assert fed > len(prompt)
    _, h = model(mx.array([seq[: fed + 1]]), return_hidden=True)
    cache = model.mtp.make_cache()
    model.mtp(model.embed(mx.array([seq[1 : fed + 1]])), h[:, :fed], cache)
    keys, vals = drafter.head.cache[0].state
    # Entries written by passes of other widths round differently (about 3e-5 here, as every
    # multi-position pass does: docs/bitwise.md); a rejected guess left behind differs by O(1).
    np.testing.assert_allclose(np.array(keys[..., :fed, :]), np.array(cache[0].state[0]), rtol=1e-3, atol=1e-4)
    np.testing.assert_allclose(np.array(vals[..., :fed, :]), np.array(cache[0].state[1]), rtol=1e-3, atol=1e-4)
    steps.close()


def test_modes_that_cannot_use_the_head_refuse_it_by_name(folder):
    path, _ = folder
    engine = load(path)
    with pytest.raises(ValueError, match="'mtp'.*verifier's cache"):
        engine.generate(PROMPT[:7], max_tokens=4, mode="tree")
    with pytest.raises(ValueError, match="'mtp'.*verifier's cache"):
        engine.generate(PROMPT[:7], max_tokens=4, mode="cascade")


# ---------------------------------------------------------------- sampling


def test_speculative_sampling_with_the_head_matches_the_exact_law(tmp_path):
    """Chi-square of 3-token continuations of speculative sampling with the MTP drafter (K=2)
    against the law enumerated from plain decoding, on an 8-token Qwen3.5 with an MTP head;
    and seeded sampling in auto equals plain's."""
    from edgespec.drafters.mtp import MTPDrafter
    from edgespec.logits.sampling import SamplingParams
    from edgespec.modes.speculative import SpeculativeMode
    from edgespec.options import GenerateOptions

    mtp_checkpoint(tmp_path, seed=5, vocab=8, init=0.6)
    engine = load(tmp_path)
    model = engine.model
    assert isinstance(engine.drafter, MTPDrafter)
    prompt, params = [1, 5, 2, 7], dict(temperature=1.0)
    law = continuation_law(model, prompt, SamplingParams(**params), 3)
    keys = list(law)
    mode = SpeculativeMode(model, engine.drafter, GenerateOptions(draft_tokens=2))
    counts, accepted = continuation_counts(mode, prompt, params, keys, 500, 3)
    assert accepted > 0
    pv = chisq_pvalue(counts, np.array([law[k] for k in keys]))
    assert pv > 1e-3, f"speculative samples with the MTP head differ from plain's law (p-value {pv:.2g})"
    wrong = np.array([law[k] for k in keys]) ** 0.5
    assert chisq_pvalue(counts, wrong / wrong.sum()) < 1e-3
    for seed in (1, 2):
        kw = dict(max_tokens=16, temperature=0.8, seed=seed)
        assert engine.generate(prompt, mode="auto", **kw).tokens == engine.generate(prompt, mode="plain", **kw).tokens


# ---------------------------------------------------------------- checkpoints without a (usable) head


def test_a_checkpoint_without_mtp_weights_works_as_before(folder, tmp_path):
    """The same main weights without mtp.safetensors (config still declaring a head): no head,
    no drafter, no hidden states recorded, and the same output as the folder with the head."""
    mtp_checkpoint(tmp_path, mtp=False)  # the fixture's seed: the same main model
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "mtp_num_hidden_layers": 1}))  # declared, absent
    engine = load(tmp_path)
    assert getattr(engine.model, "mtp", None) is None and engine.drafter is None
    assert not engine.model.keep_hidden
    out = engine.generate(PROMPT[:9], max_tokens=24)
    with_head = load(folder[0])
    assert out.tokens == with_head.generate(PROMPT[:9], max_tokens=24, mode="plain").tokens
    with pytest.raises(ModelLoadError, match="no MTP head"):
        load(tmp_path, drafter="mtp")


@pytest.mark.parametrize("bad, match", [
    ({"drop": ["mtp.layers.0.self_attn.k_proj.weight"]}, r"lacks tensor mtp\.layers\.0\.self_attn\.k_proj\.weight"),
    ({"reshape": {"mtp.fc.weight": (48, 48)}}, r"mtp\.fc\.weight has shape \(48, 48\).*\(48, 96\)"),
    ({"reshape": {"mtp.extra.weight": (3,)}}, r"mtp\.extra\.weight not part of"),
])
def test_a_malformed_head_is_refused_naming_the_tensor(tmp_path, bad, match):
    mtp_checkpoint(tmp_path, **bad)
    with pytest.raises(ModelLoadError, match=match):
        load(tmp_path)


def test_a_head_with_unsupported_settings_is_skipped_with_a_note(tmp_path):
    mtp_checkpoint(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "mtp_use_dedicated_embeddings": True}))
    engine = load(tmp_path)
    assert getattr(engine.model, "mtp", None) is None and engine.drafter is None
    assert "mtp_use_dedicated_embeddings" in engine.model.load_note


# ---------------------------------------------------------------- Core ML export


class ExecutorMTPBackend:
    """CoreMLHead backend running the package with the numpy MIL executor (the Mac runs Core ML)."""

    def __init__(self, path, fp16: bool):
        from edgespec.converters.mil_executor import MILExecutor

        self.executor = MILExecutor(path, fp16=fp16)
        self.calls: list[tuple[str, int]] = []
        self.reset()

    def reset(self) -> None:
        self.state = self.executor.make_state()

    def call(self, function, ids, hidden, position):
        from edgespec.drafters.mtp import package_hidden, package_rows

        self.calls.append((function, position))
        out = self.executor.run(function, {"input_ids": ids, "hidden": package_hidden(hidden),
                                           "position": np.array([position], np.int32)}, self.state)
        return package_rows(out["logits"]), package_rows(out["hidden_out"])


@pytest.fixture(scope="module")
def mtp_bundle(folder, tmp_path_factory):
    """`edgespec convert SRC OUT --drafter mtp`: the head exported to OUT/drafter.mlpackage."""
    pytest.importorskip("coremltools")
    from edgespec.converters.convert import convert

    path, _ = folder
    out = tmp_path_factory.mktemp("mtp_bundle") / "bundle"
    convert(path, out, quantize="none", dtype="float32", progress=False, drafter="mtp",
            drafter_options={"context_length": 64, "prefill_chunk": 8})
    return out


def test_exported_head_matches_its_mlx_forward_in_the_mil_executor(folder, mtp_bundle):
    from coreml_support import ALLOWED_OPS, rel_err

    from edgespec.drafters.mtp import CoreMLHead

    manifest = json.loads((mtp_bundle / "manifest.json").read_text())
    info = manifest["drafter"]["coreml"]
    assert manifest["drafter"]["kind"] == "mtp" and info["kind"] == "mtp"
    assert info["functions"] == ["prefill", "decode", "decode_2", "decode_3", "decode_4", "decode_5"]
    path, _ = folder
    model = load(path, drafter="none").model
    ids = PROMPT[:20]
    _, h = model(mx.array([ids]), return_hidden=True)
    want_h = model.mtp(model.embed(mx.array([ids[1:]])), h[:, :-1])
    want = np.array(model.project(want_h)[0])[7:]  # the prefill chunk's last entry, then one per entry
    package = mtp_bundle / "drafter.mlpackage"
    for fp16, tol in ((False, 3e-3), (True, 1e-2)):
        backend = ExecutorMTPBackend(package, fp16)
        ops = {op.op_type for f in backend.executor.functions.values() for op in f.operations}
        assert ops <= ALLOWED_OPS | {"sigmoid"}, ops - ALLOWED_OPS
        head = CoreMLHead(backend, info)
        head.reset()
        rows = np.array(h[0, :-1])
        got = [np.array(head.feed(ids[1:9], mx.array(rows[None, :8]))[0])]  # prefill (T = 8)
        hid = []
        for j in range(8, 19):  # one entry at a time (decode)
            lg, g = head.feed(ids[j + 1 : j + 2], mx.array(rows[None, j : j + 1]))
            got.append(np.array(lg))
            hid.append(np.array(g)[0, 0])
        got = np.stack(got)
        assert rel_err(got, want) < tol, (fp16, rel_err(got, want))
        assert (got.argmax(-1) == want.argmax(-1)).all()
        assert rel_err(np.stack(hid), np.array(want_h[0, 8:])) < tol
        assert [c[0] for c in backend.calls] == ["prefill"] + ["decode"] * 11
        # K-entry decodes and a rollback: the same rows as the one-at-a-time run
        head.trim_to(10)
        lg, _ = head.feed(ids[11:16], mx.array(rows[None, 10:15]))  # one decode_5 call at position 10
        assert backend.calls[-1] == ("decode_5", 10)
        assert rel_err(np.array(lg)[None], got[7:8]) < tol


def test_speculative_with_the_exported_head_equals_plain(folder, mtp_bundle):
    """The drafter over the package (MIL executor standing in for Core ML): greedy output
    identical to plain with drafts rejected, and its drafts those of the MLX head."""
    from edgespec.drafters.mtp import CoreMLHead, MLXHead, MTPDrafter

    info = json.loads((mtp_bundle / "manifest.json").read_text())["drafter"]["coreml"]
    engine = load(mtp_bundle)
    assert isinstance(engine.drafter, MTPDrafter) and isinstance(engine.drafter.head, MLXHead)  # no Core ML here
    ref = engine.generate(PROMPT[:9], max_tokens=24, mode="plain").tokens
    mlx_run = engine.generate(PROMPT[:9], max_tokens=24, mode="speculative", draft_tokens=3)
    backend = ExecutorMTPBackend(mtp_bundle / "drafter.mlpackage", fp16=False)
    engine.drafter = MTPDrafter(engine.model, head=CoreMLHead(backend, info))
    spec = engine.generate(PROMPT[:9], max_tokens=24, mode="speculative", draft_tokens=3)
    assert spec.tokens == ref and spec.stats.drafted > spec.stats.accepted > 0
    assert spec.stats.accepted_by_position == mlx_run.stats.accepted_by_position
    assert any(fn.startswith("decode_") for fn, _ in backend.calls)  # a round's entries in one call


@pytest.mark.macos
def test_the_bundle_drafts_with_core_ml_on_a_mac(mtp_bundle):
    from edgespec.drafters.mtp import CoreMLHead, MTPDrafter

    engine = load(mtp_bundle)
    assert isinstance(engine.drafter, MTPDrafter) and isinstance(engine.drafter.head, CoreMLHead)
    ref = engine.generate(PROMPT[:9], max_tokens=24, mode="plain").tokens
    assert engine.generate(PROMPT[:9], max_tokens=24, mode="speculative", draft_tokens=3).tokens == ref
    assert engine.generate(PROMPT[:9], max_tokens=24).tokens == ref


def test_add_drafter_mtp_to_an_existing_bundle(folder, tmp_path):
    """`edgespec convert BUNDLE --add-drafter mtp` (here without the Core ML package): the entry
    names the head; a source without one is refused by name."""
    from edgespec.converters.convert import add_drafter, convert

    path, _ = folder
    convert(path, tmp_path / "b", quantize="none", dtype="float32", progress=False)
    manifest = add_drafter(tmp_path / "b", "mtp", progress=False, drafter_options={"coreml": False})
    assert manifest["drafter"]["kind"] == "mtp" and manifest["drafter"]["coreml"] is None
    mtp_checkpoint(tmp_path / "plain", mtp=False)
    with pytest.raises(ModelLoadError, match="no MTP head"):
        convert(tmp_path / "plain", tmp_path / "c", quantize="none", dtype="float32", progress=False,
                drafter="mtp", drafter_options={"coreml": False})


@pytest.mark.parametrize("packaged", [False, True])
def test_concurrent_requests_draft_with_heads_of_their_own(folder, mtp_bundle, packaged):
    """Four requests at once in one batch, each drafting with a fork of the engine's MTP drafter
    (its own head cache, or Core ML state: the executor stands in), get their solo output."""
    from edgespec.drafters.mtp import CoreMLHead, MTPDrafter

    engine = load(mtp_bundle)
    if packaged:
        info = json.loads((mtp_bundle / "manifest.json").read_text())["drafter"]["coreml"]
        engine.drafter = MTPDrafter(engine.model, head=CoreMLHead(
            ExecutorMTPBackend(mtp_bundle / "drafter.mlpackage", fp16=False), info))
    asks = [PROMPT[i : i + 9] for i in range(4)]
    want = [engine.generate(a, max_tokens=20, mode="plain").tokens for a in asks]
    got = run_at_once(lambda i: engine.generate(asks[i], max_tokens=20, mode="speculative", draft_tokens=3).tokens)
    assert got == want
    assert max(engine.batcher.batch_sizes) > 1
