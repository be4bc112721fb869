"""`edgespec doctor`: its --json object (keys and types) on a tiny bundle without the probe, its
argument check before any loading, the kernel table it lists, and (real model) a short probe."""

from __future__ import annotations

import json

import pytest
from conftest import write_tiny_bundle

from edgespec import cli
from edgespec.kernels import METAL_KERNELS, delta, exact, experts, kv, tree, verdicts
from edgespec.kernels.verdicts import Verdict


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGESPEC_HOME", str(tmp_path / "home"))
    verdicts.forget()
    yield tmp_path / "home"
    verdicts.forget()


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    return write_tiny_bundle(tmp_path_factory.mktemp("doctor") / "tiny")


def doctor(capsys, *args) -> tuple[int, str, str]:
    code = cli.main(["doctor", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_json_has_every_key_with_its_type(home, bundle, capsys):
    verdicts.put(Verdict("cpu_blas_few_rows", "k64", "slower", "library 1.0 ms, shim 1.2 ms"))
    code, out, _ = doctor(capsys, "--model", str(bundle), "--no-probe", "--json")
    assert code == 0
    r = json.loads(out)
    assert {"device", "versions", "kernels", "auto_drafter", "coreml", "probe"} <= set(r)
    assert isinstance(r["device"]["default"], str) and isinstance(r["device"]["metal_available"], bool)
    assert r["versions"]["mlx"] and r["versions"]["python"] and r["versions"]["os"]
    assert set(METAL_KERNELS) <= set(r["kernels"])
    assert all(r["kernels"][k] == "emulated" for k in METAL_KERNELS)  # no Metal here: said so
    assert "C++ emulator" in r["kernel_notes"]["edgespec_kv_gather"] and "float16" in r["kernel_notes"][
        "edgespec_kv_gather"]
    assert r["kernels"]["cpu_blas_few_rows/k64"] == "slower"  # a CPU kernel's kept verdict is shown
    a = r["auto_drafter"]
    assert a["name"] is None or isinstance(a["name"], str)
    assert isinstance(a["passed_over"], dict) and all(isinstance(v, str) and "\n" not in v
                                                      for v in a["passed_over"].values())
    assert a["name"] not in a["passed_over"] and "bundle" in {a["name"], *a["passed_over"]}
    assert isinstance(r["coreml"]["coremltools_installed"], bool) and r["coreml"]["compute_units_choices"]
    assert r["probe"] is None and r["mac_tests"] is None


def test_text_report_names_each_part(home, bundle, capsys):
    code, out, _ = doctor(capsys, "--model", str(bundle), "--no-probe")
    assert code == 0
    for word in ("device", "versions", "kernels", "edgespec_tree_accept", "auto ", "coreml", "probe      skipped"):
        assert word in out


@pytest.mark.parametrize("seconds", ["0", "-1", "nan"])
def test_a_bad_probe_time_is_one_line_before_loading(home, capsys, seconds):
    code, out, err = doctor(capsys, "--model", "/nonexistent/model", "--probe-seconds", seconds)
    assert code == 1 and out == ""
    assert err.count("\n") == 1 and "--probe-seconds" in err  # not the missing model: checked first


def test_the_kernel_table_names_the_kernels_the_dispatchers_check():
    names = {s.name for s in (tree.TREE_MASK, tree.TREE_ACCEPT, kv.KV_GATHER, exact.EXACT_LINEAR,
                              exact.EXACT_ATTENTION, experts.EXPERT_GATE_UP, experts.EXPERT_GATE_UP_Q)}
    assert names | {"edgespec_gated_delta_"} == set(METAL_KERNELS)
    assert delta.delta_spec(128).name.startswith("edgespec_gated_delta_")


@pytest.mark.real_model
def test_probe_on_the_default_model(capsys):
    code, out, _ = doctor(capsys, "--probe-seconds", "1", "--json")
    p = json.loads(out)["probe"]
    assert code == 0 and p["same_output"] is True
    for mode in ("plain", "auto"):
        assert p[mode]["tokens"] > 0 and p[mode]["tokens_per_s"] > 0 and p[mode]["tokens_per_pass"] >= 1
    assert p["speedup"] > 0


def test_full_runs_the_mac_only_tests_and_reports_their_summary(monkeypatch):
    import subprocess

    from edgespec.apps import doctor as app

    seen = []

    def fake_run(cmd, **kw):
        seen.append(cmd)
        return subprocess.CompletedProcess(cmd, 1, stdout="...\n2 failed, 10 passed, 8 skipped in 3.1s\n", stderr="")

    monkeypatch.setattr(subprocess, "run", fake_run)
    r = app.mac_tests()
    assert seen and seen[0][-3:-1] == ["-m", "macos or metal"] and seen[0][-1].endswith("tests")
    assert r == {"ran": True, "command": r["command"], "exit_code": 1, "summary": "2 failed, 10 passed, 8 skipped in 3.1s"}
    assert "'macos or metal'" in r["command"]
