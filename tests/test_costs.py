"""Cost profiles, the roofline model's calibration against published figures, and the simulated
clock: deterministic, exact, and what `edgespec bench --profile` reports (tiny random models)."""

from __future__ import annotations

import json

import pytest
from conftest import make_tiny_engine, random_prompts

from edgespec.benchmark import build_report, parse_mode_specs, parse_prompts, run_benchmark
from edgespec.benchmark.format import format_markdown, format_table
from edgespec.costs import clock as sim_clock
from edgespec.costs.model import CALIBRATION, SHAPES, RooflineCosts, calibration_table
from edgespec.costs.profiles import PROFILES, SOURCES, get
from edgespec.engine import make_options
from edgespec.modes import available_modes


# ---------------------------------------------------------------- profiles and model
def test_every_profile_number_has_a_source_and_the_chip_classes_are_there():
    for name in ("m1", "m1-pro", "m1-max", "m2", "m2-pro", "m2-max", "m3", "m3-pro", "m3-max",
                 "m4", "m4-pro", "m4-max", "m5"):
        p = PROFILES[name]
        assert p.sources and all(k in SOURCES for k in p.sources)
        assert any(k.startswith("apple-") for k in p.sources)  # a public spec behind the bandwidth
        assert p.bandwidth_gbs > 0 and p.gpu_tflops > 0 and p.ane_tops > 0
    assert get(" M4_Pro ") is PROFILES["m4-pro"]
    with pytest.raises(ValueError, match="known: m1"):
        get("m9")


def test_calibration_against_published_llama_cpp_figures_stays_within_each_rows_bound():
    table = calibration_table()
    assert len(table) == len(CALIBRATION) >= 20
    assert {r["profile"] for r in table} >= {"m1", "m1-max", "m3", "m3-max", "m2-ultra"}
    assert {r["test"][:2] for r in table} == {"tg", "pp"}
    for r in table:
        assert abs(r["error"]) <= r["bound"], r
    # and on the whole: the mean error is well inside the bound
    assert sum(abs(r["error"]) for r in table) / len(table) < 0.15


def test_roofline_shapes_decode_memory_bound_prefill_compute_bound_context_costs():
    m = RooflineCosts("m4-pro", SHAPES["qwen3-4b"], "q4_0")
    one, four = m.verify(1, 256), m.verify(4, 256)
    assert four < 1.05 * one  # a few positions cost what one does on a GPU (memory-bound)
    assert m.verify(64, 256) > 3 * one  # many cost flops
    assert m.verify(1, 2048) > 1.2 * m.verify(1, 200)  # the context enters the price
    assert m.prefill(1024) > 1.9 * m.prefill(512)
    faster = RooflineCosts("m4-max", SHAPES["qwen3-4b"], "q4_0")
    assert faster.verify(1, 256) < one
    assert RooflineCosts("m4-pro", SHAPES["qwen3-4b"], "f16").verify(1, 256) > 2 * one
    small = SHAPES["smollm2-135m"]
    for device in ("gpu", "ane", "cpu"):
        assert 0 < m.draft_step(small, "q4_0", device) < one
    assert m.draft_step(small, "q4_0", "gpu", unseen=20) >= m.draft_step(small, "q4_0", "gpu")
    assert m.concurrent(one, 0.5 * one, 1e8) > one
    with pytest.raises(ValueError, match="unknown weight format"):
        RooflineCosts("m4", SHAPES["qwen3-4b"], "q3")


# ---------------------------------------------------------------- the simulated clock
def _auto_run(spec="m4-pro", shape="qwen3-4b"):
    engine = make_tiny_engine(seed=0)
    out = []
    with sim_clock.simulate(engine, spec, verifier_shape=shape) as sim:
        assert sim_clock.default_clock() is sim.clock
        for p in random_prompts(3, seed=1):
            sim.prompt_len = len(p * 3)
            res = engine.generate(p * 3, options=make_options(max_tokens=30, mode="auto"))
            out.append((list(res.tokens), sim.clock.snapshot()))
    assert sim_clock.active() is None
    return engine, out


