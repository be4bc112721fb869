"""A tree's rows get the grammar masks plain decoding would compute there (issue 42's miss).

`GrammarProcessor` computes a mask for every row of a verifier call, each after its own
path. llguidance (1.9.1) keeps what a mask computation left behind across `rollback()` and
`reset()`: after `{"b": [`, a mask computed after `{"` (an object key) and then a rollback
of that token gave `["` (a string value) the key's mask, `",` forbidden and `":` allowed.
On the default model that is the reported miss: plain's `",` masked out, ` Job` drawn
(tests/test_structured_real.py). The processor now reaches every row on a copy of a matcher
that never went back; these tests compare its masks with fresh matchers' along random trees.

The tokenizer is conftest.make_json_tokenizer: one character a token plus JSON's punctuation
pairs, the tokens that end one lexeme and start the next, as BPE vocabularies have them.
"""

from __future__ import annotations

import os
import random

import mlx.core as mx
import numpy as np
import pytest
from conftest import JSON_PAIRS, make_json_tokenizer
from structured_cases import SCHEMAS

from edgespec.logits.processors import GrammarProcessor
from edgespec.logits.structured import parse_response_format

TOK = make_json_tokenizer()
V = TOK.vocab_size
VOCAB = {chr(c): c - 31 for c in range(32, 127)} | {p: 96 + i for i, p in enumerate(JSON_PAIRS)}
PAIR_IDS = list(range(96, 96 + len(JSON_PAIRS)))
FORK_STEPS = int(os.environ.get("EDGESPEC_FORK_STEPS", "300"))  # committed lengths walked per schema


def ids(text: str) -> list[int]:
    """`text` in tokens, JSON_PAIRS where they fit (as a BPE tokenizer would write them)."""
    vocab = VOCAB
    out, i = [], 0
    while i < len(text):
        for n in (3, 2, 1):
            if text[i:i + n] in vocab:
                out.append(vocab[text[i:i + n]])
                i += n
                break
    return out


def mask_of(m) -> np.ndarray:
    return np.unpackbits(np.frombuffer(m.compute_bitmask(), dtype=np.uint8), bitorder="little")[:V].astype(bool)


def fresh_mask(grammar, path: list[int]) -> np.ndarray | None:
    """The mask after `path` by a new matcher consuming it token by token (plain decoding's),
    None when the grammar forbids the path."""
    m = grammar.matcher(TOK, V)
    if m.try_consume_tokens(list(path)) != len(path):
        return None
    return mask_of(m)


def processed_masks(gp: GrammarProcessor, committed: list[int], paths: list[list[int]]) -> np.ndarray:
    out = gp.process(mx.zeros((len(paths), V)), committed, paths)
    return np.isfinite(np.array(out))


@pytest.mark.parametrize("first,second", [('{"', '["'), ('["', '{"'), ('{"ab', '["ab')])
def test_a_rows_mask_does_not_leak_into_its_siblings(first, second):
    g = parse_response_format({"type": "json_object"})
    committed = ids('{"b": [')
    rows = [ids(first), ids(second)]
    got = processed_masks(GrammarProcessor(g.matcher(TOK, V), V), committed, rows)
    for row, path in zip(got, rows, strict=True):
        assert np.array_equal(row, fresh_mask(g, committed + path))
    # The difference that mattered: a string value may close (`",`), a key may not.
    value = 0 if first.startswith('["') else 1  # the row inside a string value; the other is in a key
    assert got[value][ids('",')[0]] and not got[value][ids('":')[0]]
    assert got[1 - value][ids('":')[0]] and not got[1 - value][ids('",')[0]]


def test_calls_after_a_sibling_call_see_their_own_state():
    """The same two paths in separate calls, and the sources' look-ahead questions between them."""
    g = parse_response_format({"type": "json_object"})
    gp = GrammarProcessor(g.matcher(TOK, V), V)
    committed = ids('{"b": [')
    processed_masks(gp, committed, [ids('{"')])
    assert gp.allowed_prefix(committed, ids('{"c": 1}')) == len(ids('{"c": 1}'))
    gp.forced(committed + ids('{"c'), 4)
    got = processed_masks(gp, committed, [ids('["a')])
    assert np.array_equal(got[0], fresh_mask(g, committed + ids('["a')))
    assert gp.rebuilds == 0  # the reply only grew: the matcher never went back


