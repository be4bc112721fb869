"""Reduced output vocabulary: the drafter predicts only the N tokens the verifier emits most.

Why: the verifier's LM head (V x E = 49152 x 576) costs about as much as 8 of its 30
layers; a drafter with the full head could never be cheap. With a reduced vocab
slot 0 is "other" (every token outside the set) and slots 1..N-1 are the kept full
ids. At draft time the drafter's q is expanded to the full vocabulary with q = 0
(log q = -inf) outside the set and for "other": rejection sampling stays exact,
because the verifier's residual distribution covers every token q gives no mass.

On disk: vocab_map.json (see edgespec.drafters.distilled.VocabMap).
"""

from __future__ import annotations

import numpy as np

from edgespec.drafters.distilled import OTHER, VOCAB_MAP, VocabMap  # noqa: F401  (re-exported)


def token_counts(examples, full_vocab: int) -> np.ndarray:
    """(V,) how often each id is a target (the verifier's greedy tokens) or in its top-k.

    Targets count fully; other top-k entries add their probability, so tokens the
    verifier often considers (but does not pick) are kept too.
    """
    counts = np.zeros(full_vocab, np.float64)
    for e in examples:
        np.add.at(counts, e.topk_ids[:, 0], 1.0)
        np.add.at(counts, e.topk_ids[:, 1:].ravel(), np.exp(e.topk_lp[:, 1:].astype(np.float64)).ravel())
        np.add.at(counts, e.tokens[: e.start], 0.05)  # prompt tokens: weak prior
    return counts


def choose_vocab(counts: np.ndarray, n: int, always: list[int] = ()) -> np.ndarray:
    """Reduced id -> full id (n,), slot 0 = -1 ("other"); `always` ids (EOS...) are kept."""
    if n < 2:
        raise ValueError(f"reduced vocabulary size must be >= 2, got {n}")
    n = min(n, len(counts) + 1)
    keep = [int(i) for i in always]
    order = np.argsort(-counts, kind="stable")
    for i in order:
        if len(keep) >= n - 1:
            break
        if int(i) not in keep:
            keep.append(int(i))
    return np.array([-1] + keep, np.int64)
