"""EAGLE-3 heads (models/eagle3.py, edgespec/drafters/eagle3.py).

The reference is the `speculators` package (installed --no-deps by `make setup`; the modules it
imports for training, data and serving only, such as `datasets` and `hs_connectors`, are stood
in for when absent): its Eagle3DraftModel on random weights, written by the test in both published layouts
(the speculators one, config with `speculators_config`; the EAGLE authors' one, `midlayer.*` and
a Llama config with `draft_vocab_size`), and compared logit for logit over its training forward
(three steps, each step's tokens the reference's shifted inputs) with edgespec's head fed the same
tokens and hidden states. Drafting is checked exact: greedy `speculative` and `auto` equal plain on
a Llama and a Qwen3 verifier and on a hybrid (Qwen3.5) one, four requests at once, and the law of
sampled continuations is the verifier's (chi-square). Malformed folders and heads for another
verifier are refused by name.
"""

from __future__ import annotations

import json
import sys
import types

import mlx.core as mx
import numpy as np
import pytest
from conftest import count_drafts, run_at_once, write_tiny_hf_folder
from stats_support import chisq_pvalue, continuation_counts, continuation_law

import edgespec
from edgespec.errors import ModelLoadError

V = 40
PROMPT = [int(t) for t in np.random.RandomState(7).randint(1, V, size=24)]
E = 64
VERIFIER = dict(vocab_size=V, num_hidden_layers=4, tie_word_embeddings=False)


class _Stub(types.ModuleType):
    """A module the reference imports for training or data only: any name is a dummy class."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return type(name, (), {"__init__": lambda s, *a, **k: None})


# What the reference's model code computes with; any other module it imports (training, data
# generation, serving clients: datasets, hs_connectors, openai, ...) is stood in for when absent.
NEEDED = ("torch", "transformers", "safetensors", "pydantic", "numpy", "speculators")


def speculators_eagle3():
    """The reference's Eagle3DraftModel module (skipped without torch or speculators)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import importlib.util

    if importlib.util.find_spec("speculators") is None:
        pytest.skip("the speculators package is not installed (make setup installs it)")
    for _ in range(30):
        try:
            from speculators.models.eagle3 import core

            return core
        except ModuleNotFoundError as e:
            if e.name is None or e.name.split(".")[0] in NEEDED:
                raise
            parts = e.name.split(".")
            for i in range(1, len(parts) + 1):
                name = ".".join(parts[:i])
                mod = sys.modules.setdefault(name, _Stub(name))
                mod.__path__ = []
            for k in [k for k in sys.modules if k.startswith("speculators")]:
                del sys.modules[k]
    raise ImportError("speculators.models.eagle3 did not import")


def layer_config(kind: str, vocab: int = V, layers: int = 1, **extra) -> dict:
    cfg = dict(model_type=kind, hidden_size=E, num_hidden_layers=layers, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, intermediate_size=96, vocab_size=vocab, rms_norm_eps=1e-6,
               rope_theta=10000.0, max_position_embeddings=512, attention_bias=False, tie_word_embeddings=False,
               hidden_act="silu")
    cfg.update(extra)
    return cfg


