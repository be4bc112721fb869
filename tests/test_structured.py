"""Constrained decoding, penalties and logprobs in the engine (tiny models; see
test_structured_real.py for the default model).

The tiny engine here reads printable ASCII one character a token, so every JSON
schema of the suite (structured_cases.py) can be written by it; its random
weights make the grammar, not the model, decide the shape of the output.
"""

from __future__ import annotations

import itertools
import json
import threading

import mlx.core as mx
import numpy as np
import pytest
from conftest import make_tiny_model
from stats_support import chisq_pvalue
from structured_cases import GRAMMARS, REGEXES, SCHEMAS
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, pre_tokenizers
from tokenizers import models as tk_models

import edgespec
from edgespec.batch.stack import compose_request
from edgespec.drafters.mlx_drafter import MLXDrafter
from edgespec.drafters.self_spec import SelfSpecDrafter
from edgespec.engine import Engine
from edgespec.generate import GenerationStats
from edgespec.logits.processors import Penalties
from edgespec.logits.sampling import Sampler
from edgespec.logits.structured import GrammarError, matcher_cache, parse_response_format
from edgespec.logits.structured.tokens import token_bytes, token_style
from edgespec.modes import make_mode
from edgespec.tokenizer import Tokenizer
from edgespec.weights.loader import LoadedModel

V = 96  # EOS + the 95 printable ASCII characters


