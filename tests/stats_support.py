"""Statistics shared by the distribution tests."""

import itertools

import mlx.core as mx
import numpy as np
from scipy.stats import chi2

from edgespec.generate import GenerationStats
from edgespec.logits.sampling import Sampler, SamplingParams, logprobs_from_logits


def chisq_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson chi-square p-value, pooling cells with expected count < 5 into one."""
    n = counts.sum()
    exp = probs * n
    small = exp < 5
    obs_c = np.append(counts[~small], counts[small].sum())
    exp_c = np.append(exp[~small], exp[small].sum())
    keep = exp_c > 0
    stat = float(((obs_c[keep] - exp_c[keep]) ** 2 / exp_c[keep]).sum())
    return float(chi2.sf(stat, int(keep.sum()) - 1))


def adaptive_continuations(engine, prompt, opts, params: dict, n: int, runs: int):
    """(Counter of the first n sampled tokens, tokens accepted) over seeds 0..runs-1 of mode
    `adaptive` with options `opts`, each run from the priors (its learnt memory cleared)."""
    from collections import Counter

    from edgespec.modes import make_mode

    counts, accepted = Counter(), 0
    for seed in range(runs):
        engine.memory.adaptive.clear()  # every run starts from the priors: trees early on
        mode = make_mode("adaptive", engine, opts)
        stats = GenerationStats()
        it = mode.steps(prompt, Sampler(SamplingParams(**params, seed=seed)), stats)
        counts[tuple(t.id for t in itertools.islice(it, n))] += 1
        it.close()
        accepted += stats.accepted
    return counts, accepted


def continuation_law(model, prompt, params, n):
    """Exact law {tokens: probability} of the first n sampled tokens under plain decoding (enumerated)."""
    law = {}

    def rec(prefix, prob):
        if len(prefix) == n:
            law[tuple(prefix)] = prob
            return
        logits = model(mx.array([prompt + prefix], dtype=mx.int32))[0, -1]
        p = np.exp(np.array(logprobs_from_logits(logits, params), dtype=np.float64))
        for t in np.nonzero(p > 0)[0]:
            rec(prefix + [int(t)], prob * p[t])

    rec([], 1.0)
    return law


def continuation_counts(mode, prompt, params: dict, keys: list, runs: int, n: int) -> tuple[np.ndarray, int]:
    """Counts over `keys` of the first n tokens of `mode` sampled with seeds 0..runs-1, and drafts accepted."""
    counts, accepted = np.zeros(len(keys)), 0
    for seed in range(runs):
        stats = GenerationStats()
        it = mode.steps(prompt, Sampler(SamplingParams(**params, seed=seed)), stats)
        counts[keys.index(tuple(t.id for t in itertools.islice(it, n)))] += 1
        it.close()
        accepted += stats.accepted
    return counts, accepted
