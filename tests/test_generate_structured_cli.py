"""`edgespec generate --json-schema FILE | --json | --regex R | --grammar FILE`: the reply
matches, and equals the Python API's; bad files are refused before the model loads."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import jsonschema
import pytest

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 30},
                                           "country": {"type": "string", "maxLength": 30},
                                           "population": {"type": "integer"}},
          "required": ["name", "country", "population"], "additionalProperties": False}
PROMPT = "Paris is a city in France with 2100000 inhabitants. Give its name, country and population as JSON."
GRAMMAR = 'start: "The answer is " ANSWER "."\nANSWER: "yes" | "no" | "maybe"\n'


def _generate(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "edgespec.cli", "generate", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_help_explains_each_option():
    out = _generate("--help").stdout
    for option in ("--json-schema FILE", "--regex R", "--grammar FILE", "--grammar-syntax", "--json "):
        assert option in out, option
    assert "GBNF" in out and "Lark" in out


@pytest.mark.parametrize("args,message", [
    (["--json-schema", "/nonexistent/schema.json"], "--json-schema /nonexistent/schema.json: cannot read it"),
    (["--json-schema", "{bad}"], "not valid JSON"),
    (["--json-schema", "[list]"], "a JSON Schema is an object, got list"),
    (["--grammar", "{grammar.txt}"], "say its syntax with --grammar-syntax lark|gbnf"),
    (["--grammar-syntax", "lark"], "--grammar-syntax needs --grammar FILE"),
    (["--regex", ""], "--regex is empty"),
    (["--regex", "a", "--json"], "not allowed with argument"),
])
def test_bad_structured_options_fail_before_loading(tmp_path, args, message):
    files = {"{bad}": ("bad.json", "{oops"), "[list]": ("list.json", "[1]"), "{grammar.txt}": ("g.txt", GRAMMAR)}
    args = [str(tmp_path / files[a][0]) if a in files else a for a in args]
    for name, text in files.values():
        (tmp_path / name).write_text(text)
    r = _generate("--model", str(tmp_path / "no-such-model"), "--prompt", "hi", *args)
    assert r.returncode != 0
    assert message in r.stderr, r.stderr
    assert "no-such-model" not in r.stderr  # refused before the model was looked for


@pytest.mark.real_model
def test_each_option_constrains_the_reply(real_bundle, real_engine, tmp_path):
    schema = tmp_path / "city.json"
    schema.write_text(json.dumps(SCHEMA))
    grammar = tmp_path / "answer.lark"
    grammar.write_text(GRAMMAR)
    common = ["--model", str(real_bundle), "--max-tokens", "60", "--stats", "none", "--drafter", "none"]

    r = _generate(*common, "--prompt", PROMPT, "--json-schema", str(schema))
    assert r.returncode == 0, r.stderr
    reply = r.stdout.rstrip("\n")
    jsonschema.validate(json.loads(reply), SCHEMA)
    ref = real_engine.chat([{"role": "user", "content": PROMPT}], max_tokens=60, response_format={
        "type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}})
    assert reply == ref.text

    r = _generate(*common, "--prompt", "Give me a phone number.", "--regex", r"\+33 [0-9]{3} [0-9]{3} [0-9]{3}")
    assert r.returncode == 0, r.stderr
    assert re.fullmatch(r"\+33 [0-9]{3} [0-9]{3} [0-9]{3}", r.stdout.rstrip("\n"))

    r = _generate(*common, "--prompt", "Is Paris in France?", "--grammar", str(grammar))
    assert r.returncode == 0, r.stderr
    assert re.fullmatch(r"The answer is (yes|no|maybe)\.", r.stdout.rstrip("\n"))

    r = _generate(*common, "--prompt", "A JSON object with the keys city and country for Paris:", "--raw", "--json")
    assert r.returncode == 0, r.stderr
    assert isinstance(json.loads(r.stdout.rstrip("\n")), dict)