def write_reference(folder, kind: str = "llama", layout: str = "speculators", layer_ids=(1, 2, 4),
                    draft_vocab: int = 24, layers: int = 1, seed: int = 0, scale: float = 0.3, **flags):
    """The reference's Eagle3DraftModel on random weights (a random draft vocabulary map), saved
    in `layout`; returns the torch model."""
    torch = pytest.importorskip("torch")
    core = speculators_eagle3()
    from safetensors.torch import save_file
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import LlamaConfig
    from transformers.models.qwen3.configuration_qwen3 import Qwen3Config

    torch.manual_seed(seed)
    lcfg = layer_config(kind, layers=layers)
    tl = (Qwen3Config if kind == "qwen3" else LlamaConfig)(**{k: v for k, v in lcfg.items() if k != "model_type"})
    tl._attn_implementation = "eager"
    config = core.Eagle3SpeculatorConfig(
        transformer_layer_config=tl, draft_vocab_size=draft_vocab, eagle_aux_hidden_state_layer_ids=list(layer_ids),
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
            default_proposal_method="greedy", verifier=VerifierConfig(name_or_path=None, architectures=["LlamaForCausalLM"])),
        **flags)
    model = core.Eagle3DraftModel(config).eval()
    rng = np.random.RandomState(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * scale + (1.0 if "norm" in name else 0.0))
        if draft_vocab != V:
            tids = np.sort(rng.choice(V, draft_vocab, replace=False))
            model.d2t.copy_(torch.tensor(tids - np.arange(draft_vocab)))
            t2d = np.zeros(V, bool)
            t2d[tids] = True
            model.t2d.copy_(torch.tensor(t2d))
    tensors = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()
               if not k.startswith("verifier_")}
    folder.mkdir(parents=True, exist_ok=True)
    if layout == "speculators":
        config.save_pretrained(str(folder))  # the reference's own config writer
        cfg = None
    else:  # the EAGLE authors' layout: a Llama config with the EAGLE fields, layer 0 as `midlayer`,
        # saved with torch.save as the authors publish it (pytorch_model.bin)
        tensors = {k.replace("layers.0.", "midlayer."): v for k, v in tensors.items()}
        cfg = dict(lcfg, architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=draft_vocab,
                   eagle_config={"eagle_aux_hidden_state_layer_ids": list(layer_ids), "use_aux_hidden_state": True},
                   torch_dtype="float32", **flags)
    if layout == "speculators":
        save_file(tensors, str(folder / "model.safetensors"))
    else:
        torch.save(tensors, str(folder / "pytorch_model.bin"))
    if cfg is not None:
        (folder / "config.json").write_text(json.dumps(cfg))
    return model


def reference_logits(ref, feats: np.ndarray, ids: list[int], steps: int = 3) -> list[np.ndarray]:
    """The reference's training forward over verifier states `feats` (T, n*E) paired with tokens
    `ids` (T,) (pair t: the state of position t, the token of t + 1): each step's logits over the
    draft vocabulary (T, Vd), captured at its lm_head."""
    import torch

    got = []
    hook = ref.lm_head.register_forward_hook(lambda m, i, o: got.append(o[0].detach().numpy().copy()))
    try:
        with torch.no_grad():
            T = len(ids)
            ref(hidden_states=torch.tensor(feats)[None], input_ids=torch.tensor([ids]),
                document_ids=torch.zeros(1, T, dtype=torch.long), ttt_steps=steps)
    finally:
        hook.remove()
    return got


@pytest.fixture(scope="module")
def verifier_folder(tmp_path_factory):
    return write_tiny_hf_folder(tmp_path_factory.mktemp("eagle3_verifier") / "hf", seed=3, **VERIFIER)


def load(path, **kw):
    return edgespec.load(path, progress=False, history="off", **kw)


def recorded_states(engine, ids: list[int]):
    """Prefill `ids` with the head attached: (a fork of the drafter bound to the cache, the
    recorded rows (T, n*E))."""
    d = engine.drafter.fork()
    cache = engine.model.make_cache()
    d.bind_verifier_cache(cache)
    engine.model(mx.array([ids]), cache)
    return d, cache[d.tap].hidden[0, : len(ids)]


# ---------------------------------------------------------------- the published math


