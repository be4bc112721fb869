"""Writers never delete what edgespec did not write (issue #34).

`--force` may replace an existing OUT only when it is something edgespec wrote (a bundle,
a distilled drafter folder, a Core ML package it exported) or an empty folder; the home
folder, `/`, a folder holding the home or the working folder, a folder with foreign files,
a plain file and a symbolic link are refused before any work starts, with a message naming
what is there. Written folders get the user's normal permissions (0777/0666 less the umask).

Every destination here lives under pytest's tmp_path; HOME is pointed at a temp folder.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import edgespec.converters.convert as conv
import pytest
from conftest import make_tiny_model, write_tiny_bundle, write_tiny_hf_folder
from edgespec.converters.convert import add_drafter, convert

from edgespec.cli import main

CONVERT_OPTS = dict(quantize="none", dtype="float32", progress=False)


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    """A tiny Hugging Face folder, outside every test's tmp_path (no overlap with OUT)."""
    return write_tiny_hf_folder(tmp_path_factory.mktemp("write-safety-src") / "hf", seed=0)


@pytest.fixture
def no_work(monkeypatch):
    """Fail the test if convert starts reading its source: refusals must come first."""
    monkeypatch.setattr(conv, "_read_source", lambda *a, **k: pytest.fail("the conversion work started"))


def _snapshot(folder: Path) -> dict[str, bytes | None]:
    """Every entry under `folder` (files with their bytes, folders as None)."""
    return {str(p.relative_to(folder)): (p.read_bytes() if p.is_file() else None) for p in sorted(folder.rglob("*"))}


def _cli_convert(src, out, *extra):
    return ["convert", str(src), str(out), "--quantize", "none", "--dtype", "float32", "--quiet", *extra]


def _temps(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if ".tmp-" in p.name or ".old-" in p.name)


@pytest.fixture
def fake_home(tmp_path, monkeypatch) -> Path:
    home = tmp_path / "home" / "user"
    (home / ".config").mkdir(parents=True)
    (home / ".bashrc").write_text("export PATH=$PATH\n")
    (home / ".config" / "settings.ini").write_text("[a]\nb = 1\n")
    (home / "Documents").mkdir()
    (home / "Documents" / "thesis.txt").write_text("years of work")
    monkeypatch.setenv("HOME", str(home))
    assert Path.home() == home
    return home


# ---------------------------------------------------------------- convert: refusals


def test_force_into_a_folder_with_a_foreign_file_is_refused_api(src, tmp_path, no_work):
    out = tmp_path / "out"
    out.mkdir()
    (out / "data.txt").write_text("precious")
    with pytest.raises(FileExistsError, match=r"not an edgespec bundle.*data\.txt.*refusing to replace"):
        convert(src, out, force=True, **CONVERT_OPTS)
    assert (out / "data.txt").read_text() == "precious"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temp folder either


def test_force_into_a_folder_with_a_foreign_file_is_refused_cli(src, tmp_path, capsys):
    out = tmp_path / "out"
    (out / "notes").mkdir(parents=True)
    (out / "data.txt").write_text("precious")
    (out / "notes" / "a.md").write_text("more")
    for i in range(3):
        (out / f"f{i}.csv").write_text(str(i))
    assert main(_cli_convert(src, out, "--force")) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err  # one line
    assert "edgespec convert: error:" in err and "not an edgespec bundle" in err
    assert "data.txt" in err and "notes/" in err and "and 2 more" in err
    assert (out / "data.txt").read_text() == "precious" and (out / "notes" / "a.md").read_text() == "more"


def test_force_into_the_home_folder_is_refused_and_every_file_survives(src, fake_home, no_work):
    before = _snapshot(fake_home)
    with pytest.raises(FileExistsError, match="home folder"):
        convert(src, fake_home, force=True, **CONVERT_OPTS)
    assert _snapshot(fake_home) == before


