"""First use as fast as plain (issue #34): `auto` measures nothing before its first token, learns
pass and draft costs from the rounds it runs, and persists them per (model, device, machine)
under $EDGESPEC_HOME/calibration so the next process starts warm (edgespec.calibration)."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
from conftest import PacedClock, PacedModel, make_tiny_model, make_tiny_tokenizer, random_prompts

import edgespec.calibration as cal
import edgespec.controller
import edgespec.tree.controller
from edgespec import sealed
from edgespec.adaptive.estimate import Costs
from edgespec.adaptive.policy import TimedPolicy
from edgespec.controller import CostModel, KController
from edgespec.drafters.base import ModelDrafter
from edgespec.engine import Engine
from edgespec.weights.loader import LoadedModel


class TinyDrafter(ModelDrafter):
    name = "tiny"


def _forbidden(*a, **k):
    raise AssertionError("an explicit calibration ran")


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A fresh $EDGESPEC_HOME with persisted calibration on; explicit calibration forbidden."""
    monkeypatch.setenv("EDGESPEC_HOME", str(tmp_path))
    monkeypatch.setenv("EDGESPEC_CALIBRATION", "on")
    monkeypatch.setattr(edgespec.tree.controller, "calibrate_tree", _forbidden)
    monkeypatch.setattr(edgespec.controller, "calibrate", _forbidden)
    return tmp_path


def engine_for(seed: int = 0, digest: str = "ab", paced: float | None = 0.003, drafter: bool = True) -> Engine:
    """A tiny engine with a model identity (a bundle manifest's weight hash), so its costs persist."""
    model = make_tiny_model(seed, scale=3.0)
    clock = PacedClock()  # paced: auto's prices are the pacing's, whatever the host's load
    m = PacedModel(model, paced, clock) if paced else model
    loaded = LoadedModel(m, make_tiny_tokenizer(model.args.vocab_size), None,
                         {"files": {"model.safetensors": {"size": 1, "sha256": digest * 32}}})
    engine = Engine(loaded, history="off")
    if paced:
        engine.policy = TimedPolicy(clock=clock)
    if drafter:
        dm = make_tiny_model(5, scale=3.0, num_hidden_layers=1)
        engine.drafter = TinyDrafter(PacedModel(dm, paced / 10, clock) if paced else dm)
    return engine


def files(home):
    return sorted((home / "calibration").glob("*.json")) if (home / "calibration").is_dir() else []


# ---------------------------------------------------------------- nothing measured up front
@pytest.mark.parametrize("mode", ["auto", "speculative", "tree", "prompt_lookup", "cascade"])
def test_a_fresh_engine_runs_no_explicit_calibration(home, mode):
    """calibrate_tree and controller.calibrate raise: every mode that prices passes decodes anyway,
    and its output is plain decoding's."""
    engine = engine_for()
    prompt = [5, 6, 7, 8] * 5
    ref = engine.generate(prompt, max_tokens=20, mode="plain").tokens
    first = next(iter(engine.stream(prompt, max_tokens=20, mode=mode)))
    assert first.tokens == ref[: len(first.tokens)]
    assert engine.generate(prompt, max_tokens=20, mode=mode).tokens == ref


def test_the_first_auto_request_starts_from_the_prior_and_learns_from_its_rounds(home):
    engine = engine_for(paced=0.004)
    engine.generate([5, 6, 7, 8] * 5, max_tokens=24)  # repetitive: trees as well as plain steps
    costs = cal.cost_store(engine).costs
    assert costs.measured(1)  # plain steps are T = 1
    assert any(T > 1 for T in costs.seen), costs.seen  # tree rounds fill their own sizes
    # The batcher prices steps on the curve as learnt (a new object when it moved).
    curve = engine.memory.tree_costs
    assert curve.verify(1) == pytest.approx(costs.verify(1), rel=cal.PUBLISH_CHANGE + 1e-9)