@pytest.mark.parametrize("kind,layout,flags", [
    ("llama", "speculators", {}),
    ("llama", "eagle", {}),
    ("qwen3", "speculators", {"norm_before_residual": True, "fc_norm": True}),
    ("llama", "speculators", {"norm_before_fc": True, "norm_output": True}),
])
def test_logits_match_the_reference(verifier_folder, tmp_path, kind, layout, flags):
    from edgespec.drafters.eagle3 import Eagle3Drafter

    ref = write_reference(tmp_path / "head", kind, layout, layers=2 if kind == "qwen3" else 1, **flags)
    engine = load(verifier_folder, drafter=tmp_path / "head")
    assert isinstance(engine.drafter, Eagle3Drafter)
    ids = PROMPT[:14]
    d, feats = recorded_states(engine, ids)
    # the recorded rows are the verifier's HF hidden_states[i] (the output of layer i - 1)
    h, outs = engine.model.embed(mx.array([ids])), []
    for layer in engine.model.layers:
        h = layer(h, "causal", None, None)
        outs.append(h)
    want = mx.concatenate([outs[i - 1] for i in (1, 2, 4)], axis=-1)[0]
    np.testing.assert_allclose(np.array(feats), np.array(want), atol=1e-5)
    # pairs (state of position t, token of t + 1), t = 0..T-1
    feats, pair_ids = np.array(feats[:-1]), ids[1:]
    T = len(pair_ids)
    want = reference_logits(ref, feats, pair_ids)
    # edgespec's head: every pair at once (step 0), then from each t a chain fed the reference's tokens
    d.begin(ids)
    emb = d.embed(mx.array([pair_ids]))
    h0 = d.model(emb, d.model.fuse(mx.array(feats)[None]), d.cache)
    diffs = [float(np.abs(np.array(d.model.logits(h0)[0]) - want[0]).max())]
    for t in range(T - 2):
        d.begin(ids)  # pairs 0..t, then a chain of two steps
        g = d.model.feedback(d.model(emb[:, : t + 1], d.model.fuse(mx.array(feats[: t + 1])[None]), d.cache)[:, -1:])
        for step in (1, 2):
            h = d.model(d.embed(mx.array([[pair_ids[t + step]]])), g, d.cache)
            diffs.append(float(np.abs(np.array(d.model.logits(h)[0, 0]) - want[step][t]).max()))
            g = d.model.feedback(h)
    scale = max(np.abs(w).max() for w in want)
    print(f"{kind}/{layout}/{sorted(flags)}: max abs diff {max(diffs):.2e} (logits up to {scale:.1f})")
    assert max(diffs) < 1e-4


