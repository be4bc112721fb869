"""`edgespec bench`: prompt reader, mode specs, runner, equality check, report and CLI (tiny models)."""

from __future__ import annotations

import json

import pytest
from conftest import make_tiny_engine

from edgespec.benchmark import (
    build_report,
    load_prompts,
    parse_mode_specs,
    parse_prompts,
    run_benchmark,
)
from edgespec.benchmark.format import format_markdown, format_table, problems
from edgespec.benchmark.prompts import select_prompts
from edgespec.benchmark.runner import BenchRun, RunRecord
from edgespec.benchmark.specs import ModeSpec
from edgespec.generate import PlainMode, Token
from edgespec.modes import DESCRIPTIONS, MODES, available_modes


def jsonl(*rows) -> str:
    return "\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows)


# ---------------------------------------------------------------- prompt files
def test_reader_lists_every_malformed_line_by_number():
    text = jsonl(
        {"prompt": "fine", "domain": "code"},
        "{not json",
        '["a list"]',
        {"domain": "chat"},
        {"prompt": "x", "messages": [{"role": "user", "content": "y"}]},
        "",
        {"prompt": "x", "max_tokens": 0},
        {"promt": "typo"},
        {"messages": [{"role": "robot", "content": "hi"}]},
        {"prompt": "   "},
        {"prompt": "ok", "domain": "chat", "max_tokens": 5},
    )
    with pytest.raises(ValueError) as ei:
        parse_prompts(text, "mine.jsonl")
    msg = str(ei.value)
    assert "8 malformed line(s)" in msg
    for n in (2, 3, 4, 5, 7, 8, 9, 10):
        assert f"mine.jsonl:{n}:" in msg
    for n in (1, 6, 11):
        assert f"mine.jsonl:{n}:" not in msg
    assert "invalid JSON" in msg and "'promt'" in msg and "valid keys" in msg and "robot" in msg


def test_reader_accepts_prompts_and_messages(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text(
        jsonl(
            {"prompt": "a b", "domain": "code", "max_tokens": 7},
            "",
            {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]},
        )
    )
    ps = load_prompts(f)
    assert [p.domain for p in ps] == ["code", "default"]
    assert ps[0].max_tokens == 7 and ps[1].max_tokens is None
    assert ps[1].messages[1]["content"] == "u" and ps[1].prompt is None
    assert [p.line for p in ps] == [1, 3]
    with pytest.raises(ValueError, match="no prompts"):
        parse_prompts("\n\n")
    with pytest.raises(FileNotFoundError):
        load_prompts(tmp_path / "missing.jsonl")


def test_builtin_prompt_set_covers_four_domains():
    ps = load_prompts()
    counts = {}
    for p in ps:
        counts[p.domain] = counts.get(p.domain, 0) + 1
    assert set(counts) == {"code", "summarization", "chat", "translation"}
    assert all(6 <= n <= 10 for n in counts.values())
    assert len({p.id for p in ps}) == len(ps)
    two = select_prompts(ps, ["code", "chat"], per_domain=2)
    assert [p.domain for p in two] == ["code", "code", "chat", "chat"]
    with pytest.raises(ValueError, match="poetry"):
        select_prompts(ps, ["poetry"])


# ---------------------------------------------------------------- mode specs
def test_mode_specs_parse_settings_and_put_plain_first():
    specs = parse_mode_specs(
        "lookahead:window=5:ngram=3:adaptive=true,speculative:draft_tokens=4", ["plain", "lookahead"]
    )
    assert [s.label for s in specs] == [
        "plain",
        "lookahead:window=5:ngram=3:adaptive=true",
        "speculative:draft_tokens=4",
    ]
    assert specs[1].options == {"window": 5, "ngram": 3, "adaptive": True} and specs[1].draft_tokens == "auto"
    assert specs[2].draft_tokens == 4 and specs[2].options == {}
    assert [s.label for s in parse_mode_specs(None, ["plain", "lookahead"])] == ["plain", "lookahead"]
    for bad in ("speculative:draft_tokens=99", "lookahead:W", ":W=1", "plain,plain"):
        with pytest.raises(ValueError):
            parse_mode_specs(bad, ["plain"])


