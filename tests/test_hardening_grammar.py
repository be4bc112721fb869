"""Grammars cannot crash or stall the process that compiles them (#43, findings 1-4, 7).

Bounds are checked before llguidance sees a grammar (the limit is named); what passes is
compiled in a worker process with a time bound, so a native crash (simulated here by a
SIGSEGV sent to the worker mid-compile) or a runaway compile costs the request alone;
a grammar that accepts nothing, or that the tokenizer cannot write, is refused when it
is compiled, with a short message that does not echo it."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest
from conftest import make_tiny_tokenizer
from test_structured import V, ascii_tokenizer

from edgespec.logits.structured import parse_response_format
from edgespec.logits.structured.bounds import LIMITS, GrammarLimitError
from edgespec.logits.tools import plan_tools


def ref_chain(n: int) -> dict:
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def rule_chain(n: int, gbnf: bool = False) -> dict:
    if gbnf:
        text = "\n".join(["root ::= r0", *(f"r{i} ::= r{i + 1}" for i in range(n)), f'r{n} ::= "x"'])
        return {"type": "grammar", "grammar": text, "syntax": "gbnf"}
    text = "\n".join(["start: r0", *(f"r{i}: r{i + 1}" for i in range(n)), f'r{n}: "x"'])
    return {"type": "grammar", "grammar": text}


def alternatives(n: int) -> dict:
    return {"type": "grammar", "grammar": "start: " + " | ".join(f'"w{i}"' for i in range(n))}


# The shapes that crashed or stalled the server (issue #43), each refused by a named bound.
OVER_BOUNDS = {
    "ref_chain_2500": (ref_chain(2500), "max_ref_depth"),
    "lark_rules_5000": (rule_chain(5000), "max_rules"),
    "gbnf_rules_5000": (rule_chain(5000, gbnf=True), "max_rules"),
    "alternatives_60k": (alternatives(60_000), "max_alternatives"),
    "alternatives_200k": (alternatives(200_000), "max_bytes"),
    "enum_400k": ({"enum": list(range(400_000))}, "max_bytes"),
    "enum_20k": ({"enum": [0] * 20_000}, "max_enum"),
    "anyof_5000": ({"anyOf": [{"const": i} for i in range(5_000)]}, "max_alternatives"),
    "nesting_200": (json.loads('{"type": "array", "items": ' * 200 + '{"type": "string"}' + "}" * 200), "max_depth"),
    "regex_x1000x1000": ({"type": "regex", "pattern": "x{1000}{1000}"}, "max_repetition"),
    "regex_group_nesting": ({"type": "regex", "pattern": "((a{100}){100}){100}"}, "max_repetition"),
}

# Grammars that accept no text at all (issue #43 finding 3): refused when compiled.
EMPTY = {
    "regex_intersection": {"type": "regex", "pattern": "[a&&b]"},
    "regex_empty_class": {"type": "regex", "pattern": r"[^\s\S]"},
    "lark_left_recursion_only": {"type": "grammar", "grammar": 'start: a\na: a "x"'},
    "gbnf_self": {"type": "grammar", "grammar": "root ::= root", "syntax": "gbnf"},
    "ref_cycle": {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}},
}


@pytest.mark.parametrize("name", list(OVER_BOUNDS))
def test_grammars_over_a_bound_are_refused_naming_it(name):
    rf, field = OVER_BOUNDS[name]
    with pytest.raises(GrammarLimitError, match=f"GrammarLimits.{field}"):
        parse_response_format(rf)


@pytest.mark.parametrize("name", list(EMPTY))
def test_a_grammar_that_accepts_nothing_is_refused_when_compiled(name):
    rf = EMPTY[name]
    with pytest.raises(ValueError) as e:
        parse_response_format(rf)
    msg = str(e.value)
    assert "accepts no text" in msg and len(msg) < 200, msg
    source = rf.get("pattern") or rf.get("grammar") or "$defs"
    assert source not in msg


def test_a_grammar_the_tokenizer_cannot_write_is_refused_for_that_tokenizer():
    g = parse_response_format({"type": "object"})  # fine without a tokenizer...
    with pytest.raises(ValueError, match="cannot be written with this model's tokens"):
        g.matcher(make_tiny_tokenizer(64), 64)  # ...but letters and digits cannot write '{'
    assert g.matcher(ascii_tokenizer(), V) is not None


def test_a_worker_crash_mid_compile_costs_the_request_and_the_next_compile_works(monkeypatch):
    """A real SIGSEGV in the worker (sent while it compiles a slow grammar): the caller gets
    a ValueError saying the grammar crashed the compiler, this process goes on, and the pool
    starts a new worker for the next grammar."""
    from edgespec.logits.structured.grammar import _isolated

    monkeypatch.setattr(LIMITS, "max_alternatives", 10**6)
    monkeypatch.setattr(LIMITS, "max_bytes", 10**7)
    pool = _isolated()
    slow = alternatives(60_000)  # several seconds of compiling
    crashes = pool.crashes

    def segfault_the_busy_worker():
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            busy = pool.busy_pids()
            if busy:
                time.sleep(0.2)
                os.kill(busy[0], signal.SIGSEGV)
                return
            time.sleep(0.01)

    killer = threading.Thread(target=segfault_the_busy_worker)
    killer.start()
    with pytest.raises(ValueError, match="crashed the grammar compiler.*signal 11"):
        parse_response_format(slow)
    killer.join()
    assert pool.crashes == crashes + 1
    assert parse_response_format({"type": "regex", "pattern": "[a-c]{2}"}).matcher(ascii_tokenizer(), V)


def test_a_compile_past_the_time_bound_is_refused_within_it(monkeypatch):
    monkeypatch.setattr(LIMITS, "max_alternatives", 10**6)
    monkeypatch.setattr(LIMITS, "max_bytes", 10**7)
    monkeypatch.setattr(LIMITS, "compile_timeout_s", 1.0)
    t = time.perf_counter()
    with pytest.raises(ValueError, match=r"took over 1 s.*compile_timeout_s"):
        parse_response_format(alternatives(200_000))  # 199 s when it was compiled in the server
    assert time.perf_counter() - t < 30  # the bound, plus replacing the worker (no 199 s wait)


def test_chains_within_the_bounds_compile_on_any_thread():
    """The worst shape the bounds admit (a 64-link $ref chain, 2,000 chained rules)
    compiles, in the worker and then here for a tokenizer (on a deep stack: threads get
    512 KB on macOS)."""
    tok = ascii_tokenizer()
    for rf in (ref_chain(LIMITS.max_ref_depth - 1), rule_chain(LIMITS.max_rules - 2)):
        assert parse_response_format(rf).matcher(tok, V) is not None


def test_schemas_are_checked_for_types_and_strict_keywords():
    with pytest.raises(ValueError, match="has type 'bogus'"):
        parse_response_format({"type": "object", "properties": {"a": {"type": "bogus"}}})
    strict = {"type": "json_schema", "json_schema": {"name": "x", "strict": True, "schema": {
        "type": "object", "properties": {"a": {"type": "string", "maxLenght": 3}}}}}
    with pytest.raises(ValueError, match="unknown keyword 'maxLenght'"):
        parse_response_format(strict)
    strict["json_schema"]["strict"] = False  # not strict: an annotation like any other
    assert parse_response_format(strict).kind == "json_schema"


PYDANTIC_TOOL = {"type": "function", "function": {"name": "book", "parameters": {
    "type": "object", "title": "Booking",
    "properties": {"guest": {"$ref": "#/$defs/Guest"}, "nights": {"type": "integer"}},
    "required": ["guest", "nights"],
    "$defs": {"Guest": {"type": "object", "title": "Guest", "properties": {
        "name": {"type": "string"}, "address": {"type": "object", "properties": {"city": {"type": "string"}}}},
        "required": ["name"]}}}}}


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "book"}}])
def test_tool_parameters_with_defs_compile_under_every_constrained_choice(choice):
    from jsonschema import Draft202012Validator

    plan = plan_tools([PYDANTIC_TOOL], choice, parallel_tool_calls=False)
    rf = plan.response_format
    g = parse_response_format(rf)  # was: Pointer '/$defs/Guest' does not exist (required)
    assert g.matcher(ascii_tokenizer(), V) is not None
    schema = rf["json_schema"]["schema"]
    args = {"guest": {"name": "Ann", "address": {"city": "Oslo"}}, "nights": 2}
    reply = [{"name": "book", "arguments": args}] if choice == "required" else args
    Draft202012Validator(schema).validate(reply)
    # Nested objects are closed as the schema declares them: no undeclared key at any level.
    bad = json.loads(json.dumps(reply))
    (bad[0]["arguments"] if choice == "required" else bad)["guest"]["address"]["zip"] = "0150"
    assert not Draft202012Validator(schema).is_valid(bad)


def test_a_bogus_tool_schema_is_refused_under_auto_too():
    bogus = [{"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}}]
    for choice in ("auto", "required", None):
        with pytest.raises(ValueError, match=r"tools\[0\].function.parameters.*'bogus'"):
            plan_tools(bogus, choice)