def test_force_into_the_home_folder_is_refused_by_the_command(src, fake_home):
    """The real command in a fresh process, HOME set to the fake home: exit 1, one line, nothing touched."""
    before = _snapshot(fake_home)
    env = {**os.environ, "HOME": str(fake_home)}
    r = subprocess.run([sys.executable, "-m", "edgespec.cli", *_cli_convert(src, fake_home, "--force")],
                       capture_output=True, text=True, env=env, timeout=120)  # fmt: skip
    assert r.returncode == 1, r.stderr
    assert "home folder" in r.stderr and "Traceback" not in r.stderr
    assert _snapshot(fake_home) == before


def test_an_empty_home_folder_and_its_ancestors_are_refused(src, tmp_path, monkeypatch, no_work):
    home = tmp_path / "people" / "empty-home"
    home.mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    with pytest.raises(FileExistsError, match="home folder"):
        convert(src, home, force=True, **CONVERT_OPTS)
    with pytest.raises(FileExistsError, match="home folder"):
        convert(src, tmp_path / "people", force=True, **CONVERT_OPTS)  # holds the home folder
    assert home.is_dir() and not any(home.iterdir())


def test_a_folder_holding_the_working_folder_is_refused(src, tmp_path, monkeypatch, no_work):
    work = tmp_path / "project" / "sub"
    work.mkdir(parents=True)
    monkeypatch.chdir(work)
    for out in (tmp_path / "project", work, Path(".")):
        with pytest.raises(FileExistsError, match="working folder"):
            convert(src, out, force=True, **CONVERT_OPTS)
    assert work.is_dir()


def test_root_is_refused_before_any_work(src, no_work):
    with pytest.raises(FileExistsError, match="root folder"):
        convert(src, "/", force=True, **CONVERT_OPTS)


def test_a_plain_file_and_a_symlink_at_out_are_refused(src, tmp_path, no_work):
    f = tmp_path / "out.bin"
    f.write_bytes(b"user data")
    with pytest.raises(FileExistsError, match="is a file"):
        convert(src, f, force=True, **CONVERT_OPTS)
    assert f.read_bytes() == b"user data"
    target = tmp_path / "target"
    target.mkdir()
    (target / "keep.txt").write_text("keep")
    link = tmp_path / "link"
    link.symlink_to(target)
    with pytest.raises(FileExistsError, match="symbolic link"):
        convert(src, link, force=True, **CONVERT_OPTS)
    assert link.is_symlink() and (target / "keep.txt").read_text() == "keep"


def test_without_force_an_existing_out_is_still_refused(src, tmp_path, no_work):
    (tmp_path / "b").mkdir()
    with pytest.raises(FileExistsError, match="already exists.*--force"):
        convert(src, tmp_path / "b", **CONVERT_OPTS)


# ---------------------------------------------------------------- convert: what --force may replace


def test_force_replaces_an_existing_bundle(src, tmp_path):
    from edgespec.weights.bundle import read_manifest

    other = write_tiny_hf_folder(tmp_path / "other-src", seed=7)
    out = tmp_path / "b"
    convert(other, out, **CONVERT_OPTS)
    old = (out / "model.safetensors").read_bytes()
    assert main(_cli_convert(src, out, "--force")) == 0
    assert (out / "model.safetensors").read_bytes() != old
    read_manifest(out, verify_hashes=True)
    assert _temps(tmp_path) == []


def test_force_onto_an_empty_folder_works(src, tmp_path):
    out = tmp_path / "empty"
    out.mkdir()
    convert(src, out, force=True, **CONVERT_OPTS)
    assert (out / "manifest.json").is_file() and _temps(tmp_path) == []


def test_force_onto_a_bundle_with_a_foreign_file_is_refused(src, tmp_path, monkeypatch):
    out = write_tiny_bundle(tmp_path / "b")
    monkeypatch.setattr(conv, "_read_source", lambda *a, **k: pytest.fail("the conversion work started"))
    (out / "notes.txt").write_text("mine")
    (out / "extra").mkdir()
    before = _snapshot(out)
    with pytest.raises(FileExistsError, match=r"edgespec bundle but also holds.*(notes\.txt|extra/)"):
        convert(src, out, force=True, **CONVERT_OPTS)
    assert _snapshot(out) == before