def write_random(folder, targets=(5, 9, 1, 2), layer_ids=(1, 2, 4), E: int = E, vocab: int = V, seed: int = 0,
                 layers: int = 1, kind: str = "llama", scale: float = 1.0, **extra):
    """A random head in the speculators layout written from MLX alone (no torch needed); its draft
    vocabulary is the verifier's tokens `targets` (None: the whole vocabulary, no map)."""
    from edgespec.models.eagle3 import Model, ModelArgs
    from mlx.utils import tree_flatten

    layer = layer_config(kind, vocab=vocab, layers=layers, hidden_size=E, **extra)
    cfg = dict(speculators_model_type="eagle3", architectures=["Eagle3Speculator"], transformer_layer_config=layer,
               draft_vocab_size=len(targets) if targets else vocab, eagle_aux_hidden_state_layer_ids=list(layer_ids),
               norm_before_residual=False,
               speculators_config={"algorithm": "eagle3", "default_proposal_method": "greedy",
                                   "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                                   "verifier": {"name_or_path": None, "architectures": ["LlamaForCausalLM"]}})
    mx.random.seed(seed)
    model = Model(ModelArgs.from_dict(cfg))
    w = dict(tree_flatten(model.parameters()))
    w = {k: (v * scale if v.ndim > 1 else v) for k, v in w.items()}
    if targets:
        t = np.array(targets)
        w["d2t"] = mx.array(t - np.arange(len(t)), dtype=mx.int64)
        t2d = np.zeros(vocab, bool)
        t2d[t] = True
        w["t2d"] = mx.array(t2d)
    folder.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(folder / "model.safetensors"), w)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def two_way_head(folder, a: int = 5, b: int = 9, dim: int = 0, size: float = 8.0):
    """The verifier's greedy text mostly a and b (by the sign of one hidden dimension): a head
    drafting among a few tokens including both is then right about half the time."""
    path = folder / "model.safetensors"
    w = dict(mx.load(str(path)))
    W = np.array(w["lm_head.weight"])
    W[a, dim] += size
    W[b, dim] -= size
    w["lm_head.weight"] = mx.array(W)
    mx.save_safetensors(str(path), w)
    return folder


# ---------------------------------------------------------------- refusals


def test_heads_for_another_verifier_and_malformed_folders_are_refused_by_name(verifier_folder, tmp_path):
    cases = {
        "hidden": (dict(E=32), "hidden size"),
        "layers": (dict(layer_ids=(1, 2, 7)), "eagle_aux_hidden_state_layer_ids"),
        "embedding layer": (dict(layer_ids=(0, 2, 4)), "eagle_aux_hidden_state_layer_ids"),
        "vocab": (dict(vocab=50), "vocabulary of 50"),
        "d2t past": (dict(targets=(5, 9, 39)), None),
        "d2t twice": (dict(targets=(5, 5, 9)), "two draft ids"),
    }
    for name, (kw, match) in cases.items():
        folder = write_random(tmp_path / name.replace(" ", "_"), **kw)
        if name == "d2t past":  # a map past the vocabulary: edit d2t after writing
            w = dict(mx.load(str(folder / "model.safetensors")))
            w["d2t"] = mx.array([5, 8, 60], dtype=mx.int64)
            w.pop("t2d")
            mx.save_safetensors(str(folder / "model.safetensors"), w)
            match = "outside the verifier's vocabulary"
        with pytest.raises(ModelLoadError, match=match):
            load(verifier_folder, drafter=folder)
    # t2d that marks other tokens than d2t reaches; a missing d2t; a tensor missing; a bad config; no safetensors
    folder = write_random(tmp_path / "t2d")
    w = dict(mx.load(str(folder / "model.safetensors")))
    w["t2d"] = mx.array(np.roll(np.array(w["t2d"]), 1))
    mx.save_safetensors(str(folder / "model.safetensors"), w)
    with pytest.raises(ModelLoadError, match="maps disagree"):
        load(verifier_folder, drafter=folder)
    for key, match in (("d2t", "needs its d2t map"), ("fc.weight", "do not fit")):
        folder = write_random(tmp_path / f"no_{key}")
        w = dict(mx.load(str(folder / "model.safetensors")))
        w.pop(key)
        mx.save_safetensors(str(folder / "model.safetensors"), w)
        with pytest.raises(ModelLoadError, match=match):
            load(verifier_folder, drafter=folder)
    folder = write_random(tmp_path / "config")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["norm_before_fc"] = cfg["fc_norm"] = True
    cfg["new_knob"] = 1
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="new_knob"):
        load(verifier_folder, drafter=folder)
    del cfg["new_knob"]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="mutually exclusive"):
        load(verifier_folder, drafter=folder)
    del cfg["fc_norm"]
    (folder / "config.json").write_text(json.dumps(cfg))
    (folder / "model.safetensors").rename(folder / "pytorch_model.bin")  # not a zip
    with pytest.raises(ModelLoadError, match="not a PyTorch zip checkpoint"):
        load(verifier_folder, drafter=folder)
    (folder / "pytorch_model.bin").unlink()
    with pytest.raises(ModelLoadError, match="needs its"):
        load(verifier_folder, drafter=folder)
    # the cascade refuses a head that follows only the committed path (trees: test_eagle3_trees.py)
    engine = load(verifier_folder, drafter=write_random(tmp_path / "ok"))
    with pytest.raises(Exception, match="eagle3"):
        engine.generate(PROMPT[:5], max_tokens=4, mode="cascade")


