"""Structured output with the default model (SmolLM2-135M-Instruct): every reply of the
schema suite validates (the `jsonschema` library), greedy and sampled, in plain and auto.

The suite's requests run concurrently (threads), so they also run as batched rows.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest
from structured_cases import GRAMMARS, REGEXES, SCHEMAS, prompt_for

from edgespec.logits.structured.tokens import token_bytes, token_style

MAX = 64  # the longest reply of the suite is about 40 tokens


def run_suite(engine, mode: str, temperature: float, cases=SCHEMAS):
    def one(case):
        _, rf, text = case
        return engine.generate(messages=prompt_for(text), max_tokens=MAX, mode=mode, response_format=rf,
                               temperature=temperature, seed=7)

    with ThreadPoolExecutor(16) as ex:
        return list(ex.map(one, cases))


def assert_valid(results, cases=SCHEMAS):
    bad = []
    for (name, schema, _), r in zip(cases, results, strict=True):
        try:
            assert r.finish_reason == "stop", f"finish {r.finish_reason}"
            jsonschema.validate(json.loads(r.text), schema)
        except (AssertionError, ValueError, jsonschema.ValidationError) as e:
            bad.append((name, r.text, str(e)[:80]))
    assert not bad, bad


def test_greedy_replies_validate_and_auto_equals_plain(real_engine):
    plain = run_suite(real_engine, "plain", 0.0)
    assert_valid(plain)
    auto = run_suite(real_engine, "auto", 0.0)
    assert_valid(auto)
    assert [r.tokens for r in auto] == [r.tokens for r in plain]
    forced = sum(r.stats.accepted_by_source.get("forced", 0) for r in auto)
    # Keys and punctuation came as forced drafts. Its share varies run to run: these 16 requests
    # run as one batch, whose measured guard decides in which steps rows speculate at all (a
    # fresh-clone CI run saw exactly 1/4, 162 of 648 tokens).
    assert forced > sum(len(r.tokens) for r in auto) / 8


@pytest.mark.parametrize("mode", ["plain", "auto"])
def test_sampled_replies_validate(real_engine, mode):
    assert_valid(run_suite(real_engine, mode, 0.8))


def test_regex_and_grammar_replies_match(real_engine):
    cases = REGEXES + GRAMMARS
    for mode in ("plain", "auto"):
        res = run_suite(real_engine, mode, 0.0, cases)
        for (name, rf, _), r in zip(cases, res, strict=True):
            assert r.finish_reason == "stop", (name, r.text)
            if rf["type"] == "regex":
                assert re.fullmatch(rf["pattern"], r.text), (name, r.text)
        lark, gbnf = res[len(REGEXES):]
        assert re.fullmatch(r"[0-9]{1,3}([-+*][0-9]{1,3}){0,2}", lark.text), lark.text
        assert re.fullmatch(r"(red|green|blue)(, (red|green|blue)){0,2}", gbnf.text), gbnf.text


def test_logprobs_of_the_default_model(real_engine):
    name, schema, text = SCHEMAS[0]
    r = real_engine.generate(messages=prompt_for(text), max_tokens=MAX, mode="auto", response_format=schema,
                             logprobs=5)
    assert len(r.logprobs) == len(r.tokens)
    for tok, lp in zip(r.tokens, r.logprobs, strict=True):
        assert lp.token == tok and lp.logprob <= 1e-6
        assert lp.top[0][0] == tok  # greedy: the most likely token under the masked law
        assert sum(2.718281828 ** v for _, v in lp.top) <= 1 + 1e-4
    # a forced token (the opening of the object) has probability 1 under the mask
    assert r.logprobs[0].logprob == pytest.approx(0.0, abs=1e-5) and len(r.logprobs[0].top) == 1


def test_token_bytes_of_the_default_tokenizer(real_engine):
    tok = real_engine.tokenizer
    assert token_style(tok) == "bytelevel"
    tb, special = token_bytes(tok, real_engine.model.args.vocab_size)
    assert set(tok.eos_token_ids) <= set(special)
    for s in ['{"name": "Zoë", "age": 42}\n', "  naïve café — ünïcode ✓ 日本", "tabs\tand\r\nlines"]:
        assert b"".join(tb[i] for i in tok.encode(s, add_special_tokens=False)) == s.encode()


def test_the_reported_miss_a_key_row_beside_a_string_row(real_engine):
    """Issue 42's miss, on the default model and its reported schema and prompt (plain's 87th
    reply token is `",` at -0.80; ` Job` is fourth, at -2.75). A tree call whose first branch
    drafts an object key (`{"`) and whose second continues the reply (`["`, `Com`, `pleted`):
    every row must be masked as plain masks it, so the last row's best token is still `",`.
    A grammar matcher rolled back from the key gave the string the key's mask, every token
    that closes it (`",`, `"]`, `"]]`, ...) forbidden, and ` Job` won (tests/test_grammar_forks.py)."""
    import mlx.core as mx
    import numpy as np

    from edgespec.generate import prefill
    from edgespec.kernels import tree_mask
    from edgespec.logits.processors import GrammarProcessor, ProcessedModel
    from edgespec.logits.structured import parse_response_format

    root = __import__("pathlib").Path(__file__).resolve().parent.parent
    schema = json.loads((root / "benchmarks/schemas/kb_480_job_condition.json").read_text())
    rf = {"type": "json_schema", "json_schema": {"name": "kb_480_job_condition", "schema": schema}}
    msgs = [{"role": "user", "content": "Describe a Kubernetes job condition as JSON saying the job is Complete "
                                        "with status True."}]
    plain = real_engine.generate(messages=msgs, response_format=rf, temperature=0, max_tokens=88, mode="plain")
    tok = real_engine.tokenizer
    reply = plain.tokens
    assert tok.decode(reply[84:87]) == '["Completed' and reply[87] == 1002  # the report's context
    key = tok.encode('{"', add_special_tokens=False)
    assert len(key) == 1
    ids = real_engine.encode_prompt(messages=msgs)
    V = real_engine.model.args.vocab_size
    grammar = parse_response_format(rf)
    pm = ProcessedModel(real_engine.model, ids, [GrammarProcessor(grammar.matcher(tok, V), V)])
    cache = pm.make_cache()
    prefill(pm, cache, ids + reply[:84])
    pm.emitted.extend(reply[:84])
    nodes = [key[0], reply[84], reply[85], reply[86]]
    mask, pos = tree_mask(mx.array([-1, -1, 1, 2], dtype=mx.int32), cache[0].offset)
    out = np.array(pm(mx.array([nodes], dtype=mx.int32), cache, mask=mask, positions=pos)[0])
    assert int(np.argmax(out[3])) == 1002, tok.decode([int(np.argmax(out[3]))])
    assert np.isfinite(out[3][1002]) and not np.isfinite(out[0][1002])  # a string may close; a key not with `",`