def test_mode_specs_are_checked_against_the_mode_schema_before_any_model_loads():
    """An unknown mode, an unknown option or a bad value fails while parsing the specs."""
    with pytest.raises(ValueError, match="unknown decoding mode 'x'"):
        parse_mode_specs("x,plain", ["plain"])
    with pytest.raises(ValueError, match="unknown option.*'W'.*lookahead.*valid: window"):
        parse_mode_specs("lookahead:W=5", ["plain"])
    with pytest.raises(ValueError, match="lookahead option 'window' must be an integer in 0..32"):
        parse_mode_specs("lookahead:window=99", ["plain"])
    with pytest.raises(ValueError, match="adaptive option 'sources'"):
        parse_mode_specs("adaptive:sources=context+nope", ["plain"])


# ---------------------------------------------------------------- test-only modes
class CorruptMode:
    """Plain decoding that changes its 4th token: what a buggy speculative mode looks like."""

    name = "corrupt"

    def __init__(self, model):
        self.inner = PlainMode(model)

    def steps(self, prompt, sampler, stats):
        for i, tok in enumerate(self.inner.steps(prompt, sampler, stats)):
            if i == 3:
                tok = Token(
                    1 + tok.id % 40, tok.logprob, tok.source
                )  # never EOS (0), always different
            yield tok


class DraftingPlain:
    """Plain output, but books 3 drafts per token with 2 accepted (fixed acceptance pattern)."""

    name = "drafting_plain"

    def __init__(self, model):
        self.inner = PlainMode(model)

    def steps(self, prompt, sampler, stats):
        for tok in self.inner.steps(prompt, sampler, stats):
            stats.record_draft(3, 2)
            yield tok


def _broken(engine, options):
    raise ValueError("needs a drafter; none is attached")


@pytest.fixture
def extra_modes(monkeypatch):
    """Register test-only modes; monkeypatch removes them after the test."""
    for name, factory in (
        ("corrupt", lambda e, o: CorruptMode(e.model)),
        ("drafting_plain", lambda e, o: DraftingPlain(e.model)),
        ("broken", _broken),
    ):
        monkeypatch.setitem(MODES, name, factory)
        monkeypatch.setitem(DESCRIPTIONS, name, "test only")


def tiny_prompts():
    return parse_prompts(
        jsonl(
            {"prompt": "hello world", "domain": "code"},
            {"prompt": "abc def", "domain": "code", "max_tokens": 6},
            {"prompt": "the cat", "domain": "chat"},
        )
    )


def test_report_has_every_mode_and_domain_and_flags_corrupted_mode(extra_modes):
    engine = make_tiny_engine(scale=3.0)
    # parse_mode_specs refuses unknown names; a spec built by hand reaches the runner's check.
    specs = parse_mode_specs("drafting_plain,corrupt,broken", available_modes()) + [ModeSpec("nosuch", "nosuch")]
    calls = []
    run = run_benchmark(
        engine,
        tiny_prompts(),
        specs,
        max_tokens=10,
        repeats=2,
        warmup=1,
        chat=False,
        on_progress=lambda n, d: calls.append(n),
    )
    report = build_report(run, {"model": "tiny"})
    labels = [m["label"] for m in report["modes"]]
    assert labels == ["plain", "drafting_plain", "corrupt", "broken", "nosuch"]
    assert report["domains"] == ["code", "chat"]
    for lab in ("plain", "drafting_plain", "corrupt"):
        assert set(report["results"][lab]) == {"all", "code", "chat"}
        assert report["results"][lab]["all"]["runs"] == 6
    # Progress covers every planned generation, including the ones skipped for broken modes.
    assert sum(calls) == 4 * (1 + 2 * 3)
    assert report["status"] == {
        "plain": "ok",
        "drafting_plain": "ok",
        "corrupt": "mismatch",
        "broken": "error",
        "nosuch": "unavailable",
    }
    assert "needs a drafter" in report["errors"]["broken"]
    # Every corrupted generation is listed (3 prompts x 2 repeats), at token 3; nothing else.
    mm = report["equality"]["mismatches"]
    assert {m["label"] for m in mm} == {"corrupt"} and len(mm) == 6
    assert all(m["position"] == 3 and m["expected"] != m["got"] for m in mm)
    assert report["equality"]["comparisons"] == 18
    assert report["recommendation"]["label"] != "corrupt"
    # The tiny generations keep their per-prompt max_tokens.
    assert report["results"]["plain"]["code"]["generated_tokens"] <= 16
    # Acceptance: every round drafts 3 and keeps 2 -> rates 1, 1, 0 by position.
    curve = report["acceptance_by_position"]["drafting_plain"]["all"]
    assert [c["rate"] for c in curve] == [1.0, 1.0, 0.0]
    assert report["results"]["drafting_plain"]["all"]["acceptance_rate"] == pytest.approx(2 / 3)
    text = format_table(report) + "\n".join(problems(report)) + format_markdown(report)
    for lab in labels:
        assert lab in text
    assert "BUG: corrupt differs from plain" in text
    json.dumps(report)  # JSON-ready


