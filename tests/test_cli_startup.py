"""`edgespec --help`, a subcommand's --help and a usage error start without the engine or mlx.

Each case runs the CLI's main() in a fresh interpreter and lists what it imported; the
root package exports its names lazily, and main() sets up only the chosen subcommand.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

PROBE = """
import json, sys
from edgespec.cli import main
argv = json.loads(sys.argv[1])
try:
    code = main(argv)
except SystemExit as e:
    code = e.code
if sys.argv[2] == "touch":  # the probe's own check: a use of the engine's names does load it
    import edgespec
    edgespec.Engine
heavy = ["mlx", "mlx.core", "edgespec.engine", "edgespec.modes", "edgespec.generate"]
print(json.dumps({"code": code, "loaded": [m for m in heavy if m in sys.modules]}), file=sys.stderr)
"""


def _run(argv: list[str], touch: bool = False) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(argv), "touch" if touch else "-"],
        capture_output=True, text=True, timeout=300,
    )
    return json.loads(proc.stderr.strip().splitlines()[-1]) | {"stdout": proc.stdout}


@pytest.mark.parametrize("argv", [["--help"], [], ["--version"], ["pull", "--help"], ["list", "--help"],
                                  ["convert", "--help"], ["no-such-command"],
                                  ["generate", "--max-tokens", "many"], ["chat", "--no-such-option"],
                                  ["serve", "--port", "x"]],
                         ids=lambda a: " ".join(a) or "bare")
def test_help_and_usage_errors_load_no_engine(argv):
    out = _run(argv)
    assert out["loaded"] == [], f"`edgespec {' '.join(argv)}` imported {out['loaded']}"
    if argv == ["--help"]:
        assert out["code"] == 0 and "generate" in out["stdout"] and "serve" in out["stdout"]
    if argv == ["no-such-command"] or len(argv) > 1 and argv[1] != "--help":
        assert out["code"] == 2


def test_a_decoding_app_s_help_lists_the_modes_options():
    """`generate --help` builds the modes' options help (deferred: a usage error does not)."""
    out = _run(["generate", "--help"])
    text = " ".join(out["stdout"].split())
    assert out["code"] == 0 and "--mode-option" in text
    assert "checked before the model loads. lookahead: window" in text and "adaptive:" in text


def test_the_probe_sees_the_engine_when_it_is_used():
    out = _run(["--help"], touch=True)
    assert "edgespec.engine" in out["loaded"] and "mlx" in out["loaded"]


def test_the_lazy_root_keeps_its_names():
    import edgespec
    import edgespec.engine
    from edgespec import Engine, UnknownOptionError, __version__
    from edgespec.errors import UnknownOptionError as direct

    assert Engine is edgespec.engine.Engine and UnknownOptionError is direct
    assert __version__ == edgespec.__version__
    assert set(edgespec.__all__) <= set(dir(edgespec))
    with pytest.raises(AttributeError):
        edgespec.no_such_name  # noqa: B018
