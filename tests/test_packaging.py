"""Packaging: one `edgespec` distribution, top-level folders inside it, a light runtime import."""

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_import_edgespec_does_not_pull_heavy_dependencies():
    code = (
        "import sys, edgespec, edgespec.engine, edgespec.cli; "
        "heavy = [m for m in ('torch', 'coremltools', 'transformers') if m in sys.modules]; "
        "print(','.join(heavy))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert r.stdout.strip() == ""


def test_wheel_maps_folders_into_the_package_and_runs(tmp_path):
    # Build from a clean copy: a stale build/ folder in the checkout would hide a package missing from pyproject.
    src = tmp_path / "src"
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(".venv", ".cache", ".git", "build", "*.egg-info",
                                                            "__pycache__", "bench-out"))
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), str(src)],
        check=True,
        capture_output=True,
    )
    wheel = next(tmp_path.glob("edgespec-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert {"models", "converters", "apps", "tests"}.isdisjoint(tops)
    for must in ("edgespec/models/llama.py", "edgespec/converters/gguf.py", "edgespec/apps/chat.py", "edgespec/cli.py",
                 "edgespec/data/drafters/smollm2-135m-instruct/model.safetensors",
                 "edgespec/data/drafters/smollm2-135m-instruct/corpus.bin", "edgespec/kernels/metal_emu.h",
                 "edgespec/data/calibration_answers.jsonl", "edgespec/data/calibration_answers_heldout.jsonl"):
        assert must in names
    # Every package of the source tree ships (a folder missing from pyproject's list would not).
    mapped = {"edgespec": "edgespec", "models": "edgespec/models", "converters": "edgespec/converters",
              "apps": "edgespec/apps"}
    for init in sorted(REPO.glob("*/**/__init__.py")):
        rel = init.relative_to(REPO).as_posix()
        top, rest = rel.split("/", 1)
        if top in mapped:
            assert f"{mapped[top]}/{rest}" in names, f"{rel} is not in the wheel (add its package to pyproject.toml)"
    entry = [n for n in names if n.endswith("entry_points.txt")]
    assert entry and "edgespec = edgespec.cli:main" in zipfile.ZipFile(wheel).read(entry[0]).decode()
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    env = {**os.environ, "PYTHONPATH": str(site)}
    code = ("import edgespec.models.llama as m, edgespec.cli as c, edgespec.modes as modes; print(m.__file__); "
            "assert {'plain', 'speculative', 'lookahead', 'tree', 'cascade'} <= set(modes.available_modes()); "
            "c.main(['--help'])")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(str(site))  # the installed copy, not the source tree
    for sub in ("chat", "generate", "convert"):
        assert sub in r.stdout


def test_the_cpu_build_of_torch_brings_no_nvidia_libraries():
    """`make` installs the CPU build of torch first where the machine's pip finds one, so the
    dev extras (accelerate) do not pull the CUDA build and ~3 GB of NVIDIA libraries (#34)."""
    from importlib import metadata

    try:
        version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        pytest.skip("torch is not installed in this environment")
    if "+cpu" not in version:
        pytest.skip(f"torch {version} is not a CPU build (none offered to pip here)")
    nvidia = sorted({d.metadata["Name"] for d in metadata.distributions()
                     if (d.metadata["Name"] or "").lower().startswith(("nvidia-", "triton"))})
    assert not nvidia, f"unused CUDA packages beside torch {version}: {nvidia}"
