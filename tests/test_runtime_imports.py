"""Runtime reads, converters write: the runtime never imports the converters (or torch, transformers).

Two checks: a static one over every import statement in the runtime's sources
(edgespec/ and models/, i.e. edgespec.models), and a dynamic one that loads a
bundle, a Hugging Face folder and a GGUF file and generates in a fresh
interpreter, then lists what got imported.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import write_tiny_bundle, write_tiny_hf_folder

REPO = Path(__file__).resolve().parents[1]
RUNTIME_DIRS = ("edgespec", "models")
FORBIDDEN = ("edgespec.converters", "converters", "torch", "transformers", "coremltools")
# The Core ML drafters (and Gemma 4's assistant package) run on macOS through coremltools' predict: a runtime use.
ALLOWED = {("edgespec/drafters/coreml_runtime.py", "coremltools"), ("edgespec/drafters/coreml_assistant.py", "coremltools")}


def _imports(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
            # `from edgespec import converters` names the package in the alias
            found += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return found


def _forbidden(module: str) -> str | None:
    for f in FORBIDDEN:
        if module == f or module.startswith(f + "."):
            return f
    return None


def test_runtime_sources_import_no_converter():
    bad = []
    files = [p for d in RUNTIME_DIRS for p in sorted((REPO / d).rglob("*.py"))]
    assert any(p.name == "loader.py" for p in files) and any(p.parent.name == "formats" for p in files)
    for path in files:
        rel = path.relative_to(REPO).as_posix()
        for line, module in _imports(path):
            hit = _forbidden(module)
            if hit and (rel, hit) not in ALLOWED:
                bad.append(f"{rel}:{line}: imports {module}")
    assert not bad, "the runtime must not import converters/torch/transformers:\n" + "\n".join(bad)


def test_the_static_check_sees_an_offending_import(tmp_path):
    # The checker itself: a lazy import inside a function is found as well as a top-level one.
    p = tmp_path / "x.py"
    p.write_text("import os\n\ndef f():\n    from edgespec.converters.hf import read_hf\n    import torch.nn\n")
    hits = [m for _, m in _imports(p) if _forbidden(m)]
    assert hits == ["edgespec.converters.hf", "edgespec.converters.hf.read_hf", "torch.nn"]


def test_runtime_paths_import_no_converter(tmp_path):
    from gguf_support import write_llama_gguf

    bundle = write_tiny_bundle(tmp_path / "bundle")
    hf = write_tiny_hf_folder(tmp_path / "hf", seed=1)
    gguf_path = write_llama_gguf(tmp_path / "tiny.gguf", seed=2)
    code = f"""
import json, os, sys
import edgespec, edgespec.weights.loader, edgespec.engine, edgespec.cli
import edgespec.apps.chat, edgespec.apps.generate, edgespec.apps.serve, edgespec.apps.common
for path in {[str(bundle), str(hf), str(gguf_path)]!r}:
    engine = edgespec.load(path, drafter="none", progress=False)
    engine.generate([1, 2, 3], max_tokens=3)
mods = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers", "coremltools", "converters")
              or m.startswith("edgespec.converters"))
print(json.dumps(mods), flush=True)
os._exit(0)  # what is imported is settled; skip interpreter teardown (worker threads' exit is not under test)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout.strip().splitlines()[-1]) == []


@pytest.mark.real_model
def test_the_default_model_loads_from_its_gguf_without_converters(tmp_path, real_gguf):
    """A fresh machine (the GGUF fetched, no bundle): edgespec.load() reads the GGUF itself."""
    home = tmp_path / "home"
    (home / "downloads").mkdir(parents=True)
    (home / "downloads" / real_gguf.name).symlink_to(real_gguf)
    code = """
import json, os, sys
import edgespec
engine = edgespec.load(progress=False)
r = engine.generate("The capital of France is", max_tokens=3)
mods = sorted(m for m in sys.modules if m.startswith(("edgespec.converters", "torch", "transformers", "coremltools")))
print(json.dumps({"mods": mods, "format": engine.loaded.manifest["source"]["format"],
                  "drafter": type(engine.drafter).__name__, "n": len(r.tokens)}), flush=True)
os._exit(0)
"""
    env = {**os.environ, "EDGESPEC_HOME": str(home)}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out == {"mods": [], "format": "gguf", "drafter": "DistilledDrafter", "n": 3}
    # nothing converted or written, except where the prompt's chunk took the CPU attention
    # path: the compiled attention kernels (edgespec.kernels.native), a build cache, no model data
    assert sorted(p.name for p in home.iterdir() if p.name != "kernels") == ["downloads"]
    assert all(p.suffix == ".so" for p in (home / "kernels").glob("*"))