def test_simulated_runs_are_deterministic_exact_and_leave_the_engine_as_it_was():
    engine, a = _auto_run()
    _, b = _auto_run()
    assert a == b  # the same run: the same tokens and the same simulated seconds
    t, prefill, _, passes = a[-1][1]
    assert t > prefill > 0 and passes > 0
    plain = make_tiny_engine(seed=0)
    for p, (tokens, _) in zip(random_prompts(3, seed=1), a, strict=True):
        assert list(plain.generate(p * 3, options=make_options(max_tokens=30, mode="plain")).tokens) == tokens
    # restored: the model's own class, the host's timer, the host's (unset) cost store
    assert type(engine.model).__name__ == "Model" and engine.memory.cost_store is None
    _, other = _auto_run("m1")
    assert other[-1][1][0] > a[-1][1][0]  # a slower chip, more simulated seconds


def test_profile_spec_and_env_are_checked():
    assert sim_clock.parse("m1-max:F16")[1] == "f16"
    with pytest.raises(ValueError, match="unknown weight format"):
        sim_clock.parse("m1:q3")
    with pytest.raises(ValueError, match="unknown cost profile"):
        sim_clock.parse("m7")


def _bench(profile):
    engine = make_tiny_engine(scale=3.0)
    prompts = parse_prompts("\n".join(json.dumps(r) for r in (
        {"prompt": "hello world hello world", "domain": "code"}, {"prompt": "the cat the cat", "domain": "chat"})))
    specs = parse_mode_specs("auto,speculative:drafter=prompt_lookup", available_modes())
    run = run_benchmark(engine, prompts, specs, max_tokens=12, repeats=1, warmup=0, chat=False,
                        profile=profile, verifier_shape="qwen3-1.7b")
    return build_report(run, {"model": "tiny"})


def test_bench_with_a_profile_reports_simulated_speed_identically_twice():
    a, b = _bench("m4-pro"), _bench("m4-pro")
    for lab in a["results"]:
        for dom, m in a["results"][lab].items():
            assert m["sim_tokens_per_s"] > 0 and m["sim_tokens_per_s"] == b["results"][lab][dom]["sim_tokens_per_s"]
            assert m["tokens_per_pass"] > 0
    assert a["results"]["plain"]["all"]["sim_speedup"] == pytest.approx(1.0)
    assert a["results"]["plain"]["all"]["draft_calls_per_token"] == 0
    spec = a["results"]["speculative:drafter=prompt_lookup"]["all"]
    assert spec["draft_calls_per_token"] > 0 and spec["sim_draft_s"] == 0  # a weight-free drafter
    assert a["status"]["auto"] == "ok" and a["status"]["speculative:drafter=prompt_lookup"] == "ok"
    text = format_table(a) + format_markdown(a)
    assert "sim tok/s" in text and "calls/tok" in text and "m4-pro" in text


def test_bench_without_a_profile_still_reports_transferable_counts():
    r = _bench(None)
    m = r["results"]["speculative:drafter=prompt_lookup"]["all"]
    assert "sim_tokens_per_s" not in m and m["draft_calls_per_token"] > 0
    assert "sim tok/s" not in format_table(r) and "calls/tok" in format_table(r)


def test_cli_profile_list_and_bad_profile(capsys, monkeypatch):
    import edgespec.apps.common as common

    from edgespec.cli import main

    def no_load(*a, **k):
        raise AssertionError("the model must not load")

    monkeypatch.setattr(common, "load_engine", no_load)
    assert main(["bench", "--profile", "list"]) == 0
    out = capsys.readouterr().out
    assert "m4-pro" in out and "apple-m4-pro-max" in out and "guess:launch" in out
    rc = main(["bench", "--profile", "m9", "--quiet"])
    err = capsys.readouterr().err
    assert rc != 0 and "unknown cost profile 'm9'" in err and "Traceback" not in err
    monkeypatch.setenv("EDGESPEC_COST_PROFILE", "m4-pro:q9")
    rc = main(["bench", "--quiet"])
    assert rc != 0 and "unknown weight format" in capsys.readouterr().err


