"""The smaller points of #43 (findings 7 and 8): each bad setting gets a one-line message
before the model loads, a bundle without its manifest loads with a note, and the default
prompt-cache bound fits the model (a few contexts of its KV cache), the former bound
kept as an option."""

from __future__ import annotations

import json
import os

import pytest
from conftest import make_tiny_engine, write_tiny_bundle
from test_hardening_grammar import ref_chain
from test_sessions import run_cli

from edgespec.caches import prefix
from edgespec.engine import PROMPT_CACHE_SHARE, PROMPT_CACHE_UNKNOWN_BUDGET
from edgespec.lookahead.memory import kv_bytes


def one_line_refusal(code: int, err: str, *needles) -> str:
    err = err.strip()
    assert code == 1, (code, err)  # not 139 (a segfault), not a traceback
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    for n in needles:
        assert n in err, (n, err)
    return err


def test_a_schema_that_crashed_generate_is_a_one_line_refusal(tmp_path):
    """In a fresh process, as a user runs it: it exited 139 (SIGSEGV) with no message."""
    deep = tmp_path / "deep.json"
    deep.write_text(json.dumps(ref_chain(2500)))
    r = run_cli(["generate", "--model", str(tmp_path / "no-model"), "--prompt", "hi", "--json-schema", str(deep)])
    one_line_refusal(r.returncode, r.stderr, "--json-schema", str(deep), "GrammarLimits.max_ref_depth")


def test_bad_cli_settings_are_one_line_refusals_before_the_model_loads(tmp_path, capsys):
    from edgespec.cli import main

    nowhere = str(tmp_path / "no-model")  # never reached: each refusal comes first
    latin1 = tmp_path / "answer.lark"
    latin1.write_bytes('start: "caf\xe9"'.encode("latin-1"))
    empty = tmp_path / "empty.lark"
    empty.write_text('start: a\na: a "x"')
    base = ["generate", "--model", nowhere, "--prompt", "hi"]

    def run(*args, needles):
        code = main([*base, *args])
        one_line_refusal(code, capsys.readouterr().err, *needles)

    run("--grammar", str(latin1), needles=("--grammar", str(latin1), "UTF-8"))
    run("--grammar", str(empty), needles=("--grammar", "accepts no text"))
    run("--quantized-kv-start", "-5", needles=("quantized_kv_start", "kv_bits"))
    run("--prompt-cache-bytes", "1" + "0" * 30, needles=("prompt_cache_bytes", "more than this machine's memory"))
    run("--prompt-cache-bytes", "1e30", needles=("--prompt-cache-bytes",))


def test_a_bundle_without_its_manifest_loads_with_a_note(tmp_path, capsys):
    from edgespec.cli import main

    folder = write_tiny_bundle(tmp_path / "tiny")
    args = ["generate", "--model", str(folder), "--prompt", "abc", "--max-tokens", "2", "--raw", "--stats", "none"]
    assert main(args) == 0
    assert "manifest" not in capsys.readouterr().err
    os.remove(folder / "manifest.json")
    assert main(args) == 0
    err = capsys.readouterr().err
    notes = [line for line in err.splitlines() if "manifest.json" in line]
    assert len(notes) == 1 and "not verified" in notes[0] and str(folder) in notes[0], err


def test_the_default_prompt_cache_bound_is_a_few_contexts_of_the_model(monkeypatch):
    e = make_tiny_engine(0)
    per_context = kv_bytes(e.model.args, e.context_length, 4)  # the tiny model is float32
    assert e.prefix_cache.max_bytes == min(prefix.DEFAULT_CONTEXTS * per_context, prefix.DEFAULT_CAP)
    # The former bound (a fifth of the memory left for caches) is an option.
    from edgespec.batch import memory

    monkeypatch.setattr(memory, "free_memory_now", lambda: None)
    old = make_tiny_engine(0, )
    old.prompt_cache_bytes = prefix.MEMORY
    assert old.prefix_cache.max_bytes == PROMPT_CACHE_UNKNOWN_BUDGET
    assert PROMPT_CACHE_SHARE == 0.2
    with pytest.raises(ValueError, match="more than this machine's memory"):
        prefix.check_limit(1 << 70)
