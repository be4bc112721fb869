"""Packaging: one `edgespec` distribution, top-level folders inside it, a light runtime import."""

import os
import subprocess
import sys
import zipfile
from pathlib import Path

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
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), str(REPO)],
        check=True,
        capture_output=True,
    )
    wheel = next(tmp_path.glob("edgespec-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert {"models", "converters", "apps", "tests"}.isdisjoint(tops)
    for must in ("edgespec/models/llama.py", "edgespec/converters/gguf.py", "edgespec/apps/chat.py", "edgespec/cli.py"):
        assert must in names
    entry = [n for n in names if n.endswith("entry_points.txt")]
    assert entry and "edgespec = edgespec.cli:main" in zipfile.ZipFile(wheel).read(entry[0]).decode()
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    env = {**os.environ, "PYTHONPATH": str(site)}
    code = "import edgespec.models.llama as m, edgespec.cli as c; print(m.__file__); c.main(['--help'])"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(str(site))  # the installed copy, not the source tree
    for sub in ("chat", "generate", "convert"):
        assert sub in r.stdout
