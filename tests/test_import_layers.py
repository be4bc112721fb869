"""The import layers of pyproject.toml ([tool.importlinter]) hold, and no module imports itself
back round a circle (imports inside functions counted): `lint-imports` (import-linter) and
grimp's graph, over the installed package layout (models/, converters/, apps/ are
edgespec.models, edgespec.converters, edgespec.apps: mirrored under one folder so the
static analysis sees them where Python does). Static analysis only: nothing is imported."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# The folders setuptools maps into the edgespec package (pyproject.toml [tool.setuptools]).
PACKAGE_DIRS = {"edgespec": "edgespec", "models": "edgespec/models", "converters": "edgespec/converters",
                "apps": "edgespec/apps"}


def mirror(dest: Path) -> Path:
    """A folder holding the package as Python sees it installed (links to the sources)."""
    for src, pkg in PACKAGE_DIRS.items():
        for path in (REPO / src).rglob("*.py"):
            rel = path.relative_to(REPO / src)
            if "swift" in rel.parts:
                continue
            target = dest / pkg / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            os.symlink(path, target)
    shutil.copy(REPO / "pyproject.toml", dest / "pyproject.toml")
    return dest


def run_in(folder: Path, code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(folder)}
    return subprocess.run([sys.executable, "-c", code], cwd=folder, env=env, capture_output=True, text=True,
                          timeout=300)


def test_lint_imports_layers_hold(tmp_path):
    folder = mirror(tmp_path)
    r = run_in(folder, "import sys; from importlinter.cli import lint_imports; "
                       "sys.exit(lint_imports(no_cache=True, no_logo=True))")
    assert r.returncode == 0, (r.stdout + r.stderr)[-6000:]
    assert "Contracts: " in r.stdout and " broken" in r.stdout  # it ran every contract


CYCLES = """
import sys, grimp
g = grimp.build_graph("edgespec", include_external_packages=False)
assert {"edgespec.models.llama", "edgespec.converters.convert", "edgespec.apps.chat"} <= g.modules, "layout"
sys.setrecursionlimit(10000)
index, low, stack, on, out = {}, {}, [], set(), []
def visit(v):
    index[v] = low[v] = len(index); stack.append(v); on.add(v)
    for w in g.find_modules_directly_imported_by(v):
        if w not in index:
            visit(w); low[v] = min(low[v], low[w])
        elif w in on:
            low[v] = min(low[v], index[w])
    if low[v] == index[v]:
        group = []
        while True:
            w = stack.pop(); on.discard(w); group.append(w)
            if w == v: break
        if len(group) > 1: out.append(sorted(group))
for m in sorted(g.modules):
    if m not in index: visit(m)
print(out)
sys.exit(1 if out else 0)
"""


def test_no_import_circles(tmp_path):
    r = run_in(mirror(tmp_path), CYCLES)
    assert r.returncode == 0, "modules importing each other round a circle: " + (r.stdout + r.stderr)[-4000:]