def test_metal_priors_table_names_real_constants_and_the_roofline_values():
    from pathlib import Path

    from edgespec.costs.priors import METAL_PRIORS, metal_priors

    root = Path(__file__).resolve().parents[1]
    for name, (where, cpu, metal) in METAL_PRIORS.items():
        text = (root / where).read_text()
        const = name.split("[")[0].split(" (")[0].split(" ")[0]
        assert const in text, (name, where)
        assert cpu and metal
    v = metal_priors()
    assert 0 < v["plain_step_s"] < 0.05 and 0 <= v["slope"] < 0.08 and 0 < v["draft_share"] < 1
    assert v["batch8"] < 1.4  # on the GPU a pass of 8 costs about one (the CPU measured 1.4x)


# ---------------------------------------------------------------- the host's curve and the context
def test_measured_curve_learns_the_price_of_the_context_from_plain_steps():
    from edgespec.adaptive.estimate import Costs

    c = Costs([1, 8, 16], [0.05, 0.07, 0.09], ctx_share=1.0)
    assert c.ctx_term(8, 2000) == 0.0  # nothing learnt yet: priced as before
    for L in (100, 400, 1600, 2000, 150, 1900) * 3:  # plain steps: 40 ms + 10 us a position
        c.context = L
        c.observe(1, 0.040 + 1e-5 * L)
    assert c.ctx_s == pytest.approx(1e-5, rel=0.05)
    short, long = c.verify_at(8, 200), c.verify_at(8, 2000)
    assert long - short == pytest.approx(1e-5 * 1800 * 8, rel=0.05)  # attention over L for 8 positions
    c.context = 2000
    assert c.verify(1) == pytest.approx(0.060, rel=0.05) and c.verify(8) == pytest.approx(long)
    c.context = None
    assert c.verify(1) == pytest.approx(0.040, rel=0.05)  # the curve itself: at an empty context
    # a size timed at a long context teaches the curve its empty-context price
    c.context = 2000
    c.observe(8, long * 1.0)
    assert c.verify_at(8, 0) == pytest.approx(long - 1e-5 * 2000 * 8, rel=0.1)


def test_the_context_price_persists_under_a_new_format(tmp_path):
    import edgespec.calibration as cal

    assert cal.FORMAT == 4
    key = {"k": 1}
    store = cal.CostStore(key, tmp_path / "c.json", kind="cpu")
    for L in (100, 2000) * 10:
        store.costs.context = L
        store.costs.observe(1, 0.04 + 2e-5 * L)
    assert store.save()
    data = __import__("json").loads((tmp_path / "c.json").read_text())
    assert data["format"] == 4 and data["ctx_s"] == pytest.approx(2e-5, rel=0.05)
    again = cal.CostStore(key, tmp_path / "c.json", kind="cpu")
    assert again.costs.ctx_s == pytest.approx(2e-5, rel=0.05) and again.costs.ctx_share == 1.0


def test_the_cost_profile_in_the_environment_prices_a_loaded_engine(tmp_path, monkeypatch):
    """$EDGESPEC_COST_PROFILE: the engine edgespec.load makes decides on the profile's clock (its
    passes advance the simulation), output unchanged; a bad name is refused before any load."""
    from conftest import write_tiny_hf_folder

    import edgespec
    from edgespec.costs import clock as sim_clock
    from edgespec.errors import ModelLoadError

    folder = write_tiny_hf_folder(tmp_path / "m", seed=0)
    monkeypatch.setenv("EDGESPEC_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("EDGESPEC_COST_PROFILE", "m9")
    with pytest.raises(ModelLoadError, match="EDGESPEC_COST_PROFILE.*unknown cost profile 'm9'"):
        edgespec.load(str(folder), progress=False)
    monkeypatch.delenv("EDGESPEC_COST_PROFILE")
    plain = edgespec.load(str(folder), progress=False)
    assert plain.simulation is None
    want = plain.generate([5, 6, 7, 8] * 4, max_tokens=12, mode="auto").tokens
    monkeypatch.setenv("EDGESPEC_COST_PROFILE", "m4-pro")
    engine = edgespec.load(str(folder), progress=False)
    sim = engine.simulation
    try:
        assert sim is not None and sim_clock.active() is sim and sim.profile.name == "m4-pro"
        got = engine.generate([5, 6, 7, 8] * 4, max_tokens=12, mode="auto").tokens
        assert got == want and sim.clock.passes > 0 and sim.clock.t > 0
    finally:
        sim.detach()  # this test's process goes on with the host's timer
    assert sim_clock.active() is None