def test_a_foreign_file_added_while_converting_is_noticed_at_the_swap(src, tmp_path, monkeypatch):
    """Checked again at the moment of replacing: a file dropped into OUT meanwhile is not deleted."""
    out = write_tiny_bundle(tmp_path / "b")
    real = conv.finish_manifest

    def meanwhile(*a, **k):
        (out / "notes.txt").write_text("written during the conversion")
        return real(*a, **k)

    monkeypatch.setattr(conv, "finish_manifest", meanwhile)
    with pytest.raises(FileExistsError, match=r"notes\.txt"):
        convert(src, out, force=True, **CONVERT_OPTS)
    assert (out / "notes.txt").read_text() == "written during the conversion"
    from edgespec.weights.bundle import read_manifest

    read_manifest(out, verify_hashes=True)  # the old bundle, whole
    assert _temps(tmp_path) == []


@pytest.mark.parametrize("when", ["writing", "swapping"])
def test_ctrl_c_keeps_the_old_bundle_and_leaves_no_temp(src, tmp_path, monkeypatch, when):
    import edgespec.safe_write as sw

    out = write_tiny_bundle(tmp_path / "b", seed=9)
    before = _snapshot(out)
    if when == "writing":
        monkeypatch.setattr(conv, "finish_manifest", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt))
    else:  # after the old bundle was renamed aside, before the new one is renamed into place
        real = os.replace

        def interrupted(a, b, *args, **kw):
            if Path(b) == out and ".tmp-" in str(a):
                raise KeyboardInterrupt
            return real(a, b, *args, **kw)

        monkeypatch.setattr(sw.os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        convert(src, out, force=True, **CONVERT_OPTS)
    monkeypatch.undo()
    assert _snapshot(out) == before and _temps(tmp_path) == []


def test_force_help_says_what_it_replaces(capsys):
    with pytest.raises(SystemExit):
        main(["convert", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "edgespec bundle" in help_text and "empty folder" in help_text


# ---------------------------------------------------------------- permissions


def _modes(folder: Path) -> tuple[set[int], set[int]]:
    dirs = {stat.S_IMODE(folder.stat().st_mode)}
    files = set()
    for p in folder.rglob("*"):
        (dirs if p.is_dir() else files).add(stat.S_IMODE(p.stat().st_mode))
    return dirs, files


@pytest.fixture
def umask():
    def set_umask(value):
        os.umask(value)

    old = os.umask(0o022)
    yield set_umask
    os.umask(old)


@pytest.mark.parametrize("mask, want", [(0o022, (0o755, 0o644)), (0o027, (0o750, 0o640))])
def test_bundle_modes_follow_the_umask(src, tmp_path, umask, mask, want):
    umask(mask)
    convert(src, tmp_path / "b", **CONVERT_OPTS)
    assert _modes(tmp_path / "b") == ({want[0]}, {want[1]})


def test_add_drafter_keeps_normal_modes_and_core_ml_package_too(tmp_path, umask):
    pytest.importorskip("coremltools")
    bundle = write_tiny_bundle(tmp_path / "plain")
    drafter = write_tiny_hf_folder(tmp_path / "d", seed=1, num_hidden_layers=1)
    add_drafter(bundle, drafter, progress=False, drafter_options={"context_length": 32, "prefill_chunk": 8})
    assert (bundle / "drafter.mlpackage").is_dir()
    assert _modes(bundle) == ({0o755}, {0o644})


# ---------------------------------------------------------------- add_drafter


def test_add_drafter_refuses_a_bundle_holding_foreign_files(tmp_path):
    bundle = write_tiny_bundle(tmp_path / "plain")
    (bundle / "my-notes.txt").write_text("mine")
    before = _snapshot(bundle)
    drafter = write_tiny_hf_folder(tmp_path / "d", seed=1, num_hidden_layers=1)
    with pytest.raises(FileExistsError, match=r"my-notes\.txt"):
        add_drafter(bundle, drafter, progress=False, drafter_options={"coreml": False})
    assert _snapshot(bundle) == before and _temps(tmp_path) == []


# ---------------------------------------------------------------- distill


def _distill_cfg():
    from edgespec.converters.distill.pipeline import DistillConfig
    from edgespec.converters.distill.train import TrainConfig

    return DistillConfig(layers=1, vocab=40, max_new=4, gen_batch=4, evaluate=False,
                         train=TrainConfig(steps=2, batch_size=2, checkpoint_every=2))  # fmt: skip


def _prompts(path: Path) -> Path:
    path.write_text("\n".join(json.dumps({"prompt": p, "domain": "chat"}) for p in ("abc", "hello", "xyz top")))
    return path


@pytest.fixture
def no_distill_work(monkeypatch):
    import edgespec.weights.loader

    monkeypatch.setattr(edgespec.weights.loader, "load", lambda *a, **k: pytest.fail("the distillation work started"))


def test_distill_force_into_a_foreign_folder_is_refused(tmp_path, no_distill_work):
    from edgespec.converters.distill.pipeline import distill

    out = tmp_path / "drafter"
    out.mkdir()
    (out / "data.txt").write_text("precious")
    with pytest.raises(FileExistsError, match=r"data\.txt"):
        distill(tmp_path / "verifier", out, _distill_cfg(), force=True)
    assert (out / "data.txt").read_text() == "precious"


def test_distill_force_into_the_home_folder_is_refused(tmp_path, fake_home, no_distill_work):
    from edgespec.converters.distill.pipeline import distill

    before = _snapshot(fake_home)
    with pytest.raises(FileExistsError, match="home folder"):
        distill(tmp_path / "verifier", fake_home, _distill_cfg(), force=True, work=tmp_path / "w")
    assert _snapshot(fake_home) == before


def test_distill_output_replaced_only_while_it_is_edgespecs(tmp_path, umask):
    from edgespec.converters.distill.pipeline import distill

    verifier = write_tiny_bundle(tmp_path / "verifier", seed=2, scale=3.0)
    out = tmp_path / "drafter"
    prompts = _prompts(tmp_path / "p.jsonl")
    distill(verifier, out, _distill_cfg(), prompts=prompts)
    assert _modes(out) == ({0o755}, {0o644})
    distill(verifier, out, _distill_cfg(), prompts=prompts, force=True, resume=True)  # its own output: replaced
    (out / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match=r"notes\.txt"):
        distill(verifier, out, _distill_cfg(), prompts=prompts, force=True, resume=True)
    assert (out / "notes.txt").read_text() == "mine" and (out / "distill.json").is_file()


# ---------------------------------------------------------------- Core ML export


def test_core_ml_export_refuses_foreign_destinations_before_building(tmp_path, fake_home, monkeypatch):
    pytest.importorskip("coremltools")
    from edgespec.converters import coreml_export

    monkeypatch.setattr(coreml_export, "build_function", lambda *a, **k: pytest.fail("the export work started"))
    out = tmp_path / "x.mlpackage"
    out.mkdir()
    (out / "data.txt").write_text("precious")
    with pytest.raises(FileExistsError, match="already exists"):
        coreml_export.export_drafter(make_tiny_model(), out)
    with pytest.raises(FileExistsError, match=r"data\.txt"):
        coreml_export.export_drafter(make_tiny_model(), out, force=True)
    before = _snapshot(fake_home)
    with pytest.raises(FileExistsError, match="home folder"):
        coreml_export.export_drafter(make_tiny_model(), fake_home, force=True)
    assert _snapshot(fake_home) == before and (out / "data.txt").read_text() == "precious"


def test_core_ml_package_modes_and_what_force_may_replace(tmp_path, umask):
    pytest.importorskip("coremltools")
    from edgespec.converters.coreml_export import export_drafter

    from edgespec.safe_write import replace_refusal

    out = tmp_path / "x.mlpackage"
    export_drafter(make_tiny_model(), out, context_length=32, prefill_chunk=8)
    assert _modes(out) == ({0o755}, {0o644})
    assert replace_refusal(out) is None  # a package edgespec exported: --force may replace it
    (out / "Data" / "stray.txt").write_text("x")
    assert "stray.txt" in replace_refusal(out)
    assert _temps(tmp_path) == []
