"""Speculative decoding on tiny random models: greedy exactness, rollback, drafters, controller."""

from __future__ import annotations

import itertools
import json

import mlx.core as mx
import numpy as np
import pytest
from conftest import make_tiny_engine, make_tiny_model

from edgespec.controller import CostModel, KController, expected_tokens
from edgespec.drafters import attach_drafter
from edgespec.drafters.mlx_drafter import MLXDrafter
from edgespec.drafters.self_spec import SelfSpecDrafter, search_skip_layers
from edgespec.errors import DrafterRequiredError, VocabularyMismatchError
from edgespec.generate import GenerationStats, PlainMode, prefill
from edgespec.logits.sampling import Sampler, SamplingParams
from edgespec.modes.speculative import SpeculativeMode
from edgespec.options import GenerateOptions

PROMPTS = [[(7 * s + 3 * i + 1) % 63 + 1 for i in range(3 + s % 9)] for s in range(20)]
N_TOKENS = 10
CHAOTIC = dict(scale=3.0, tie_word_embeddings=False)  # diverse (non-repeating) greedy outputs


def run(mode, prompt, n=N_TOKENS, params=None):
    stats = GenerationStats()
    steps = mode.steps(prompt, Sampler(params or SamplingParams()), stats)
    out = [t.id for t in itertools.islice(steps, n)]
    steps.close()
    return out, stats


@pytest.fixture(scope="module")
def verifier():
    return make_tiny_model(0, num_hidden_layers=2, **CHAOTIC)


@pytest.fixture(scope="module")
def noisy_drafter():
    """The verifier's weights plus 2% noise: accepts ~2/3 of drafts, so rounds see
    full acceptance (bonus tokens) as well as rejections at every position."""
    from mlx.utils import tree_map

    d = make_tiny_model(0, num_hidden_layers=2, **CHAOTIC)
    mx.random.seed(9)
    d.update(tree_map(lambda p: p + 0.02 * mx.random.normal(p.shape) * mx.abs(p).mean() if p.ndim > 1 else p, d.parameters()))
    mx.eval(d.parameters())
    return MLXDrafter(d)


@pytest.fixture(scope="module")
def plain_outputs(verifier):
    return [run(PlainMode(verifier), p)[0] for p in PROMPTS]


def spec(verifier, drafter, k, pipeline):
    return SpeculativeMode(verifier, drafter, GenerateOptions(draft_tokens=k, mode_options={"pipeline": pipeline}))


@pytest.mark.parametrize("pipeline", [False, True])
def test_greedy_equals_plain_for_every_k(verifier, plain_outputs, noisy_drafter, pipeline):
    accepted = drafted = bonus_rounds = 0
    for k in range(1, 9):
        for prompt, ref in zip(PROMPTS, plain_outputs, strict=True):
            out, stats = run(spec(verifier, noisy_drafter, k, pipeline), prompt)
            assert out == ref, f"K={k} pipeline={pipeline} prompt={prompt}"
            accepted += stats.accepted
            drafted += stats.drafted
            bonus_rounds += stats.accepted_by_position[k - 1] if len(stats.accepted_by_position) >= k else 0
    assert 0 < accepted < drafted  # both accept and reject paths ran
    assert bonus_rounds > 0


@pytest.mark.parametrize("pipeline", [False, True])
def test_greedy_self_speculation_equals_plain(verifier, plain_outputs, pipeline):
    drafter = SelfSpecDrafter(verifier, [1])
    for k in (2, 5):
        for prompt, ref in list(zip(PROMPTS, plain_outputs, strict=True))[:6]:
            assert run(spec(verifier, drafter, k, pipeline), prompt)[0] == ref


def test_pipelining_hides_drafting_and_reports_it(verifier, noisy_drafter):
    _, stats = run(spec(verifier, noisy_drafter, 2, True), PROMPTS[0], n=30)
    assert stats.hidden_draft_s > 0
    assert stats.draft_s >= stats.hidden_draft_s
    _, stats = run(spec(verifier, noisy_drafter, 2, False), PROMPTS[0], n=30)
    assert stats.hidden_draft_s == 0


def test_seeded_sampling_reproducible(verifier, noisy_drafter):
    drafter = noisy_drafter
    params = SamplingParams(temperature=1.0, seed=3)
    a, _ = run(spec(verifier, drafter, 3, False), PROMPTS[1], params=params)
    b, _ = run(spec(verifier, drafter, 3, False), PROMPTS[1], params=params)
    c, _ = run(spec(verifier, drafter, 3, False), PROMPTS[1], params=SamplingParams(temperature=1.0, seed=4))
    assert a == b
    assert a != c


def _fresh_state(model, tokens, layer_ids=None):
    cache = model.make_cache()
    model(mx.array(tokens, dtype=mx.int32)[None], cache, layer_ids=layer_ids)
    return cache