def _record(label, prompt, domain, repeat, tokens, decode_s):
    stats = dict(
        generated_tokens=len(tokens),
        decode_s=decode_s,
        verifier_passes=len(tokens),
        peak_memory_bytes=0,
    )
    return RunRecord(label, prompt, domain, repeat, tokens, "length", decode_s, stats)


def test_speedup_and_recommendation_from_known_timings():
    prompts = tiny_prompts()[:2]
    specs = [
        ModeSpec("plain", "plain"),
        ModeSpec("fast", "fast", options={"window": 3, "adaptive": False}),
        ModeSpec("faster_but_wrong", "fw"),
    ]
    run = BenchRun(specs, prompts, dict(max_tokens=4, repeats=2, warmup=0, temperature=0.0))
    for r in range(2):
        for i in range(2):
            run.records.append(_record("plain", i, "code", r, [1, 2, 3, 4], 1.0))
            run.records.append(_record("fast", i, "code", r, [1, 2, 3, 4], 0.5))
            run.records.append(_record("faster_but_wrong", i, "code", r, [1, 2, 9, 4], 0.25))
    from edgespec.benchmark.runner import check_equality

    check_equality(run, greedy=True)
    report = build_report(run)
    assert report["results"]["fast"]["all"]["speedup"] == pytest.approx(2.0)
    assert report["results"]["faster_but_wrong"]["all"]["speedup"] == pytest.approx(4.0)
    rec = report["recommendation"]
    assert rec["label"] == "fast"
    assert rec["cli"] == "--mode fast --mode-option window=3 --mode-option adaptive=false"
    # With no correct mode beating plain, plain is recommended.
    run.records = [r for r in run.records if r.label != "fast"]
    assert build_report(run)["recommendation"]["label"] == "plain"


def test_sampling_skips_equality_check():
    engine = make_tiny_engine()
    specs = parse_mode_specs("plain", available_modes())
    run = run_benchmark(
        engine,
        tiny_prompts()[:1],
        specs,
        max_tokens=4,
        warmup=0,
        temperature=1.0,
        seed=1,
        chat=False,
    )
    assert run.equality["checked"] is False and not run.mismatches


def test_per_spec_drafter_is_attached_for_that_spec_only():
    if "speculative" not in available_modes():
        pytest.skip("the speculative mode is not part of this build")
    engine = make_tiny_engine(scale=3.0)
    assert engine.drafter is None
    specs = parse_mode_specs(
        "speculative:drafter=prompt_lookup:draft_tokens=3,speculative", available_modes()
    )
    run = run_benchmark(engine, tiny_prompts(), specs, max_tokens=10, warmup=0, chat=False)
    report = build_report(run)
    assert report["status"]["speculative:drafter=prompt_lookup:draft_tokens=3"] == "ok"
    assert report["modes"][1]["settings"] == {"draft_tokens": 3, "drafter": "prompt_lookup"}
    assert report["status"]["speculative"] == "error"  # no drafter on the engine itself
    assert engine.drafter is None  # restored
    assert not report["equality"]["mismatches"]


def test_interrupted_run_still_reports_what_finished(monkeypatch):
    calls = []

    def interrupting(engine, options):
        calls.append(1)
        if len(calls) == 3:  # warm-up, prompt 1, then Ctrl-C during prompt 2
            raise KeyboardInterrupt
        return PlainMode(engine.model)

    monkeypatch.setitem(MODES, "interrupting", interrupting)
    engine = make_tiny_engine()
    specs = parse_mode_specs("interrupting", available_modes())
    run = run_benchmark(
        engine, tiny_prompts(), specs, max_tokens=4, repeats=1, warmup=1, chat=False
    )
    assert run.settings["interrupted"] is True
    assert {r.prompt_index for r in run.records if r.label == "interrupting"} == {0}
    report = build_report(run)
    assert report["results"]["interrupting"]["all"]["prompts"] == 1
    assert report["results"]["interrupting"]["all"]["speedup"] is not None
    assert "Interrupted" in format_markdown(report)


