"""The exactness fuzzer: seeded random decision sequences against plain decoding.

A case is drawn from its seed: a verifier (tiny dense Llama; the same with a tokenizer that
has JSON's punctuation pairs, for JSON schemas; or a hybrid with recurrent layers), features
(a grammar, penalties, prefix cache warm, history warm, quantized KV,
a batch of concurrent rows, a drafter, drafting ahead allowed or not), greedy or sampled, and a
`SeededPolicy` that replaces every timing-driven choice of `auto` (plain or tree rounds, draft
lengths, tree shapes, the Jacobi window, whether a round drafts the next one ahead). Its output is compared with plain decoding's under the same
options. The runtime guard (edgespec.logits.exactness) is on, so a token drawn from the wrong row
or a row processed along the wrong prefix fails where it happens.

A divergence from plain is classified: a *near-tie* when the two tokens are within TOL of
each other in plain's own distribution at that position (greedy: log-probs; sampled: log-
prob plus the position's Gumbel noise), which a pass over many positions may round the
other way; otherwise an *error*. `run_cases` returns both; the test asserts zero errors
and reports near-ties. A failure prints the seed and the recorded decisions, which replay
it (`ScriptedPolicy`).

CI runs a short budget (tests/test_exact_fuzz.py); the long one is
`EDGESPEC_FUZZ_CASES=3000 make test PYTEST_ARGS="tests/test_exact_fuzz.py -q -s"` (docs/exactness.md).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np
from conftest import make_json_tokenizer, make_tiny_model, make_tiny_tokenizer

from edgespec.adaptive.policy import SeededPolicy
from edgespec.benchmark.runner import NEAR_TIE_LOGPROB
from edgespec.engine import Engine
from edgespec.logits.sampling import Sampler, SamplingParams
from edgespec.weights.loader import LoadedModel

# near-tie: the two tokens' scores in plain's distribution differ by less (nats); the bench's too
TOL = NEAR_TIE_LOGPROB

# Grammars over the tiny tokenizer's characters (a-z, A-Z, 0-9, space, '.').
GRAMMARS = [
    {"type": "regex", "pattern": "[a-m]{2,6}( [a-m]{2,6}){2,8}\\."},
    {"type": "regex", "pattern": "(abc|abd|ab|b[a-f]+)+ [0-9]{1,4}"},
    {"type": "grammar", "syntax": "lark", "grammar": 'start: word (" " word)* "."\nword: /[a-h]{1,5}/ | "the" | "then"'},
    {"type": "grammar", "syntax": "gbnf", "grammar": 'root ::= item (" " item)*\nitem ::= [a-f]+ | [0-9][0-9]'},
]
# JSON schemas for the tiny_json verifier (conftest.make_json_tokenizer: ASCII one character a
# token, plus JSON's punctuation pairs such as `{"` and `["`, where a row's grammar state is most
# delicate: issue 42's miss). Open objects take keys and values of any kind.
JSON_GRAMMARS = [
    {"type": "json_object"},
    {"type": "json_schema", "json_schema": {"name": "open", "schema": {
        "type": "object", "properties": {"type": {"type": ["string", "null"]}, "status": {"type": ["string", "null"]}},
        "required": ["type", "status"]}}},
    {"type": "json_schema", "json_schema": {"name": "rows", "schema": {
        "type": "array", "items": {"anyOf": [{"type": "object"}, {"type": "array", "items": {"type": "string"}}]}}}},
]
# tiny_json's prompts: `{"`, `["`, `":`, `",`, `"]`, `: [`, `: {`, `"}` and some letters and digits.
JSON_PROMPT_IDS = [96, 97, 98, 99, 100, 101, 106, 107, 66, 67, 68, 17, 18, 1]
# The hybrids' tokenizer (tests/test_architectures.vocab_tokenizer) has letters only.
LETTER_GRAMMARS = [
    {"type": "regex", "pattern": "[a-h]{4,40}"},
    {"type": "regex", "pattern": "(ab|cd|e[f-k])+z"},
]


@dataclass
class Case:
    seed: int
    verifier: str  # "tiny" | a hybrid architecture name
    greedy: bool
    grammar: dict | None
    penalties: dict
    prefix_warm: bool
    history_warm: bool
    kv_bits: int | None
    batch: int  # rows decoded together (1: alone)
    # None, "model" (a tiny MLX drafter), "dflash" (a DFlash block drafter) or "int8" (the verifier in int8)
    drafter: str | None
    prompt: list[int]
    max_tokens: int
    decisions: list = field(default_factory=list)
    corpus: bool = False  # a corpus table (edgespec.adaptive.corpus) of the verifier's own replies
    # auto's options for a ranking drafter ("model"): runner-ups and a draft floor, or none
    ranked: dict = field(default_factory=dict)
    # drafting ahead allowed (auto's `pipeline`): with a drafter that can (MLX, int8), its calls
    # run on the drafter's worker and the policy's seeded choice drafts rounds ahead
    pipeline: bool = True

    def describe(self) -> str:
        feats = [f"verifier={self.verifier}", "greedy" if self.greedy else "sampled"]
        if self.grammar:
            feats.append(f"grammar={self.grammar}")
        if self.penalties:
            feats.append(f"penalties={self.penalties}")
        for name in ("prefix_warm", "history_warm", "corpus"):
            if getattr(self, name):
                feats.append(name)
        if self.ranked:
            feats.append(f"ranked={self.ranked}")
        if self.drafter:
            feats.append(f"drafter={self.drafter}")
            if not self.pipeline:
                feats.append("pipeline=False")
        if self.kv_bits:
            feats.append(f"kv_bits={self.kv_bits}")
        if self.batch > 1:
            feats.append(f"batch={self.batch}")
        return (f"case seed {self.seed}: {', '.join(feats)}, prompt {self.prompt}, max_tokens {self.max_tokens}; "
                f"replay with ScriptedPolicy({self.decisions!r})")


def draw_case(seed: int, verifiers: list[str]) -> Case:
    r = random.Random(seed)
    V = 64
    base = [r.randrange(1, V) for _ in range(r.randrange(2, 14))]
    prompt = base * r.choice((1, 2, 3))  # repeats: the context source finds continuations
    verifier = r.choice(verifiers)
    if verifier == "tiny_json":  # JSON-like text, pairs included, so the sources draft keys beside values
        j = random.Random(seed + 1)
        base = [j.choice(JSON_PROMPT_IDS) for _ in range(len(base))]
        prompt = base * (len(prompt) // len(base))
    # Drawn apart, so the features drawn above stay those of earlier runs' seeds.
    corpus = verifier in ("tiny", "tiny_json") and random.Random(seed + 13).random() < 0.35
    rk = random.Random(seed + 29)
    ranked = rk.choice(({}, {"runner_ups": rk.randint(1, 4), "draft_floor": rk.choice((0.0, 0.2, 0.6))}))
    case = Case(
        corpus=corpus,
        seed=seed,
        verifier=verifier,
        greedy=r.random() < 0.6,
        grammar=r.choice(GRAMMARS if verifier == "tiny" else JSON_GRAMMARS if verifier == "tiny_json" else
                         LETTER_GRAMMARS) if r.random() < (0.8 if verifier == "tiny_json" else 0.4) else None,
        penalties=r.choice(({}, {}, {"presence_penalty": 0.5}, {"frequency_penalty": 0.8},
                             {"repetition_penalty": 1.3})),
        prefix_warm=r.random() < 0.3,
        history_warm=r.random() < 0.3,
        kv_bits=8 if verifier == "tiny" and r.random() < 0.15 else None,
        batch=r.choice((1, 1, 1, 3)),
        drafter=r.choice(("model", "dflash", "int8")) if verifier == "tiny" and r.random() < 0.35 else None,
        prompt=prompt,
        max_tokens=r.randrange(8, 40),
    )
    if case.drafter == "model":
        case.ranked = ranked
    case.pipeline = random.Random(seed + 41).random() < 0.7  # drawn apart, as above
    return case


class Verifiers:
    """Engines per (verifier, kv_bits), built once; a fresh engine state per case."""

    def __init__(self, hybrids: dict | None = None, tmp=None):
        self.hybrids = hybrids or {}  # name -> loaded edgespec engine's LoadedModel
        self.tmp = tmp  # a folder for the DFlash drafter's files
        self._models: dict = {}

    def loaded(self, name: str) -> LoadedModel:
        if name == "tiny_json":
            if name not in self._models:
                tok = make_json_tokenizer()
                m = make_tiny_model(0, scale=3.0, vocab_size=tok.vocab_size)
                self._models[name] = LoadedModel(m, tok, None)
            return self._models[name]
        if name in ("tiny", "tiny_q", "tiny_dflash"):
            if name not in self._models:
                # tiny_q: head size 32, so its KV cache can be quantized (groups of 32); tiny_dflash:
                # its own model (a DFlash drafter makes the verifier record target layers' states)
                m = {"tiny": lambda: make_tiny_model(0, scale=3.0),
                     "tiny_q": lambda: make_tiny_model(0, scale=3.0, hidden_size=128, num_attention_heads=4),
                     "tiny_dflash": lambda: make_tiny_model(0, scale=3.0, num_hidden_layers=4)}[name]()
                self._models[name] = LoadedModel(m, make_tiny_tokenizer(m.args.vocab_size), None)
            return self._models[name]
        return self.hybrids[name]

    def engine(self, case: Case) -> Engine:
        from edgespec.drafters.base import ModelDrafter

        dflash = case.drafter == "dflash" and not case.kv_bits
        loaded = self.loaded("tiny_q" if case.kv_bits else "tiny_dflash" if dflash else case.verifier)
        eng = Engine(loaded, history="memory" if case.history_warm else "off",
                     prompt_cache_bytes=(64 << 20) if case.prefix_warm else 0, kv_bits=case.kv_bits,
                     kv_group_size=32, quantized_kv_start=0, check_exact=True,
                     corpus=self._corpus(case.verifier, loaded) if case.corpus else "off")
        if dflash:
            eng.drafter = self._dflash(loaded)
        elif case.drafter == "int8" and case.verifier == "tiny":
            from edgespec.drafters.quantized import QuantizedDrafter, quantize_model

            key = f"int8-{id(loaded)}"
            if key not in self._models:
                self._models[key] = quantize_model(loaded.model)
            eng.drafter = QuantizedDrafter(loaded.model, self._models[key])
        elif case.drafter and case.verifier == "tiny":
            if "drafter" not in self._models:
                self._models["drafter"] = make_tiny_model(5, scale=3.0, num_hidden_layers=1)

            class FuzzDrafter(ModelDrafter):
                name = "fuzz"

            eng.drafter = FuzzDrafter(self._models["drafter"])
        return eng


    def _corpus(self, name: str, loaded):
        """A corpus table of the verifier's own greedy replies to 24 prompts drawn like the
        cases' (repeated bases), so its chains agree with the verifier as often as a real one's."""
        key = f"corpus-{name}"
        if key not in self._models:
            from edgespec.adaptive.corpus import CorpusTable

            eng = Engine(loaded, history="off", prompt_cache_bytes=0)
            r = random.Random(99)
            ids = JSON_PROMPT_IDS if name == "tiny_json" else range(1, 64)
            docs = []
            for _ in range(24):
                base = [r.choice(ids) for _ in range(r.randrange(2, 10))]
                prompt = base * r.choice((1, 2))
                docs.append(prompt + eng.generate(prompt, max_tokens=32, mode="plain").tokens)
            self._models[key] = CorpusTable.build(docs)
        return self._models[key]

    def _dflash(self, loaded):
        """A random DFlash block drafter (tests/test_dflash.write_random) for the tiny_dflash model."""
        if "dflash" not in self._models:
            import tempfile
            from pathlib import Path

            from test_dflash import write_random

            from edgespec.drafters.dflash import load_dflash

            folder = Path(self.tmp or tempfile.mkdtemp()) / "fuzz-dflash"
            write_random(folder, target_ids=(1, 3), block=8, vocab=loaded.model.args.vocab_size,
                         mask=loaded.model.args.vocab_size - 1)
            self._models["dflash"] = load_dflash(folder, loaded)
        return self._models["dflash"]


def _options(case: Case, mode: str, logprobs: int | None = None, **mode_options) -> dict:
    if mode in ("auto", "adaptive"):
        mode_options = {**case.ranked, **({} if case.pipeline else {"pipeline": False}), **mode_options}
    o = dict(max_tokens=case.max_tokens, mode=mode, response_format=case.grammar, **case.penalties, **mode_options)
    if not case.greedy:
        o.update(temperature=1.0, seed=1000 + case.seed)
    if logprobs is not None:
        o["logprobs"] = logprobs
    return o


def _prompts(case: Case) -> list[list[int]]:
    r = random.Random(case.seed + 7)
    others = [[r.randrange(1, 64) for _ in range(r.randrange(2, 12))] for _ in range(case.batch - 1)]
    return [case.prompt] + others


def _warm(eng: Engine, case: Case) -> None:
    """Fill the prefix cache and the history with what an earlier request left there."""
    if case.prefix_warm or case.history_warm:
        eng.generate(case.prompt, max_tokens=case.max_tokens, mode="plain")


def classify(eng: Engine, case: Case, plain: list[int], got: list[int]) -> tuple[str, str]:
    """('near-tie' | 'error', detail) for the first position where `got` leaves `plain`."""
    k = next((i for i, (a, b) in enumerate(zip(plain, got, strict=False)) if a != b), None)
    if k is None:  # one is a prefix of the other: a stop decided differently
        return "error", f"lengths differ ({len(plain)} vs {len(got)}) with a common prefix"
    ref = eng.generate(case.prompt, **_options(case, "plain", logprobs=20))
    lp = ref.logprobs[k]
    table = dict(lp.top)
    a, b = plain[k], got[k]
    if b not in table:
        return "error", f"at reply token {k}: {b} is not among plain's 20 most likely ({a} is)"
    sa, sb = table[a], table[b]
    if not case.greedy:
        noise = np.array(Sampler(SamplingParams(temperature=1.0, seed=1000 + case.seed)).position_noise(
            [len(case.prompt) + k], eng.model.args.vocab_size)[0])
        sa, sb = sa + float(noise[a]), sb + float(noise[b])
    gap = sa - sb
    kind = "near-tie" if abs(gap) < TOL else "error"
    return kind, f"at reply token {k}: plain {a} ({sa:.6f}) vs {b} ({sb:.6f}), gap {gap:.2e}"


@dataclass
class Report:
    cases: int = 0
    compared_tokens: int = 0
    near_ties: list = field(default_factory=list)
    errors: list = field(default_factory=list)
    coverage: dict = field(default_factory=dict)


def run_case(verifiers: Verifiers, case: Case, mode: str = "auto", **mode_options) -> tuple[str, str] | None:
    """None when `mode` (with `mode_options`) under the case's seeded decisions equals plain; else
    the classification."""
    eng = verifiers.engine(case)
    prompts = _prompts(case)
    _warm(eng, case)
    if case.batch > 1:
        plain = [r.tokens for r in eng.generate_many(prompts, **_options(case, "plain"))]
    else:
        plain = [eng.generate(case.prompt, **_options(case, "plain")).tokens]
    _warm(eng, case)  # the same state the plain run saw (history now also holds plain's reply)
    policy = SeededPolicy(case.seed)
    eng.policy = policy
    try:
        if case.batch > 1:
            got = [r.tokens for r in eng.generate_many(prompts, **_options(case, mode, **mode_options))]
        else:
            got = [eng.generate(case.prompt, **_options(case, mode, **mode_options)).tokens]
        if case.prefix_warm and case.batch == 1 and got[0]:
            # The conversation goes on: its next request restores the blocks this reply
            # committed to the prefix cache, which the guard's replay checks against empty
            # caches (keys and values stored for the wrong tokens would fail there).
            eng.generate(case.prompt + got[0], **_options(case, mode, **mode_options))
    finally:
        eng.policy = None
        case.decisions = policy.decisions
    if got[0] != plain[0]:
        return classify(eng, case, plain[0], got[0])
    for i, (p, g) in enumerate(zip(plain[1:], got[1:], strict=True), 1):
        if p != g:
            return "error", f"batch row {i} differs from its plain run"
    return None


def run_cases(verifiers: Verifiers, seeds, names: list[str], mode: str = "auto") -> Report:
    rep = Report()
    for seed in seeds:
        case = draw_case(seed, names)
        for key in ("verifier", "greedy", "prefix_warm", "history_warm", "kv_bits", "batch", "drafter", "corpus",
                    "pipeline"):
            v = getattr(case, key)
            rep.coverage[f"{key}={v}"] = rep.coverage.get(f"{key}={v}", 0) + 1
        rep.coverage[f"grammar={bool(case.grammar)}"] = rep.coverage.get(f"grammar={bool(case.grammar)}", 0) + 1
        rep.coverage[f"penalties={bool(case.penalties)}"] = rep.coverage.get(f"penalties={bool(case.penalties)}", 0) + 1
        try:
            out = run_case(verifiers, case, mode)
        except AssertionError as e:  # the runtime guard (ExactnessError) or a decoder assertion
            out = ("error", f"{type(e).__name__}: {e}")
        rep.cases += 1
        rep.compared_tokens += case.max_tokens
        for kind in ("pipeline", "runner_up"):  # seeded choices to draft ahead, and from a runner-up too
            n = sum(1 for d in case.decisions if d[0] == kind and d[1] is True)
            if n:
                rep.coverage[f"{kind} chosen (rounds)"] = rep.coverage.get(f"{kind} chosen (rounds)", 0) + n
        if out is None:
            continue
        kind, detail = out
        (rep.near_ties if kind == "near-tie" else rep.errors).append(f"{detail}\n  {case.describe()}")
    mx.clear_cache()
    return rep