def test_a_checkpoint_pickle_that_would_run_code_is_refused(tmp_path):
    """pytorch_model.bin is read by an unpickler that knows only a state dict's globals."""
    import pickle
    import zipfile

    from edgespec.weights.formats.torch_pickle import read_torch_checkpoint

    class Evil:
        def __reduce__(self):
            import os

            return (os.system, ("echo never",))

    path = tmp_path / "pytorch_model.bin"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("archive/data.pkl", pickle.dumps({"fc.weight": Evil()}, protocol=2))
    with pytest.raises(ModelLoadError, match="system.*refused"):
        read_torch_checkpoint(path)


def test_the_authors_default_layers_and_the_verifiers_embedding(tmp_path):
    """A head naming no aux layers reads 2, L // 2 and L - 3 of an L-layer verifier."""
    from edgespec.drafters.eagle3 import Eagle3Drafter

    verifier = write_tiny_hf_folder(tmp_path / "v", seed=3, vocab_size=V, num_hidden_layers=8, tie_word_embeddings=False)
    folder = write_random(tmp_path / "head")
    cfg = json.loads((folder / "config.json").read_text())
    del cfg["eagle_aux_hidden_state_layer_ids"]
    (folder / "config.json").write_text(json.dumps(cfg))
    engine = load(verifier, drafter=folder)
    assert isinstance(engine.drafter, Eagle3Drafter)
    assert engine.drafter.layer_ids == [2, 4, 5] and engine.model.record_layers == (1, 3, 4)


def test_convert_stores_the_head_in_the_bundle(tmp_path):
    """`edgespec convert MODEL OUT --drafter HEAD`: the bundle's drafter/ loads as the folder does
    (same proposals), checked against the verifier before it is written."""
    from edgespec.converters.convert import convert

    from edgespec.drafters.eagle3 import Eagle3Drafter

    verifier = two_way_head(write_tiny_hf_folder(tmp_path / "v", seed=3, **VERIFIER))
    head = write_random(tmp_path / "head")
    convert(verifier, tmp_path / "bundle", quantize="none", dtype="float32", progress=False, drafter=head,
            drafter_options={"coreml": False})
    manifest = json.loads((tmp_path / "bundle" / "manifest.json").read_text())
    assert manifest["drafter"]["kind"] == "eagle3"
    runs = []
    for src, kw in ((verifier, {"drafter": head}), (tmp_path / "bundle", {})):
        engine = load(src, **kw)
        assert isinstance(engine.drafter, Eagle3Drafter)
        spec = engine.generate(PROMPT[:9], max_tokens=20, mode="speculative", draft_tokens=4)
        assert spec.tokens == engine.generate(PROMPT[:9], max_tokens=20, mode="plain").tokens
        runs.append(spec.stats.accepted_by_position)
    assert runs[0] == runs[1]
    with pytest.raises(ModelLoadError, match="hidden size"):
        convert(verifier, tmp_path / "b2", quantize="none", dtype="float32", progress=False,
                drafter=write_random(tmp_path / "small", E=32), drafter_options={"coreml": False})


def test_the_catalog_names_the_published_heads(tmp_path, monkeypatch):
    """Names only: nothing is fetched. A catalog of your own comes first."""
    from edgespec.hub.pairing import eagle3_heads

    monkeypatch.setenv("EDGESPEC_HOME", str(tmp_path / "es"))
    assert eagle3_heads("Qwen/Qwen3-8B") == ["RedHatAI/Qwen3-8B-speculator.eagle3", "Tengyunw/qwen3_8b_eagle3"]
    assert eagle3_heads("meta-llama/Llama-3.1-8B-Instruct")[0] == "RedHatAI/Llama-3.1-8B-Instruct-speculator.eagle3"
    assert eagle3_heads("Qwen/Qwen3-8B-Base") == [] and eagle3_heads("HuggingFaceTB/SmolLM2-360M") == []
    (tmp_path / "es").mkdir()
    (tmp_path / "es" / "hub_drafters.json").write_text(json.dumps({
        "format": "edgespec-drafter-pairs", "version": 1, "pairs": [],
        "eagle3": [{"family": "mine", "match": "Qwen/Qwen3-8B", "heads": ["me/my-head"]}]}))
    assert eagle3_heads("Qwen/Qwen3-8B")[0] == "me/my-head"


