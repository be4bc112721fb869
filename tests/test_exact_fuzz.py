"""Exactness under seeded random decisions: `auto` equals plain in every feature (tests/exact_fuzz.py).

CI runs FUZZ_CASES cases on the tiny dense model and a few on tiny hybrids (recurrent layers);
`EDGESPEC_FUZZ_CASES=N` runs N instead (the long budget: docs/exactness.md).
"""

from __future__ import annotations

import os

import pytest
from exact_fuzz import Verifiers, run_cases

import edgespec.logits.processors as processors

FUZZ_CASES = int(os.environ.get("EDGESPEC_FUZZ_CASES", "40"))


@pytest.fixture(scope="module")
def verifiers(tmp_path_factory):
    return Verifiers(tmp=tmp_path_factory.mktemp("fuzz"))


def _report(rep) -> str:
    cov = ", ".join(f"{k} {v}" for k, v in sorted(rep.coverage.items()))
    return (f"{rep.cases} cases, {len(rep.errors)} errors, {len(rep.near_ties)} near-ties; coverage: {cov}"
            + "".join("\nERROR " + e for e in rep.errors[:5]) + "".join("\nnear-tie " + t for t in rep.near_ties[:5]))


def test_auto_equals_plain_under_seeded_decisions(verifiers):
    rep = run_cases(verifiers, range(FUZZ_CASES), ["tiny"])
    print(_report(rep))
    assert rep.cases == FUZZ_CASES
    assert not rep.errors, _report(rep)
    # The cases cover every feature at least once.
    for key in ("grammar=True", "penalties=True", "prefix_warm=True", "history_warm=True", "kv_bits=8",
                "batch=3", "drafter=model", "drafter=dflash", "drafter=int8", "greedy=False", "corpus=True"):
        assert rep.coverage.get(key, 0) > 0, key