# ---------------------------------------------------------------- CLI
def test_cli_writes_report_and_exits_nonzero_on_mismatch(extra_modes, tmp_path, monkeypatch, capsys):
    import edgespec.apps.common as common

    from edgespec.cli import main

    monkeypatch.setattr(
        common, "load_engine", lambda args, progress=True: make_tiny_engine(scale=3.0)
    )
    pf = tmp_path / "p.jsonl"
    pf.write_text(
        jsonl({"prompt": "hello", "domain": "code"}, {"prompt": "world", "domain": "chat"})
    )
    out = tmp_path / "out"
    base = [
        "bench",
        "--prompts",
        str(pf),
        "--max-tokens",
        "8",
        "--repeats",
        "1",
        "--warmup",
        "0",
        "--raw",
        "--quiet",
    ]
    rc = main(base + ["--modes", "plain,corrupt", "--out", str(out)])
    cap = capsys.readouterr()
    assert rc == 3
    assert "BUG: corrupt differs from plain" in cap.err
    for f in ("report.json", "report.md", "speedup.png", "acceptance.png"):
        assert (out / f).stat().st_size > 0
    report = json.loads((out / "report.json").read_text())
    assert report["status"]["corrupt"] == "mismatch"
    assert "--modes plain,corrupt" in report["meta"]["command"]
    # An unknown mode fails before the model loads; a correct set runs, exit 0.
    rc = main(
        base + ["--modes", "drafting_plain,nosuch", "--out", str(tmp_path / "ok"), "--no-plots"]
    )
    cap = capsys.readouterr()
    assert rc == 1 and "unknown decoding mode 'nosuch'" in cap.err
    rc = main(base + ["--modes", "drafting_plain", "--out", str(tmp_path / "ok"), "--no-plots"])
    cap = capsys.readouterr()
    assert rc == 0 and "all identical" in cap.out
    # Malformed prompt files fail before any model is loaded, naming the line.
    pf.write_text(jsonl({"prompt": "ok"}, {"prompt": 3}))
    assert main(base + ["--out", str(tmp_path / "bad")]) == 1
    assert ":2:" in capsys.readouterr().err


@pytest.mark.real_model
def test_bench_real_model_chat_prompts(real_engine):
    """The bench drives the real model through its chat template; a weight-free mode matches plain.

    Kept to one short prompt: multi-token verifier passes are slow on a CPU without OpenBLAS.
    """
    prompts = select_prompts(load_prompts(), ["translation"], per_domain=1)
    modes = "plain,prompt_lookup" if "prompt_lookup" in available_modes() else "plain"
    run = run_benchmark(
        real_engine, prompts, parse_mode_specs(modes, available_modes()), max_tokens=8, warmup=0
    )
    report = build_report(run)
    assert not report["equality"]["mismatches"], problems(report)
    assert not report["errors"], report["errors"]
    assert report["results"]["plain"]["all"]["generated_tokens"] == 8
    assert report["prompts"][0]["domain"] == "translation"


def test_under_a_profile_the_recommendation_follows_the_simulated_clock():
    """--profile: the mode that pays on the profile's machine is recommended, whatever the host's
    wall time said (here the host found it slower than plain)."""
    prompts = tiny_prompts()[:2]
    specs = [ModeSpec("plain", "plain"), ModeSpec("wide", "wide")]
    run = BenchRun(specs, prompts, dict(max_tokens=4, repeats=1, warmup=0, temperature=0.0, profile="m4-pro"))
    for i in range(2):
        for label, wall, sim_s in (("plain", 1.0, 0.04), ("wide", 2.0, 0.02)):
            rec = _record(label, i, "code", 0, [1, 2, 3, 4], wall)
            rec.sim = dict(sim_s=sim_s + 0.01, sim_prefill_s=0.01, sim_draft_s=0.0, sim_passes=4)
            run.records.append(rec)
    from edgespec.benchmark.runner import check_equality

    check_equality(run, greedy=True)
    report = build_report(run)
    wide = report["results"]["wide"]["all"]
    assert wide["speedup"] == pytest.approx(0.5) and wide["sim_speedup"] == pytest.approx(2.0)
    rec = report["recommendation"]
    assert rec["label"] == "wide" and rec["speedup"] == pytest.approx(2.0)
    assert "simulated clock of m4-pro" in rec["reason"]
    run.settings.pop("profile")  # the host's wall time: plain
    assert build_report(run)["recommendation"]["label"] == "plain"
