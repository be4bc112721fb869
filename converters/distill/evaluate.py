"""Measure a drafter: held-out greedy acceptance at K, and draft cost vs a verifier step.

Acceptance is simulated exactly from the verifier's greedy continuations (the
data builder's output on held-out prompts): with greedy decoding the committed
sequence *is* the verifier's greedy path, so each round the drafter proposes K
tokens from that prefix, the matching prefix a is accepted and the verifier's
own next token follows; a round costs K drafted tokens. No verifier pass needed.
"""

from __future__ import annotations

import time
from collections import defaultdict

import mlx.core as mx
import numpy as np
from edgespec.converters.distill.features import hidden_features

from edgespec.logits.sampling import Sampler, SamplingParams


def acceptance(drafter, examples, k: int = 4, features=None) -> dict[str, dict[str, float]]:
    """Per domain (and "all"): {"accepted", "drafted", "rate", "tokens_per_round"}.

    features: for a drafter that reads verifier features (FeatureDrafter), features[i]
    (L, E) along example i's tokens, teacher-forced. On the greedy path the committed
    sequence is the verifier's own, so these are the features a real run hands over (up
    to float rounding between a full pass and incremental ones)."""
    greedy = Sampler(SamplingParams(temperature=0.0))
    acc, dra, rounds = defaultdict(int), defaultdict(int), defaultdict(int)
    for i, e in enumerate(examples):
        toks = [int(t) for t in e.tokens]
        pos = e.start + 1  # the verifier's first token comes from its prefill
        if pos >= len(toks):
            continue
        drafter.begin(toks[:pos])
        f = mx.array(np.asarray(features[i], np.float32)) if features is not None else None
        while pos < len(toks):
            need = drafter.features_needed() if f is not None else 0
            if need:
                drafter.add_features(f[pos - 1 - need : pos - 1])
            n = min(k, len(toks) - pos)
            prop = drafter.draft(n, greedy).tokens
            a = 0
            while a < len(prop) and prop[a] == toks[pos + a]:
                a += 1
            for dom in (e.domain, "all"):
                acc[dom] += a
                dra[dom] += len(prop)
                rounds[dom] += 1
            if pos + a >= len(toks):
                break
            drafter.accept(a, toks[pos + a])
            pos += a + 1
    return {
        d: {"accepted": acc[d], "drafted": dra[d], "rate": acc[d] / max(1, dra[d]),
            "tokens_per_round": (acc[d] + rounds[d]) / max(1, rounds[d])}
        for d in dra
    }


def greedy_matches(model, vocab_map, tokens: list[int]) -> np.ndarray:
    """(L,) bool: m[t] = the drafter's greedy choice given tokens[:t] equals tokens[t] (m[0] False).

    One teacher-forced pass of the reduced model; "other" never wins, as in
    DistilledDrafter whose expanded q gives it -inf.
    """
    x = mx.array(vocab_map.to_reduced[np.asarray(tokens)][None].astype(np.int32))
    logits = model(x)[0, :-1, 1:]  # (L-1, N-1): slot 0 ("other") excluded
    pred = vocab_map.ids[1:][np.array(mx.argmax(logits, axis=-1))]
    return np.concatenate([[False], pred == np.asarray(tokens[1:])])


def acceptance_fast(model, vocab_map, examples, k: int = 4) -> dict[str, dict[str, float]]:
    """Same numbers as `acceptance` for greedy decoding, from one pass per example.

    Exact because a drafted token only counts if every earlier one in its round
    matched, and then its context is the verifier's own prefix: the j-th proposal
    of a round at `pos` is accepted iff m[pos..pos+j] are all True.
    """
    acc, dra, rounds = defaultdict(int), defaultdict(int), defaultdict(int)
    for e in examples:
        toks = [int(t) for t in e.tokens]
        m = greedy_matches(model, vocab_map, toks)
        pos = e.start + 1
        while pos < len(toks):
            n = min(k, len(toks) - pos)
            a = 0
            while a < n and m[pos + a]:
                a += 1
            for dom in (e.domain, "all"):
                acc[dom] += a
                dra[dom] += n
                rounds[dom] += 1
            pos += a + 1
    return {
        d: {"accepted": acc[d], "drafted": dra[d], "rate": acc[d] / max(1, dra[d]),
            "tokens_per_round": (acc[d] + rounds[d]) / max(1, rounds[d])}
        for d in dra
    }


def _median_time(fn, repeats: int) -> float:
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return float(np.median(ts))


def draft_cost(verifier, drafter, context: list[int], k: int = 4, repeats: int = 20) -> dict[str, float]:
    """Seconds per drafter step (draft of k tokens / k) vs one verifier decode step and
    one verify pass of k+1 tokens, measured interleaved at the same context length."""
    greedy = Sampler(SamplingParams(temperature=0.0))
    cache = verifier.make_cache()
    mx.eval(verifier(mx.array([context]), cache=cache))
    drafter.begin(context)
    if drafter.caps.needs_features:
        drafter.add_features(hidden_features(verifier, mx.array([context]))[0, :-1].astype(mx.float32))
    drafter.draft(k, greedy)
    drafter.sync(list(context))

    def verify(n):
        out = verifier(mx.array([context[-n:]]), cache=cache)
        mx.eval(out)
        for c in cache:
            c.trim(n)

    def draft():
        d = drafter.draft(k, greedy)
        drafter.accept(0, d.tokens[0])
        drafter.sync(drafter.seq[:-1])  # back to the same context for the next repeat

    res = defaultdict(list)
    for _ in range(3):  # interleave so both see the same machine load
        res["verifier_step_s"].append(_median_time(lambda: verify(1), repeats))
        res["verify_pass_s"].append(_median_time(lambda: verify(k + 1), repeats))
        res["draft_step_s"].append(_median_time(draft, repeats) / k)
    out = {key: float(np.median(v)) for key, v in res.items()}
    out["ratio_step"] = out["draft_step_s"] / out["verifier_step_s"]
    out["ratio_pass"] = out["draft_step_s"] / out["verify_pass_s"]
    return out
