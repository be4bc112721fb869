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

from edgespec import prefix_cache
from edgespec.engine import PROMPT_CACHE_SHARE, PROMPT_CACHE_UNKNOWN_BUDGET
from edgespec.lookahead.memory import kv_bytes


def one_line_refusal(r, *needles) -> str:
    err = r.stderr.strip()
    assert r.returncode == 1, (r.returncode, r.stderr)  # not 139 (a segfault), not a traceback
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    for n in needles:
        assert n in err, (n, err)
    return err


def test_bad_cli_settings_are_one_line_refusals_before_the_model_loads(tmp_path):
    nowhere = str(tmp_path / "no-model")  # never reached: each refusal comes first
    latin1 = tmp_path / "answer.lark"
    latin1.write_bytes('start: "caf\xe9"'.encode("latin-1"))
    deep = tmp_path / "deep.json"
    deep.write_text(json.dumps(ref_chain(2500)))
    empty = tmp_path / "empty.lark"
    empty.write_text('start: a\na: a "x"')
    base = ["generate", "--model", nowhere, "--prompt", "hi"]
    one_line_refusal(run_cli([*base, "--grammar", str(latin1)]), "--grammar", str(latin1), "UTF-8")
    one_line_refusal(run_cli([*base, "--json-schema", str(deep)]), "--json-schema", str(deep),
                     "GrammarLimits.max_ref_depth")
    one_line_refusal(run_cli([*base, "--grammar", str(empty)]), "--grammar", "accepts no text")
    one_line_refusal(run_cli([*base, "--quantized-kv-start", "-5"]), "quantized_kv_start", "kv_bits")
    one_line_refusal(run_cli([*base, "--prompt-cache-bytes", "1" + "0" * 30]), "prompt_cache_bytes",
                     "more than this machine's memory")
    one_line_refusal(run_cli([*base, "--prompt-cache-bytes", "1e30"]), "--prompt-cache-bytes")


def test_a_bundle_without_its_manifest_loads_with_a_note(tmp_path):
    folder = write_tiny_bundle(tmp_path / "tiny")
    r = run_cli(["generate", "--model", str(folder), "--prompt", "abc", "--max-tokens", "2", "--raw"])
    assert r.returncode == 0 and "manifest" not in r.stderr, r.stderr
    os.remove(folder / "manifest.json")
    r = run_cli(["generate", "--model", str(folder), "--prompt", "abc", "--max-tokens", "2", "--raw"])
    assert r.returncode == 0, r.stderr
    notes = [line for line in r.stderr.splitlines() if "manifest.json" in line]
    assert len(notes) == 1 and "not verified" in notes[0] and str(folder) in notes[0], r.stderr


def test_the_default_prompt_cache_bound_is_a_few_contexts_of_the_model(monkeypatch):
    e = make_tiny_engine(0)
    per_context = kv_bytes(e.model.args, e.context_length, 4)  # the tiny model is float32
    assert e.prefix_cache.max_bytes == min(prefix_cache.DEFAULT_CONTEXTS * per_context, prefix_cache.DEFAULT_CAP)
    # The former bound (a fifth of the memory left for caches) is an option.
    from edgespec.batch import memory

    monkeypatch.setattr(memory, "free_memory_now", lambda: None)
    old = make_tiny_engine(0, )
    old.prompt_cache_bytes = prefix_cache.MEMORY
    assert old.prefix_cache.max_bytes == PROMPT_CACHE_UNKNOWN_BUDGET
    assert PROMPT_CACHE_SHARE == 0.2
    with pytest.raises(ValueError, match="more than this machine's memory"):
        prefix_cache.check_limit(1 << 70)