def _walk(grammar, start: list[int], n: int, rng: random.Random) -> list[int]:
    """Up to n tokens the grammar allows after `start`, drawn at random, JSON pairs favoured."""
    m = grammar.matcher(TOK, V)
    out: list[int] = []
    if m.try_consume_tokens(start) != len(start):  # a forbidden path's tail: nothing to add
        return out
    for _ in range(n):
        if m.is_stopped():
            break
        allowed = np.nonzero(mask_of(m))[0].tolist()
        allowed = [t for t in allowed if t != 0] or allowed
        pairs = [t for t in allowed if t in PAIR_IDS]
        t = rng.choice(pairs if pairs and rng.random() < 0.6 else allowed)
        if t == 0 or m.try_consume_tokens([t]) != 1:
            break
        out.append(t)
    return out


# Open objects (additional properties allowed: keys and values of any kind, as in the reported
# schema), and every fourth of the suite's schemas (closed objects, arrays, enums, anyOf, $ref).
OPEN = {"type": "object", "properties": {"type": {"type": ["string", "null"]}, "status": {"type": ["string", "null"]}},
        "required": ["type", "status"]}
FUZZ_FORMATS = [("json_object", {"type": "json_object"}),
                ("open_object", {"type": "json_schema", "json_schema": {"name": "open", "schema": OPEN}})] + [
    (name, {"type": "json_schema", "json_schema": {"name": name, "schema": s}}) for name, s, _ in SCHEMAS[::4]]


@pytest.mark.parametrize("name,schema", FUZZ_FORMATS, ids=[n for n, _ in FUZZ_FORMATS])
def test_tree_rows_equal_fresh_matchers_along_random_trees(name, schema):
    """Differential fuzz: a reply grows; at each length a random tree (paths the grammar allows,
    sharing prefixes, and a few it forbids) is processed; every row's mask must be a fresh
    matcher's. Fails on the rolling-back processor within the CI budget."""
    g = parse_response_format(schema)
    rng = random.Random(name)
    checked = 0
    for _ in range(max(1, FORK_STEPS // 60)):
        reply = _walk(g, [], 60, rng)
        gp = GrammarProcessor(g.matcher(TOK, V), V)
        c = 0
        while c < len(reply):
            committed = reply[:c]
            paths: list[list[int]] = []
            for _ in range(rng.randint(1, 6)):
                base = rng.choice(paths) if paths and rng.random() < 0.5 else []
                base = base[: rng.randint(0, len(base))]
                path = base + _walk(g, committed + base, rng.randint(1, 4), rng)
                if rng.random() < 0.1:
                    path = path + [rng.choice(PAIR_IDS)]  # maybe forbidden: the row is left alone
                paths.append(path)
                if rng.random() < 0.3:
                    gp.forced(committed, 8)
                if rng.random() < 0.3:
                    gp.allowed_prefix(committed, path)
            got = processed_masks(gp, committed, paths)
            for row, path in zip(got, paths, strict=True):
                want = fresh_mask(g, committed + path)
                if want is not None:
                    checked += 1
                    assert np.array_equal(row, want), (name, TOK.decode(committed), TOK.decode(path))
            c += rng.randint(1, 4)
        assert gp.rebuilds == 0
    assert checked > 50


def test_a_calls_rows_cost_a_copy_per_leaf():
    """A copy costs in proportion to the reply, so a call's rows share them: a chain of rows
    takes one copy of the reply's matcher, a tree one per leaf."""
    g = parse_response_format({"type": "json_object"})
    gp = GrammarProcessor(g.matcher(TOK, V), V)
    committed = ids('{"b": [')
    chain = ids('"abcdef"')
    gp.process(mx.zeros((len(chain) + 1, V)), committed, [[]] + [chain[:j] for j in range(1, len(chain) + 1)])
    assert gp.copies == 1
    leaves = [ids('{"k'), ids('["x'), ids('"ab'), ids('"ac')]
    paths = sorted({tuple(p[:j]) for p in leaves for j in range(1, len(p) + 1)}, key=len)
    gp.copies = 0
    got = processed_masks(gp, committed, [list(p) for p in paths])
    assert gp.copies == len(leaves)
    for row, path in zip(got, paths, strict=True):
        assert np.array_equal(row, fresh_mask(g, committed + list(path)))