def ascii_tokenizer() -> Tokenizer:
    vocab = {"</s>": 0}
    for c in range(32, 127):
        vocab[chr(c)] = len(vocab)
    backend = HFTokenizer(tk_models.WordLevel(vocab=vocab, unk_token="</s>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    backend.decoder = decoders.Fuse()
    return Tokenizer(backend, {"eos_token": "</s>"})


def ascii_engine(drafter: str | None = None) -> Engine:
    model = make_tiny_model(0, num_hidden_layers=4, scale=2.0, vocab_size=V)
    engine = Engine(LoadedModel(model, ascii_tokenizer(), None), history="off")
    if drafter == "self":
        engine.drafter = SelfSpecDrafter(model, [0, 1, 2])
    elif drafter == "mlx":
        engine.drafter = MLXDrafter(make_tiny_model(3, num_hidden_layers=1, vocab_size=V))
    return engine


@pytest.fixture(scope="module")
def engine():
    return ascii_engine("self")


def cid(c: str) -> int:
    return 1 + ord(c) - 32


CASES = [(n, s, t) for n, s, t in SCHEMAS] + [(n, rf, t) for n, rf, t in REGEXES + GRAMMARS]
PROMPT = 'Data: {"name": "ab", "n": 3} -> {"name": "ab"'
MAX = 40


def prompt_ids(engine) -> list[int]:
    return engine.tokenizer.encode(PROMPT)


# ------------------------------------------------------------------ exactness in every mode
@pytest.fixture(scope="module")
def plain_refs(engine):
    ids = prompt_ids(engine)
    return {n: engine.generate(ids, max_tokens=MAX, mode="plain", response_format=rf).tokens for n, rf, _ in CASES}


MODES = [
    ("speculative", {}),
    ("prompt_lookup", {}),
    ("lookahead", {}),
    ("tree", {}),
    ("tree", {"adaptive": 0}),
    ("tree", {"sources": "prompt_lookup+pool"}),
    ("adaptive", {}),
    ("auto", {}),
]


@pytest.mark.parametrize("mode,extra", MODES, ids=[m + ("+" + "+".join(f"{k}={v}" if k == "adaptive" else str(v) for k, v in e.items()) if e else "") for m, e in MODES])
def test_greedy_constrained_equals_plain_constrained_in_every_mode(engine, plain_refs, mode, extra):
    ids = prompt_ids(engine)
    grew = 0
    for name, rf, _ in CASES:
        r = engine.generate(ids, max_tokens=MAX, mode=mode, response_format=rf, **extra)
        assert r.tokens == plain_refs[name], (mode, name, r.text)
        grew += r.stats.accepted
    # The self-speculative drafter of a random model rarely agrees; the default tree's
    # controller may choose plain steps from its timings (its always-full form is checked).
    if mode != "speculative" and not (mode == "tree" and not extra):
        assert grew > 0, "no draft was ever accepted: the mode did not speculate"


def test_greedy_constrained_cascade_equals_plain(plain_refs):
    engine = ascii_engine("mlx")
    ids = prompt_ids(engine)
    for name, rf, _ in CASES[::3]:
        r = engine.generate(ids, max_tokens=MAX, mode="cascade", draft_tokens=3, mid_layers="0-2", response_format=rf)
        assert r.tokens == plain_refs[name], name


def test_batched_rows_equal_plain(engine, plain_refs):
    """Concurrent requests with different schemas join one batch; each gets its own grammar."""
    ids = prompt_ids(engine)
    out = {}

    def run(name, rf, mode):
        out[(name, mode)] = engine.generate(ids, max_tokens=MAX, mode=mode, response_format=rf).tokens

    threads = [threading.Thread(target=run, args=(n, rf, m)) for n, rf, _ in CASES[:12] for m in ("plain", "auto")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for (name, _mode), toks in out.items():
        assert toks == plain_refs[name], name
    # generate_many: one response format for every prompt, as batched rows
    rf = SCHEMAS[0][1]
    many = engine.generate_many([ids, ids[:-3], ids], max_tokens=MAX, mode="auto", response_format=rf)
    alone = [engine.generate(p, max_tokens=MAX, mode="plain", response_format=rf).tokens for p in (ids, ids[:-3])]
    assert [r.tokens for r in many] == [alone[0], alone[1], alone[0]]


def test_output_follows_the_grammar(engine):
    """Whatever the weights, the text is a prefix of a valid document, complete on 'stop'."""
    import jsonschema

    ids = prompt_ids(engine)
    for name, schema, _ in SCHEMAS:
        r = engine.generate(ids, max_tokens=400, mode="plain", response_format=schema, temperature=0.9, seed=3)
        if r.finish_reason == "stop":
            jsonschema.validate(json.loads(r.text), schema)
        else:  # ran out of tokens in a long string or number: still a prefix the grammar allows
            m = parse_response_format(schema).matcher(engine.tokenizer, V)
            assert m.consume_tokens(r.tokens), (name, r.text)


def test_regex_stops_when_the_grammar_is_complete(engine):
    ids = prompt_ids(engine)
    r = engine.generate(ids, max_tokens=50, mode="plain", response_format={"type": "regex", "pattern": "(yes|no)"})
    assert r.text in ("yes", "no") and r.finish_reason == "stop"
    r = engine.generate(ids, max_tokens=50, mode="auto", response_format={"type": "regex", "pattern": "abc(d|e)"})
    assert r.text in ("abcd", "abce") and r.finish_reason == "stop"
    r = engine.generate(ids, max_tokens=50, mode="auto", response_format=GRAMMARS[1][1])
    assert all(p in ("red", "green", "blue") for p in r.text.split(", ")) and r.finish_reason == "stop"


# ------------------------------------------------------------------ sampled: the masked law
def sample_first(engine, mode_name: str, rf, n: int, runs: int, temperature: float = 1.0) -> np.ndarray:
    options = edgespec.make_options(mode=mode_name, temperature=temperature, response_format=rf)
    ids = prompt_ids(engine)
    keys = [tuple(k) for k in itertools.product("abcd", repeat=n)]
    counts = np.zeros(len(keys))
    for seed in range(runs):
        opts = edgespec.make_options(mode=mode_name, temperature=temperature, response_format=rf, seed=seed)
        mode = make_mode(engine.resolve_mode(options), engine, opts)
        follow = compose_request(mode, engine, opts, ids)
        it = follow(mode.steps(ids, Sampler(opts.sampling), GenerationStats()))
        got = tuple(chr(t.id - 1 + 32) for t in itertools.islice(it, n))
        it.close()
        counts[keys.index(got)] += 1
    return counts


def masked_law(model, prompt: list[int], allowed: list[int], n: int, temperature: float = 1.0) -> np.ndarray:
    """The law of the first n tokens when each position draws from softmax(logits / T)
    restricted to `allowed` (computed here from the model directly, independently of edgespec's
    processors)."""
    probs = []
    for prefix in itertools.product(allowed, repeat=n):
        p = 1.0
        for i in range(n):
            logits = np.array(model(mx.array([prompt + list(prefix[:i])], dtype=mx.int32))[0, -1], dtype=np.float64)
            x = logits[allowed] / temperature
            q = np.exp(x - x.max())
            q /= q.sum()
            p *= q[allowed.index(prefix[i])]
        probs.append(p)
    return np.array(probs)


@pytest.mark.parametrize("mode_name", ["plain", "auto", "speculative", "tree", "lookahead"])
def test_sampled_constrained_output_follows_the_masked_law(engine, mode_name):
    rf = {"type": "regex", "pattern": "[a-d][a-d]"}
    allowed = [cid(c) for c in "abcd"]
    law = masked_law(engine.model, prompt_ids(engine), allowed, 2)
    counts = sample_first(engine, mode_name, rf, 2, 400)
    assert chisq_pvalue(counts, law) > 1e-3, (counts, law * counts.sum())
    # A deliberately wrong mask (one more letter allowed, renormalised over five) must be
    # rejected by the same test on the same draws: its law puts mass on pairs with an 'e'
    # (pooled into one cell here), which the real output never shows, and less on the rest.
    wrong = [cid(c) for c in "abcde"]
    wl = masked_law(engine.model, prompt_ids(engine), wrong, 2)
    keep = [i for i, k in enumerate(itertools.product(wrong, repeat=2)) if cid("e") not in k]
    wrong_law = np.append(wl[keep], 1.0 - wl[keep].sum())
    assert chisq_pvalue(np.append(counts, 0.0), wrong_law) < 1e-3


# ------------------------------------------------------------------ penalties and logprobs
def penalised_reference(model, prompt: list[int], n: int, pen: Penalties) -> list[int]:
    out: list[int] = []
    for _ in range(n):
        logits = np.array(model(mx.array([prompt + out], dtype=mx.int32))[0, -1], dtype=np.float64)
        counts = np.bincount(np.array(out, dtype=np.int64), minlength=len(logits))
        seen = (counts > 0) | (np.bincount(np.array(prompt), minlength=len(logits)) > 0)
        logits = np.where(seen, np.where(logits > 0, logits / pen.repetition, logits * pen.repetition), logits)
        logits = logits - pen.frequency * counts - pen.presence * (counts > 0)
        out.append(int(np.argmax(logits)))
        if out[-1] == 0:  # EOS
            return out[:-1]
    return out


def test_penalties_are_exact_in_every_mode(engine):
    ids = prompt_ids(engine)
    pen = dict(presence_penalty=0.7, frequency_penalty=0.4, repetition_penalty=1.3)
    ref = penalised_reference(engine.model, ids, 30, Penalties(0.7, 0.4, 1.3))
    plain = engine.generate(ids, max_tokens=30, mode="plain", **pen).tokens
    assert plain == ref
    free = engine.generate(ids, max_tokens=30, mode="plain").tokens
    assert free != ref  # the penalties changed something
    for mode, extra in MODES:
        assert engine.generate(ids, max_tokens=30, mode=mode, **pen, **extra).tokens == ref, mode
    # with a grammar too
    rf = SCHEMAS[6][1]
    ref_g = engine.generate(ids, max_tokens=MAX, mode="plain", response_format=rf, **pen).tokens
    for mode, extra in MODES:
        assert engine.generate(ids, max_tokens=MAX, mode=mode, response_format=rf, **pen, **extra).tokens == ref_g


def test_logprobs_come_from_the_masked_verifier_distribution(engine):
    ids = prompt_ids(engine)
    rf = {"type": "regex", "pattern": "[a-d]{6}"}
    allowed = [cid(c) for c in "abcd"]
    plain = engine.generate(ids, max_tokens=10, mode="plain", response_format=rf, logprobs=3)
    assert plain.finish_reason == "stop" and len(plain.logprobs) == len(plain.tokens) == 6
    for i, (tok, lp) in enumerate(zip(plain.tokens, plain.logprobs, strict=True)):
        logits = np.array(engine.model(mx.array([ids + plain.tokens[:i]], dtype=mx.int32))[0, -1], dtype=np.float64)
        x = logits[allowed] - np.logaddexp.reduce(logits[allowed])
        assert lp.token == tok
        assert lp.logprob == pytest.approx(x[allowed.index(tok)], abs=1e-4)
        assert [t for t, _ in lp.top] == [allowed[j] for j in np.argsort(-x)[:3]]
    for mode in ("auto", "speculative", "lookahead", "tree"):
        r = engine.generate(ids, max_tokens=10, mode=mode, response_format=rf, logprobs=3)
        assert r.tokens == plain.tokens
        for a, b in zip(r.logprobs, plain.logprobs, strict=True):
            assert a.token == b.token and a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
    chunks = list(engine.stream(ids, max_tokens=10, mode="auto", response_format=rf, logprobs=0))
    got = [lp for c in chunks for lp in (c.logprobs or [])]
    assert [g.token for g in got] == plain.tokens and all(g.top == [] for g in got)


# ------------------------------------------------------------------ the forced-token source
def test_forced_tokens_are_drafted_and_always_accepted(engine):
    schema = {"type": "object", "properties": {"colour": {"enum": ["turquoise", "magenta"]},
                                               "count": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["colour", "count"], "additionalProperties": False}
    ids = prompt_ids(engine)
    ref = engine.generate(ids, max_tokens=60, mode="plain", response_format=schema)
    r = engine.generate(ids, max_tokens=60, mode="auto", response_format=schema, sources="forced")
    assert r.tokens == ref.tokens and r.finish_reason == "stop"
    forced = r.stats.accepted_by_source.get("forced", 0)
    assert forced >= len('{"colour": "') - 1, r.stats.accepted_by_source
    assert r.stats.verifier_passes < len(r.tokens) / 2  # most of the reply came in forced runs
    free = engine.generate(ids, max_tokens=20, mode="auto", sources="forced")  # no grammar: proposes nothing
    assert free.stats.accepted_by_source.get("forced", 0) == 0


def test_vetting_drops_what_the_grammar_forbids(engine):
    from edgespec.adaptive.sources import ForcedSource
    from edgespec.logits.processors import GrammarProcessor

    g = parse_response_format({"type": "regex", "pattern": "ab[cd]+"})
    src = ForcedSource()
    src.bind(GrammarProcessor(g.matcher(engine.tokenizer, V), V), 3)
    seq = [5, 6, 7]
    assert src.propose(seq, 3, 8)[0].tokens == [cid("a"), cid("b")]
    assert src.vet(seq, [cid("a"), cid("b"), cid("c"), cid("x"), cid("d")]) == 3
    assert src.vet(seq + [cid("a")], [cid("b"), cid("d"), cid("c")]) == 3
    assert src.vet(seq, [cid("b")]) == 0


# ------------------------------------------------------------------ formats, errors, caching
class Person:  # stands in for a Pydantic model class (anything with model_json_schema)
    @classmethod
    def model_json_schema(cls):
        return {"title": "Person", "type": "object", "properties": {"name": {"type": "string", "maxLength": 5}},
                "required": ["name"], "additionalProperties": False}


def test_response_format_shapes(engine):
    ids = prompt_ids(engine)
    inner = Person.model_json_schema()
    shapes = [Person, inner, {"type": "json_schema", "json_schema": {"name": "p", "schema": inner, "strict": True}}]
    outs = {tuple(engine.generate(ids, max_tokens=40, mode="plain", response_format=s).tokens) for s in shapes}
    assert len(outs) == 1
    text = engine.tokenizer.decode(list(next(iter(outs))))
    assert set(json.loads(text)) == {"name"}
    r = engine.generate(ids, max_tokens=200, mode="plain", response_format={"type": "json_object"}, temperature=0.0)
    assert r.text.startswith("{")
    assert parse_response_format({"type": "text"}) is None and parse_response_format(None) is None
    try:
        from pydantic import BaseModel

        class Item(BaseModel):
            sku: str
            qty: int

        g = parse_response_format(Item)
        assert g.kind == "json_schema" and set(g.schema["properties"]) == {"sku", "qty"}
    except ImportError:
        pass


@pytest.mark.parametrize("bad,match", [
    ({"type": "regex", "pattern": "(("}, "invalid regex"),
    ({"type": "grammar", "grammar": "start: missing_rule"}, "invalid lark grammar"),
    ({"type": "grammar", "syntax": "gbnf", "grammar": 'root ::= "a" nope'}, "invalid GBNF"),
    ({"type": "grammar", "syntax": "ebnf", "grammar": "x"}, "syntax"),
    ({"type": "json_schema", "json_schema": {"schema": {"type": "objectx"}}}, "invalid JSON schema"),
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/none"}}}, "invalid JSON schema"),
    ({"type": "json_schema"}, "needs 'json_schema'"),
    ({"type": "regex"}, "needs a non-empty 'pattern'"),
    ("json", "response_format must be"),
    ({"type": "json_list"}, "not supported"),
])
def test_bad_formats_fail_at_submit_with_a_clear_message(engine, bad, match):
    with pytest.raises(ValueError, match=match):
        edgespec.make_options(response_format=bad)
    with pytest.raises(ValueError, match=match):
        engine.stream(prompt_ids(engine), response_format=bad)  # at the call, not when read


@pytest.mark.parametrize("kw,match", [
    ({"logprobs": 21}, "logprobs"), ({"logprobs": True}, "logprobs"), ({"presence_penalty": 3}, "presence_penalty"),
    ({"frequency_penalty": float("nan")}, "frequency_penalty"), ({"repetition_penalty": 0}, "repetition_penalty"),
])
def test_bad_options_are_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        edgespec.make_options(**kw)


def test_compiled_once_per_schema_and_tokenizer(engine):
    schema = {"type": "object", "properties": {"zz_cache_probe": {"type": "integer"}}, "required": ["zz_cache_probe"]}
    before = matcher_cache().compiles
    for _ in range(3):
        engine.generate(prompt_ids(engine), max_tokens=3, mode="plain", response_format=dict(schema))
    assert matcher_cache().compiles == before + 1
    other = ascii_engine()  # another tokenizer object: its own compilation
    other.generate(prompt_ids(other), max_tokens=3, mode="plain", response_format=schema)
    assert matcher_cache().compiles == before + 2


def test_a_grammar_failure_fails_its_request_alone(engine, monkeypatch):
    from edgespec.logits import processors

    real = processors.GrammarProcessor.allowed
    ids = prompt_ids(engine)

    def flaky(self, m=None):  # fails the request whose reply starts with '[' (the array schema) at its 5th token
        if self.state[:1] == [cid("[")] and len(self.state) >= 4:
            raise GrammarError("simulated matcher failure")
        return real(self, m)

    monkeypatch.setattr(processors.GrammarProcessor, "allowed", flaky)
    errors, oks = [], []

    def run(rf):
        try:
            oks.append(engine.generate(ids, max_tokens=20, mode="auto", response_format=rf).text)
        except GrammarError as e:
            errors.append(str(e))

    threads = [threading.Thread(target=run, args=(rf,)) for rf in
               (SCHEMAS[8][1], SCHEMAS[0][1], {"type": "regex", "pattern": "[a-z]{5}"})]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == ["simulated matcher failure"] and len(oks) == 2  # the array schema's request alone


# ------------------------------------------------------------------ token bytes
def test_token_bytes_of_a_byte_level_and_a_character_tokenizer():
    from conftest import make_tiny_tokenizer

    tok = ascii_tokenizer()
    tb, special = token_bytes(tok, 100)
    assert token_style(tok) == "text" and special[0] == 0 and set(special) >= {0, 96, 99}
    assert b"".join(tb[i] for i in tok.encode("Hi {x}!")) == b"Hi {x}!"
    assert token_style(make_tiny_tokenizer()) == "text"


# ------------------------------------------------------------------ the wrapper itself
def test_processed_model_rows_follow_their_own_prefix(engine):
    """A tree call's rows are masked after their own paths; drafter-style calls (a layer
    subset, a cache the wrapper did not make) pass through; a call whose committed prefix is
    unknown is refused instead of guessed."""
    from edgespec.generate import prefill
    from edgespec.logits.processors import GrammarProcessor, ProcessedModel

    ids = prompt_ids(engine)
    g = parse_response_format({"type": "regex", "pattern": "a(b|c)d"})
    pm = ProcessedModel(engine.model, ids, [GrammarProcessor(g.matcher(engine.tokenizer, V), V)])
    cache = pm.make_cache()
    first = np.array(prefill(pm, cache, ids))
    assert np.isfinite(first).sum() == 1 and np.argmax(first) == cid("a")  # only 'a' may start
    # a tree: root 'a' with children 'b' and 'c', 'd' under 'b'; and a forbidden child 'x'
    from edgespec.kernels import tree_mask

    toks = [cid("a"), cid("b"), cid("c"), cid("d"), cid("x")]
    parents = [-1, 0, 0, 1, 0]
    mask, pos = tree_mask(mx.array(parents, dtype=mx.int32), cache[0].offset)
    out = np.array(pm(mx.array([toks], dtype=mx.int32), cache, mask=mask, positions=pos)[0])
    allowed = [set(np.nonzero(np.isfinite(r))[0].tolist()) for r in out]
    assert allowed[0] == {cid("b"), cid("c")}  # after 'a'
    assert allowed[1] == {cid("d")} and allowed[2] == {cid("d")}  # after 'ab' / 'ac'
    assert allowed[3] == {0}  # after 'abd': the grammar is complete, EOS only
    assert len(allowed[4]) > 1  # after the forbidden 'ax': never drawn from, left alone
    raw = np.array(engine.model(mx.array([ids], dtype=mx.int32))[0, -1])
    side = engine.model.make_cache()  # not made by the wrapper: passes through
    assert np.allclose(np.array(pm(mx.array([ids], dtype=mx.int32), side)[0, -1]), raw, atol=1e-4)
    # the tree step kept 'a','b' but the mode has not handed them out: the prefix is unknown
    for c in cache:
        c.keep(len(ids), [0, 1])
    with pytest.raises(GrammarError, match="positions known"):
        pm(mx.array([[cid("d")]], dtype=mx.int32), cache)
    # once they are handed out, the same call is masked after 'ab' + 'd'
    for c in cache:
        c.trim(c.offset - (len(ids) + 2))  # drop what the refused call wrote
    pm.emitted.extend([cid("a"), cid("b")])
    row = np.array(pm(mx.array([[cid("d")]], dtype=mx.int32), cache)[0, -1])
    assert set(np.nonzero(np.isfinite(row))[0].tolist()) == {0}


def test_processed_model_records_positions_after_a_tree_step(engine):
    """After a tree step, the wrapper's record of which token sits at each cache position
    stays aligned: a later chain call's tokens are recorded at their own positions (the
    tree path's positions filled from the handed-out reply), so a call that must read the
    record (a mode calling ahead of what it handed out) reads the true prefix."""
    from edgespec.generate import prefill
    from edgespec.kernels import tree_mask
    from edgespec.logits.processors import GrammarProcessor, ProcessedModel

    ids = prompt_ids(engine)
    g = parse_response_format({"type": "regex", "pattern": "abcde"})
    pm = ProcessedModel(engine.model, ids, [GrammarProcessor(g.matcher(engine.tokenizer, V), V)])
    cache = pm.make_cache()
    prefill(pm, cache, ids)
    a, b, c, d = (cid(x) for x in "abcd")
    mask, pos = tree_mask(mx.array([-1, 0, 1], dtype=mx.int32), cache[0].offset)
    pm(mx.array([[a, b, c]], dtype=mx.int32), cache, mask=mask, positions=pos)  # root 'a', path 'b', 'c'
    for layer in cache:
        layer.keep(len(ids), [0, 1, 2])
    pm.emitted.extend([a, b, c])  # the mode hands out the step
    pm(mx.array([[d]], dtype=mx.int32), cache)  # a chain call at position P + 3
    record = pm._records[id(cache[0])]  # noqa: SLF001
    assert record[len(ids):] == [a, b, c, d]
    # a call ahead of what was handed out ('d' not yet emitted) is masked after 'abcd' + 'e'
    row = np.array(pm(mx.array([[cid("e")]], dtype=mx.int32), cache)[0, -1])
    assert set(np.nonzero(np.isfinite(row))[0].tolist()) == {0}