def _assert_cache_equals(cache, fresh, layers):
    for i in layers:
        assert cache[i].offset == fresh[i].offset
        for a, b in zip(cache[i].state, fresh[i].state, strict=True):
            np.testing.assert_allclose(np.array(a), np.array(b), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("k,pipeline", [(1, False), (3, False), (8, False), (3, True), (6, True)])
def test_rollback_caches_equal_fresh_prefill(verifier, k, pipeline):
    """After every round, both caches hold exactly the committed sequence (minus its last token)."""
    keep = [1]
    drafter = SelfSpecDrafter(verifier, keep)
    mode = spec(verifier, drafter, k, pipeline)
    stats = GenerationStats()
    prompt = PROMPTS[3]
    steps = mode.steps(prompt, Sampler(SamplingParams(temperature=0.8, seed=1)), stats)
    seq = list(prompt)
    checked = 0
    for tok in itertools.islice(steps, 30):
        seq.append(tok.id)
        if tok.source != "verifier" or len(seq) == len(prompt) + 1:
            continue  # mid-round (accepted drafts) or the prefill token
        _assert_cache_equals(mode.cache, _fresh_state(verifier, seq[:-1]), range(2))
        if not pipeline:  # with pipelining the worker may already be drafting ahead
            assert drafter.seq == seq
            fed = drafter.fed
            assert fed == seq[: len(fed)]
            _assert_cache_equals(drafter.cache, _fresh_state(verifier, fed, keep), keep)
        checked += 1
    steps.close()
    assert checked >= 3
    assert stats.drafted > stats.accepted  # some rejections were rolled back


def test_drafter_sync_rolls_back_a_wrong_guess(verifier):
    keep = [1]
    d = SelfSpecDrafter(verifier, keep)
    prompt = PROMPTS[5]
    d.begin(prompt)
    greedy = Sampler(SamplingParams())
    toks = d.draft(4, greedy).tokens
    d.accept(4, 7)  # guess: everything kept, then 7
    d.draft(3, greedy)
    d.sync(prompt + toks[:1] + [9])  # reality: one kept, then 9
    after = d.draft(2, greedy).tokens
    ref = SelfSpecDrafter(verifier, keep)
    ref.begin(prompt + toks[:1] + [9])
    assert after == ref.draft(2, greedy).tokens


# ------------------------------------------------------------------ engine surface
def test_engine_speculative_mode_and_auto(tmp_path):
    engine = make_tiny_engine(0, num_hidden_layers=4)
    ref = engine.generate([1, 2, 3], max_tokens=16, mode="plain").tokens
    with pytest.raises(DrafterRequiredError, match="needs a drafter"):
        engine.generate([1, 2, 3], max_tokens=4, mode="speculative")
    for mode, opts in (("tree", {}), ("cascade", {}), ("adaptive", {"sources": "drafter"})):
        with pytest.raises(DrafterRequiredError):
            engine.generate([1, 2, 3], max_tokens=4, mode=mode, **opts)
    engine.drafter = SelfSpecDrafter(engine.model, [0, 1, 3])
    assert engine.resolve_mode(GenerateOptions()) == "adaptive"  # auto: the adaptive decoder, drafter included
    for k in ("auto", 2):
        res = engine.generate([1, 2, 3], max_tokens=16, mode="speculative", draft_tokens=k, pipeline=True)
        assert res.tokens == ref
        assert res.stats.mode == "speculative"
        assert res.stats.drafted > 0 or any("controller" in n for n in res.stats.notes)


def _save_model_folder(model, folder):
    folder.mkdir()
    model.save_weights(str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(model.args.to_dict()))


def test_mlx_drafter_load_checks_vocabulary(tmp_path):
    engine = make_tiny_engine(0)
    _save_model_folder(make_tiny_model(3, vocab_size=32), tmp_path / "small_vocab")
    with pytest.raises(VocabularyMismatchError, match="32"):
        attach_drafter(engine, tmp_path / "small_vocab")
    _save_model_folder(make_tiny_model(3, num_hidden_layers=1), tmp_path / "ok")
    d = attach_drafter(engine, tmp_path / "ok")
    assert isinstance(d, MLXDrafter) and engine.drafter is d
    assert attach_drafter(engine, "none") is None and engine.drafter is None
    with pytest.raises(ValueError, match="self, int8, prompt_lookup"):
        attach_drafter(engine, tmp_path / "missing")


def test_attach_self_searches_and_caches(tmp_path, monkeypatch):
    from edgespec.drafters import self_spec

    monkeypatch.setenv("EDGESPEC_HOME", str(tmp_path))
    monkeypatch.setattr(self_spec, "CALIBRATION_PROMPTS", ["abc def", "Hello there", "x = 1 + 2"])
    engine = make_tiny_engine(0, num_hidden_layers=4)
    engine.loaded.manifest = {"files": {"model.safetensors": {"sha256": "ab" * 32}}}
    d = attach_drafter(engine, "self")
    assert isinstance(d, SelfSpecDrafter) and 1 <= len(d.layer_ids) < 4
    cached = json.loads(next((tmp_path / "self_spec").glob("*.json")).read_text())
    assert cached["keep"] == d.layer_ids
    # A second attach reads the cache (a doctored entry, sealed again, proves it is used).
    from edgespec import sealed

    cached["keep"] = [0]
    next((tmp_path / "self_spec").glob("*.json")).write_text(json.dumps(sealed.seal(cached)))
    assert attach_drafter(engine, "self").layer_ids == [0]


def test_search_prefers_layers_that_matter():
    # Layer 1 is scaled up (dominates the output); layers 0, 2, 3 scaled down
    # (nearly no-ops): the search must keep layer 1 and drop the others first.
    model = make_tiny_model(0, num_hidden_layers=4, **CHAOTIC)
    for i, f in enumerate([0.05, 1.0, 0.05, 0.05]):
        lyr = model.layers[i]
        lyr.mlp.down_proj.weight = lyr.mlp.down_proj.weight * f
        lyr.self_attn.o_proj.weight = lyr.self_attn.o_proj.weight * f
    seqs = []
    for p in PROMPTS[:4]:
        cache = model.make_cache()
        logits = prefill(model, cache, p)
        s = list(p)
        for _ in range(12):
            t = int(mx.argmax(logits).item())
            s.append(t)
            logits = model(mx.array([[t]]), cache)[0, -1]
        seqs.append((s, len(p)))
    res = search_skip_layers(model, seqs=seqs, max_skip=3)
    assert {d for d, _ in res["path"]} == {0, 2, 3}
    assert res["path"][0][1] > 0.8


# ------------------------------------------------------------------ controller
def test_expected_tokens_formula():
    assert expected_tokens(0.0, 5) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert abs(expected_tokens(0.5, 2) - 1.75) < 1e-12


def test_controller_falls_back_to_plain_and_probes():
    costs = CostModel(verify_s=[0.01 * (1 + 0.05 * k) for k in range(9)], draft_s=0.02)
    ctl = KController(costs, prior_alpha=0.3)
    picks = []
    for _ in range(60):
        k = ctl.choose()
        picks.append(k)
        if k:
            ctl.record_round(k, 0, 0.05)
        else:
            ctl.record_plain(0.01)
    assert picks.count(0) >= 55  # mostly plain
    assert 1 <= sum(1 for k in picks if k) <= 3  # probes, with growing intervals


def test_controller_picks_long_drafts_when_cheap_and_accepted():
    costs = CostModel(verify_s=[0.01 * (1 + 0.05 * k) for k in range(9)], draft_s=0.0005)
    ctl = KController(costs, prior_alpha=0.5)
    for _ in range(30):
        k = ctl.choose()
        ctl.record_round(k, k, 0.01 * (1 + 0.05 * k) + k * 0.0005)  # everything accepted
    assert ctl.alpha > 0.9
    assert ctl.choose() >= 6


def test_controller_fallback_decodes_plainly_and_exactly(verifier, plain_outputs, noisy_drafter):
    # Drafting priced far above a verifier pass: the controller must fall back to
    # plain steps (with occasional probes) and still reproduce plain output.
    costs = CostModel(verify_s=[0.01] * 9, draft_s=1.0)
    mode = SpeculativeMode(verifier, noisy_drafter, GenerateOptions(), costs=costs, prior_alpha=0.1)
    out, stats = run(mode, PROMPTS[2], n=60)
    ref, _ = run(PlainMode(verifier), PROMPTS[2], n=60)
    assert out == ref
    assert any("controller" in n for n in stats.notes)
    assert 0 < stats.drafted < 20  # a few probe rounds only


def test_skip_set_search_shows_progress_once(tmp_path, monkeypatch, capsys):
    """The first self-speculation on a model searches its skip set with a progress bar on stderr;
    the cached result needs no search (and no bar) afterwards."""
    from edgespec.drafters import self_spec

    monkeypatch.setenv("EDGESPEC_HOME", str(tmp_path))
    engine = make_tiny_engine(0, num_hidden_layers=4)
    monkeypatch.setattr(self_spec, "model_key", lambda loaded: "ab" * 32)
    first = self_spec.skip_set_for(engine.loaded)
    assert "choosing layers to skip" in capsys.readouterr().err
    again = self_spec.skip_set_for(engine.loaded)
    assert again == json.loads(json.dumps(first)) and "choosing layers to skip" not in capsys.readouterr().err
    monkeypatch.setattr(self_spec, "model_key", lambda loaded: None)  # no cache: searches again, quietly
    self_spec.skip_set_for(engine.loaded, progress=False)
    assert "choosing layers to skip" not in capsys.readouterr().err


def test_a_gguf_read_in_place_has_a_skip_set_key(tmp_path):
    """A model read from a GGUF (no manifest: the default model as the runtime loads it) is
    keyed by the file's size and time with its shape, so its skip set is searched once, not
    at every load; another file, or the same one rewritten, is another key."""
    from dataclasses import replace

    from edgespec.drafters import self_spec

    loaded = make_tiny_engine(0, num_hidden_layers=4).loaded
    assert self_spec.model_key(loaded) is None  # built in memory: nothing to key it by
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF" + bytes(60))
    key = self_spec.model_key(replace(loaded, path=f))
    assert key is not None and key == self_spec.model_key(replace(loaded, path=f))
    f.write_bytes(b"GGUF" + bytes(61))
    assert self_spec.model_key(replace(loaded, path=f)) not in (None, key)