def test_auto_equals_plain_on_json_schemas_under_seeded_decisions(verifiers):
    """JSON schemas (open objects, arrays of objects or arrays) on a tokenizer with JSON's
    punctuation pairs: sibling rows drafting a key and a value at one position (issue 42)."""
    n = max(12, FUZZ_CASES // 4)
    rep = run_cases(verifiers, range(30_000, 30_000 + n), ["tiny_json"])
    print(_report(rep))
    assert not rep.errors, _report(rep)
    assert rep.coverage.get("grammar=True", 0) >= n // 2


@pytest.fixture(scope="module")
def hybrid_verifiers(tmp_path_factory):
    pytest.importorskip("transformers")
    from test_recurrent import ARCHS, hf_hybrid

    import edgespec

    loaded = {}
    for arch in ARCHS:
        folder = tmp_path_factory.mktemp(f"fuzz-{arch}")
        hf_hybrid(folder, arch)
        loaded[arch] = edgespec.load(folder, drafter="none", progress=False, history="off").loaded
    return Verifiers(loaded), list(ARCHS)


def test_auto_equals_plain_on_recurrent_verifiers_under_seeded_decisions(hybrid_verifiers):
    verifiers, names = hybrid_verifiers
    n = max(6, FUZZ_CASES // 6)
    rep = run_cases(verifiers, range(10_000, 10_000 + n), names)
    print(_report(rep))
    assert not rep.errors, _report(rep)
    assert all(rep.coverage.get(f"verifier={a}", 0) > 0 for a in names)


# Modes tree, lookahead and speculative (and prompt_lookup, cascade: the same loop) take their
# timed choices from the engine's policy too: step kinds, dynamic tree sizes, draft lengths and
# fallbacks to plain steps. Greedy only: mode speculative's rejection sampling keeps plain's
# distribution, not its seeded tokens.
SEEDED_MODES = {
    "tree": (lambda c: c.drafter == "model", lambda c: {"sources": "drafter+prompt_lookup+pool"},
             ("step", "tree_size")),
    "lookahead": (lambda c: True, lambda c: {}, ("step",)),
    "speculative": (lambda c: c.drafter is not None, lambda c: {}, ("spec_k",)),
}


@pytest.mark.parametrize("mode", list(SEEDED_MODES))
def test_every_timed_mode_equals_plain_under_seeded_decisions(verifiers, mode):
    from exact_fuzz import draw_case, run_case

    fits, options, kinds = SEEDED_MODES[mode]
    n = max(16, FUZZ_CASES // 2)
    cases, seed = [], 20_000
    while len(cases) < n:  # as many seeds as it takes (EDGESPEC_FUZZ_CASES may ask thousands)
        c = draw_case(seed, ["tiny"])
        seed += 1
        if c.greedy and c.batch == 1 and fits(c):
            cases.append(c)
    seen: dict[tuple, int] = {}
    bad = []
    for case in cases:
        out = run_case(verifiers, case, mode, **options(case))
        if out is not None:
            bad.append(f"{out}\n  {case.describe()}")
        for d in case.decisions:
            if d[0] in kinds:
                key = (d[0], d[1]) if d[0] == "step" else (d[0], min(d[1], 1))
                seen[key] = seen.get(key, 0) + 1
    print(mode, len(cases), "cases; decisions", seen)
    assert len(cases) == n and not bad, "\n".join(bad[:5])
    # The policy was asked, and its answers covered the choices (plain steps among them).
    want = {"step": [("step", "plain"), ("step", "full")], "tree_size": [("tree_size", 0), ("tree_size", 1)],
            "spec_k": [("spec_k", 0), ("spec_k", 1)]}
    for kind in kinds:
        for key in want[kind]:
            assert seen.get(key, 0) > 0, (key, seen)


def test_the_fuzzer_catches_a_grammar_state_built_from_the_parent_path(verifiers, monkeypatch):
    """Mutation: each row's grammar mask computed after its path minus the last token."""
    real = processors.GrammarProcessor.process

    def parent_path(self, logits, committed, paths):
        return real(self, logits, committed, [p[:-1] if p else p for p in paths])

    monkeypatch.setattr(processors.GrammarProcessor, "process", parent_path)
    seeds = [s for s in range(200) if __import__("exact_fuzz").draw_case(s, ["tiny"]).grammar][:6]
    rep = run_cases(verifiers, seeds, ["tiny"])
    assert rep.errors, _report(rep)


def test_the_fuzzer_catches_a_row_read_from_another_node(verifiers, monkeypatch):
    """Mutation: the tree's draws read the logits of the node before (rows shifted by one)."""
    import mlx.core as mx

    import edgespec.adaptive.decoder as dec

    real = dec.draw_tokens

    def shifted(logits, parents, position, sampler):
        if logits.shape[0] > 2:
            logits = mx.concatenate([logits[:1], logits[:1], logits[2:]], axis=0)
        return real(logits, parents, position, sampler)

    monkeypatch.setattr(dec, "draw_tokens", shifted)
    rep = run_cases(verifiers, range(12), ["tiny"])
    assert rep.errors, _report(rep)


def test_the_guard_catches_keys_and_values_restored_for_other_tokens(verifiers, monkeypatch):
    """Mutation: the prefix cache restores each block's values in reverse order (keys in order:
    reversing both would only permute the sum attention takes), so every request that reuses a prefix (plain's too: the fuzzer's comparison cannot see it)
    attends to keys and values of other tokens. Only the guard's replay, from empty caches of
    its own, can tell (edgespec/logits/exactness.py)."""
    import exact_fuzz

    from edgespec.batch.arena import SlotCache
    from edgespec.caches.kv import KVCache
    from edgespec.caches.prefix import BLOCK

    for cls in (KVCache, SlotCache):  # alone, and a request of the batch
        def reversed_span(self, parts, real=cls.import_span):
            k, v = parts
            return real(self, (k, v[..., ::-1, :]))

        monkeypatch.setattr(cls, "import_span", reversed_span)
    seeds = [s for s in range(400)
             if (c := exact_fuzz.draw_case(s, ["tiny"])).prefix_warm and c.greedy and c.kv_bits is None
             and c.batch == 1 and len(c.prompt) > BLOCK][:4]
    assert seeds
    rep = run_cases(verifiers, seeds, ["tiny"])
    assert rep.errors and all("replayed" in e for e in rep.errors), _report(rep)