# ---------------------------------------------------------------- persisted, and read back
def test_learnt_costs_are_persisted_and_a_new_engine_starts_from_them(home):
    engine = engine_for()
    engine.generate([5, 6, 7, 8] * 5, max_tokens=24)
    (path,) = files(home)
    data = json.loads(path.read_text())
    learnt = cal.cost_store(engine).costs
    quiet = learnt.quiet()  # what is persisted: quiet prices (the plain step's low expectile)
    assert data["verify"] == {str(T): pytest.approx(quiet[T]) for T in quiet}
    assert set(quiet) == set(learnt.seen) - learnt.contended and quiet[1] == learnt.plain_floor
    assert data["key"]["model"]["model"] == {"weights": {"model.safetensors": "ab" * 32}}
    assert data["key"]["machine"]["device"] and data["key"]["machine"]["machine"]
    assert not list(path.parent.glob(".*tmp*"))  # written atomically, no temp left

    again = engine_for()  # a new engine (a new process, as far as the store knows)
    store = cal.cost_store(again)
    assert store.warm and not store.costs.seen  # nothing measured yet by this engine
    for T, v in data["verify"].items():
        assert store.costs.verify(int(T)) == pytest.approx(v)
    # Its drafter's cost is known too, when the first engine drafted.
    if data["draft"]:
        assert store.draft(again.drafter).per_token == pytest.approx(next(iter(data["draft"].values())))
    # Written again after this engine's request: merged, the file still reads as this key's.
    again.generate([9, 10, 11] * 6, max_tokens=24)
    cal.cost_store(again).save()
    assert json.loads(path.read_text())["key"] == data["key"]


def test_nothing_is_written_when_off_or_for_a_model_built_in_memory(home, monkeypatch):
    engine_for(drafter=False).generate([5, 6, 7, 8] * 5, max_tokens=16, mode="auto")
    assert len(files(home)) == 1
    # Built in memory: no manifest, no path -> learnt in memory only.
    mem = engine_for(digest="cd", drafter=False)
    mem.loaded.manifest = {}
    mem.generate([5, 6, 7, 8] * 5, max_tokens=16)
    assert cal.cost_store(mem).path is None and len(files(home)) == 1
    monkeypatch.setenv("EDGESPEC_CALIBRATION", "off")
    off = engine_for(digest="ef", drafter=False)
    off.generate([5, 6, 7, 8] * 5, max_tokens=16)
    cal._save_all()
    assert cal.cost_store(off).path is None and len(files(home)) == 1


# ---------------------------------------------------------------- damaged and foreign files
def _path_of(engine) -> object:
    return cal.key_path(cal.cost_key(engine.loaded))


_VALID = {"format": cal.FORMAT, "key": {}, "verify": {"1": 0.5}, "counts": {"1": 3}, "draft": {}}


@pytest.mark.parametrize("content", ["{not json", json.dumps({"format": cal.FORMAT, "key": {}, "verify": {"1": -3}}),
                                     json.dumps([1, 2]), "\udcff",
                                     # one price edited after it was written: its checksum no longer matches
                                     json.dumps({**sealed.seal(_VALID), "verify": {"1": 1e-9}})])
def test_a_damaged_file_is_ignored_with_a_warning_and_kept_aside(home, caplog, content):
    engine = engine_for()
    path = _path_of(engine)
    path.parent.mkdir(parents=True)
    path.write_text(content, errors="surrogateescape")
    with caplog.at_level(logging.WARNING, logger="edgespec.calibration"):
        store = cal.cost_store(engine)
    assert not store.warm
    assert "ignoring the calibration file" in caplog.text and path.name in caplog.text
    aside = path.with_name(path.name + ".corrupt")
    assert aside.read_text(errors="surrogateescape") == content  # never lost
    ref = engine.generate([5, 6, 7, 8] * 5, max_tokens=16, mode="plain").tokens
    assert engine.generate([5, 6, 7, 8] * 5, max_tokens=16).tokens == ref
    assert json.loads(path.read_text())["verify"]  # a fresh file in its place


def test_a_file_for_another_key_is_left_alone(home, caplog):
    engine = engine_for()
    path = _path_of(engine)
    path.parent.mkdir(parents=True)
    foreign = json.dumps(sealed.seal({"format": cal.FORMAT, "key": {"someone": "else"}, "verify": {"1": 0.5},
                                      "counts": {}, "draft": {}}))
    path.write_text(foreign)
    with caplog.at_level(logging.WARNING, logger="edgespec.calibration"):
        engine.generate([5, 6, 7, 8] * 5, max_tokens=16)
    assert "another model, device or machine" in caplog.text
    assert path.read_text() == foreign  # not written over
    assert cal.cost_store(engine).path is None  # learnt in memory only