# ---------------------------------------------------------------- exact drafting


def check_greedy_exact(engine, monkeypatch, prompts, max_tokens=30):
    refs = [engine.generate(p, max_tokens=max_tokens, mode="plain").tokens for p in prompts]
    calls = count_drafts(engine.drafter, monkeypatch)
    drafted = accepted = 0
    by_pos = None
    for p, ref in zip(prompts, refs, strict=True):
        spec = engine.generate(p, max_tokens=max_tokens, mode="speculative", draft_tokens=5)
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


def tiny_qwen3_folder(folder, seed: int = 3):
    """A random Qwen3 (q/k norms) verifier folder of VERIFIER's shape."""
    from conftest import make_tiny_tokenizer
    from edgespec.models.qwen3 import Model, ModelArgs
    from mlx.utils import tree_flatten

    cfg = dict(model_type="qwen3", hidden_size=E, num_hidden_layers=4, intermediate_size=128, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, vocab_size=V, rms_norm_eps=1e-6, rope_theta=10000.0,
               tie_word_embeddings=False, max_position_embeddings=512)
    mx.random.seed(seed)
    model = Model(ModelArgs.from_dict(cfg))
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(model.parameters())))
    make_tiny_tokenizer(V).save(folder)
    return folder


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_speculative_and_auto_equal_plain(tmp_path, monkeypatch, kind):
    make = tiny_qwen3_folder if kind == "qwen3" else \
        (lambda f: write_tiny_hf_folder(f, seed=3, **VERIFIER))
    verifier = two_way_head(make(tmp_path / "v"))
    engine = load(verifier, drafter=write_random(tmp_path / "head", kind=kind, layers=1 if kind == "llama" else 2))
    check_greedy_exact(engine, monkeypatch, [PROMPT[:9], PROMPT[3:20], PROMPT[:2]])


def test_in_metals_numerics_the_head_computes_in_float16_and_stays_exact(tmp_path, monkeypatch):
    """numerics="metal": the head loads in the verifier's float16, its products as Metal's."""
    verifier = two_way_head(write_tiny_hf_folder(tmp_path / "v", seed=3, **VERIFIER))
    engine = load(verifier, drafter=write_random(tmp_path / "head"), numerics="metal")
    assert engine.drafter.model.fc.weight.dtype == mx.float16
    check_greedy_exact(engine, monkeypatch, [PROMPT[:9], PROMPT[3:20]], max_tokens=20)


def test_speculative_and_auto_equal_plain_on_a_hybrid_verifier(tmp_path, monkeypatch):
    from test_mtp import mtp_checkpoint

    folder = tmp_path / "qwen3_5"
    folder.mkdir()
    mtp_checkpoint(folder, vocab=V, mtp=False)
    two_way_head(folder)
    engine = load(folder, drafter=write_random(tmp_path / "head", E=48, head_dim=12, layer_ids=(1, 3, 4)))
    check_greedy_exact(engine, monkeypatch, [PROMPT[:9], PROMPT[3:20]], max_tokens=20)


