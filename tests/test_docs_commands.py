"""Every `edgespec ...` command shown in the docs parses with the real argument parser."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from edgespec.cli import build_parser

REPO = Path(__file__).resolve().parents[1]
DOCS = sorted((REPO / "docs").glob("*.md")) + [REPO / "README.md"]


def doc_commands():
    """(argv, id) for each `edgespec SUBCOMMAND ...` line in a code block (continued lines joined)."""
    out = []
    for path in DOCS:
        fence, in_code, held, start = False, False, "", 0
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            if line.startswith("```"):
                fence = not fence  # every ``` line opens or closes a block
                in_code = fence and line.strip() in ("```", "```sh", "```bash", "```console")
                continue
            if not in_code:
                continue
            if held:
                line = held + " " + line.strip()
            elif line.strip().startswith(("edgespec ", "LD_PRELOAD=")):
                start = n
            if line.rstrip().endswith("\\"):
                held = line.rstrip()[:-1].strip()
                continue
            held = ""
            text = re.sub(r"^LD_PRELOAD=\S+\s+", "", line.split(" #")[0].strip())
            if not text.startswith("edgespec ") or "[" in text or "..." in text.replace('"..."', ""):
                continue  # synopses with [optional] parts or placeholders are not literal commands
            out.append(pytest.param(shlex.split(text)[1:], id=f"{path.name}:{start}"))
    return out


@pytest.mark.parametrize("argv", doc_commands())
def test_documented_command_parses(argv, capsys):
    try:
        build_parser().parse_args(argv)
    except SystemExit as e:  # argparse's way of refusing
        pytest.fail(f"edgespec {' '.join(argv)!r} is refused: {capsys.readouterr().err.strip()} (exit {e.code})")


def test_the_docs_have_commands_to_check():
    assert len(doc_commands()) >= 10