def test_a_failed_write_is_a_warning(home, caplog, monkeypatch):
    engine = engine_for(drafter=False)

    def full(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(cal.tempfile, "mkstemp", full)
    with caplog.at_level(logging.WARNING, logger="edgespec.calibration"):
        r = engine.generate([5, 6, 7, 8] * 5, max_tokens=16)
    assert len(r.tokens) == 16 and "could not write the calibration file" in caplog.text
    assert files(home) == []


# ---------------------------------------------------------------- keys
def test_different_models_devices_and_machines_do_not_collide(home, monkeypatch):
    a, b = engine_for(digest="ab"), engine_for(digest="cd")
    pa, pb = _path_of(a), _path_of(b)
    assert pa != pb and pa.parent == pb.parent == home / "calibration"
    real = cal.machine_identity()
    for field, other in [("device", "Device(gpu, 0)"), ("machine", "arm64"), ("cpu", "another CPU"),
                         ("preload", ["libopenblas.so.0"]), ("cpus", 64), ("kernels", real["kernels"] + 1)]:
        monkeypatch.setattr(cal, "machine_identity", lambda f=field, o=other: {**real, f: o})
        assert _path_of(a) != pa, field
    monkeypatch.setattr(cal, "machine_identity", lambda: real)
    assert _path_of(a) == pa  # stable
    # A preloaded library rebuilt under the same name (another BLAS kernel) is another machine
    lib = home / "libedgespec_cblas.so"
    lib.write_bytes(b"one kernel")
    first = cal.preloaded_libraries(str(lib))
    lib.write_bytes(b"another kernel")
    cal.preloaded_libraries.cache_clear()
    assert cal.preloaded_libraries(str(lib)) != first and first[0].startswith("libedgespec_cblas.so:")
    # A model read from a file (no weight hashes): its name, size and modification time.
    model = make_tiny_model(0)
    f = home / "m.gguf"
    f.write_bytes(b"GGUF" + bytes(10))
    loaded = LoadedModel(model, make_tiny_tokenizer(), f, {"source": {"format": "gguf", "name": "m.gguf"}})
    key = cal.cost_key(loaded)
    assert key["model"]["model"]["files"]["m.gguf"][0] == 14 and cal.key_path(key).name.startswith("m.gguf-")
    f.write_bytes(b"GGUF" + bytes(20))
    assert cal.key_path(cal.cost_key(loaded)) != cal.key_path(key)


# ---------------------------------------------------------------- lossless, cold and warm
def test_greedy_auto_equals_plain_from_a_cold_and_a_warm_calibration(home):
    prompts = random_prompts(8, seed=7)
    cold = engine_for(seed=1)
    refs = [cold.generate(p, max_tokens=24, mode="plain").tokens for p in prompts]
    assert [cold.generate(p, max_tokens=24).tokens for p in prompts] == refs
    cal.cost_store(cold).save()
    warm = engine_for(seed=1)
    assert cal.cost_store(warm).warm
    assert [warm.generate(p, max_tokens=24).tokens for p in prompts] == refs


# ---------------------------------------------------------------- the learnt curve
def test_one_measured_step_puts_the_prior_in_seconds_and_used_sizes_take_their_own():
    prior = Costs(list(cal.SIZES), cal.prior_curve(cal.SIZES, "cpu"))
    shape = [prior.verify(T) / prior.verify(1) for T in (1, 4, 16, 64)]
    prior.observe(1, 0.2)
    assert [prior.verify(T) / 0.2 for T in (1, 4, 16, 64)] == pytest.approx(shape)
    true = {T: 0.2 * (1 + 0.03 * (T - 1)) for T in cal.SIZES}  # flatter than the prior
    for T in (4, 16):
        prior.observe(T, true[T])
    assert prior.verify(4) == pytest.approx(true[4]) and prior.verify(16) == pytest.approx(true[16])
    # Between measured sizes: the prior's shape scaled by the interpolated ratio, close to the truth.
    assert prior.verify(8) == pytest.approx(true[8], rel=0.05)
    # Converges to what a calibration would measure at every size that is used.
    for _ in range(30):
        for T in cal.SIZES:
            prior.observe(T, true[T])
    assert [prior.verify(T) for T in cal.SIZES] == pytest.approx([true[T] for T in cal.SIZES])


def test_a_persisted_point_is_averaged_with_the_first_new_measurement():
    c = Costs([1, 64], [0.1, 0.4], anchored={1, 64})
    c.observe(1, 0.3)  # one slow step (a busy moment) moves it, does not replace it
    assert c.verify(1) == pytest.approx(0.7 * 0.1 + 0.3 * 0.3)
    assert c.verify(64) == pytest.approx(0.4 * c.verify(1) / 0.1)  # unmeasured: scaled alike


def test_a_prior_controller_takes_the_scale_of_its_first_step():
    prior = CostModel([0.05 * (1 + 0.08 * k) for k in range(9)], 0.025, measured=False)
    ctl = KController(prior, prior_alpha=0.5)
    ctl.record_plain(0.2)  # this machine is 4x the prior
    assert ctl.plain_s == pytest.approx(0.2)
    assert ctl.round_cost(3) == pytest.approx(4.0 * (prior.verify_s[3] + 3 * prior.draft_s))
    measured = KController(CostModel([0.05] * 9, 0.01), prior_alpha=0.5)
    measured.record_plain(0.2)
    assert measured.plain_s == pytest.approx(0.8 * 0.05 + 0.2 * 0.2)  # measured costs: an average, as before


def test_draft_cost_is_learnt_from_drafting_calls():
    d = cal.DraftCost()
    assert d.value(0.1) == pytest.approx(cal.DRAFT_PRIOR * 0.1)
    d.observe(4, 0.04)
    assert d.value(0.1) == pytest.approx(0.01) and d.fresh
    d.observe(2, 0.0)  # nothing timed: ignored
    assert d.per_token == pytest.approx(0.01)
    assert np.isfinite(d.value(0.1))


def test_a_slow_reader_does_not_make_plain_steps_look_free(home):
    """Pipelined plain steps: when the caller holds each token longer than a step takes (a
    server waiting for its reader), the next step is done before it is asked for; such waits
    are not step costs and are not learnt (they once put T = 1 at 0.1 ms)."""
    import time

    from edgespec.adaptive.history import HistoryStore
    from edgespec.engine import make_options
    from edgespec.generate import GenerationStats
    from edgespec.logits.sampling import Sampler, SamplingParams
    from edgespec.modes import make_mode

    engine = engine_for(paced=None, drafter=False)
    engine.history = HistoryStore()  # empty: the only source, silent, so every step is plain
    costs = cal.cost_store(engine).costs
    samples = []
    learn = costs.observe
    costs.observe = lambda T, s: (samples.append((T, s)), learn(T, s))
    steps = make_mode("adaptive", engine, make_options(mode="adaptive", sources="history")).steps(
        list(range(1, 30)), Sampler(SamplingParams()), GenerationStats())
    next(steps)  # the prefill's token
    for _ in range(12):
        next(steps)
        time.sleep(0.03)  # the reader: far slower than a step of this tiny model
    steps.close()
    plain = [s for T, s in samples if T == 1]
    # The run's first step (queued, then waited for) is learnt; after it only a step the
    # decoder really waited for (this machine busy), whose interval holds the reader's time too.
    assert plain and all(s >= 0.03 for s in plain[1:]) and len(plain) < 12, plain


@pytest.mark.parametrize("probe,busy,probed", [(True, False, True), (False, False, False), (True, True, False)])
def test_sizes_the_prior_prices_too_high_are_probed(home, monkeypatch, probe, busy, probed):
    """A prior far steeper than the device (30% of a step per extra token, where passes of this
    paced model cost the same whatever their width): trees stay small when priced by it, and the
    occasional probe (every PROBE_EVERY-th tree round verifies all its candidates, once per
    unmeasured size) measures a large size, so the curve stops overpricing them. Not while
    the cores are busy (`Costs.busy`): such a round would not teach the quiet curve."""
    import edgespec.adaptive.decoder as dec
    from edgespec.adaptive.estimate import Costs

    monkeypatch.setitem(cal.PRIOR_SLOPE, "cpu", 0.3)
    monkeypatch.setitem(cal.PRIOR_SLOPE, "gpu", 0.3)
    if not probe:
        monkeypatch.setattr(dec, "PROBE_EVERY", 10**9)
    if busy:
        monkeypatch.setattr(Costs, "busy", lambda self: True)
    engine = engine_for(paced=0.004, drafter=False)
    prompt = [5, 6, 7, 8, 9, 10] * 6
    ref = engine.generate(prompt, max_tokens=40, mode="plain").tokens
    for _ in range(4):
        assert engine.generate(prompt, max_tokens=40).tokens == ref
    seen = cal.cost_store(engine).costs.seen
    assert (max(seen) > 8) == probed, sorted(seen)


def test_a_drafter_is_priced_by_its_share_of_the_weights_until_timed(home):
    """Before a drafting call is timed, a drafted token costs DRAFT_PRIOR_FACTOR x the drafter's
    share of the verifier's weight bytes of a plain step (0.05..1); unknown share: DRAFT_PRIOR."""
    engine = engine_for()
    store = cal.cost_store(engine)
    share = cal.weight_bytes(engine.drafter.model) / cal.weight_bytes(engine.model)
    d = store.draft(engine.drafter)
    assert store.verifier_bytes > 0 and d.prior == pytest.approx(min(max(cal.DRAFT_PRIOR_FACTOR * share, 0.05), 1))
    assert d.value(0.2) == pytest.approx(d.prior * 0.2)

    class Weightless:
        name = "weightless"

    assert store.draft(Weightless()).prior == cal.DRAFT_PRIOR
    d.observe(3, 0.03)  # timed: the measurement, not the prior
    assert d.value(0.2) == pytest.approx(0.01)