def test_the_heads_own_confidence_and_runner_ups(tmp_path, monkeypatch):
    """DrafterCaps.ranks: each drafted token first with the head's probability, then its next
    guesses (inside the draft vocabulary); a floor stops the chain where the head is unsure; auto
    branching on them (runner_ups, draft_floor) still equals plain."""
    from edgespec.logits.sampling import Sampler, SamplingParams

    verifier = two_way_head(write_tiny_hf_folder(tmp_path / "v", seed=3, **VERIFIER))
    targets = (5, 9, 1, 2, 17, 30)
    engine = load(verifier, drafter=write_random(tmp_path / "head", targets=targets))
    d, _ = recorded_states(engine, PROMPT[:10])
    d.begin(PROMPT[:10])
    greedy = Sampler(SamplingParams(temperature=0.0))
    draft = d.draft(4, greedy, ranks=3)
    ids, probs = draft.ranked
    assert ids.shape == (4, 3) and list(ids[:, 0]) == draft.tokens and set(ids.ravel()) <= set(targets)
    assert (probs[:, 1] >= probs[:, 2]).all() and ((probs > 0) & (probs <= 1)).all()
    assert (probs[:, 0] >= probs[:, 1]).all()  # greedy: the drafted token is the head's likeliest
    d.sync(PROMPT[:10])
    assert len(d.draft(4, greedy, ranks=3, floor=0.999).tokens) < 4
    calls = count_drafts(engine.drafter, monkeypatch)
    for p in (PROMPT[:9], PROMPT[3:20]):
        ref = engine.generate(p, max_tokens=24, mode="plain").tokens
        assert engine.generate(p, max_tokens=24, runner_ups=2, draft_floor=0.3).tokens == ref
    assert calls


def test_four_requests_at_once_draft_with_forks_of_their_own(verifier_folder, tmp_path, monkeypatch):
    engine = load(two_way_head(write_tiny_hf_folder(tmp_path / "v", seed=3, **VERIFIER)),
                  drafter=write_random(tmp_path / "head"))
    prompts = [PROMPT[i : i + 8] for i in range(4)]
    refs = [engine.generate(p, max_tokens=24, mode="plain").tokens for p in prompts]
    calls = count_drafts(engine.drafter, monkeypatch)
    got = run_at_once(lambda i: engine.generate(prompts[i], max_tokens=24, mode="speculative", draft_tokens=5))
    assert [g.tokens for g in got] == refs
    assert sum(g.stats.accepted for g in got) > 0  # the forks found their verifier states
    calls.clear()
    got = run_at_once(lambda i: engine.generate(prompts[i], max_tokens=24))  # auto (drafts as the batch prices)
    assert [g.tokens for g in got] == refs
    assert calls


def test_sampled_output_follows_the_verifiers_law(tmp_path):
    """Chi-square of 3-token continuations of speculative sampling with a head drafting among 5 of
    8 tokens (q has no mass on the other 3) against the law enumerated from plain decoding; and
    seeded sampling in auto equals plain's."""
    from edgespec.logits.sampling import SamplingParams
    from edgespec.modes.speculative import SpeculativeMode
    from edgespec.options import GenerateOptions

    verifier = write_tiny_hf_folder(tmp_path / "v", seed=4, vocab_size=8, num_hidden_layers=3)
    engine = load(verifier, drafter=write_random(tmp_path / "d", targets=(0, 2, 3, 5, 6), vocab=8,
                                                 layer_ids=(1, 2, 3)))
    prompt, params = [1, 5, 2, 7], dict(temperature=1.0)
    law = continuation_law(engine.model, prompt, SamplingParams(**params), 3)
    keys = list(law)
    mode = SpeculativeMode(engine.model, engine.drafter, GenerateOptions(draft_tokens=3))
    counts, accepted = continuation_counts(mode, prompt, params, keys, 300, 3)
    assert accepted > 0
    pv = chisq_pvalue(counts, np.array([law[k] for k in keys]))
    assert pv > 1e-3, f"speculative samples with an EAGLE-3 head differ from plain's law (p-value {pv:.2g})"
    wrong = np.array([law[k] for k in keys]) ** 0.5
    assert chisq_pvalue(counts, wrong / wrong.sum()) < 1e-3
    for seed in (1, 2):
        kw = dict(max_tokens=16, temperature=0.8, seed=seed)
        assert engine.generate(prompt, mode="auto", **kw).tokens == engine.generate(prompt, mode="plain", **kw).tokens
