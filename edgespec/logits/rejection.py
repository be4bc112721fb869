"""Speculative sampling's accept/resample rule: one pure function, in log space.

Draft x_i ~ q_i is kept iff u_i < p_i(x_i) / q_i(x_i), i.e. log u_i < log p_i(x_i) - log q_i(x_i).
At the first rejection i the token is drawn from normalize(max(0, p_i - q_i)); if
all k drafts are kept a bonus token is drawn from p_k. The emitted tokens are then
distributed exactly as sampling from p (Leviathan et al. 2023; Chen et al. 2023).
Greedy p and q are one-hot, so the rule reduces to "keep while argmaxes match,
then emit the verifier's argmax".
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

NEG_INF = float("-inf")


def residual_logprobs(p: mx.array, q: mx.array) -> mx.array:
    """log normalize(max(0, exp p - exp q)) row-wise; (..., V) -> (..., V).

    log(e^p - e^q) = p + log1p(-e^(q-p)) where p > q, else -inf. A row whose
    residual is empty (p == q, only reachable through rounding) falls back to p.
    """
    r = mx.where(p > q, p + mx.log1p(-mx.exp(mx.minimum(q - p, 0.0))), NEG_INF)
    norm = mx.logsumexp(r, axis=-1, keepdims=True)
    empty = mx.isinf(norm)  # -inf: nothing left
    return mx.where(empty, p, r - mx.where(empty, 0.0, norm))


def point_mass_logprobs(tokens: mx.array, vocab_size: int) -> mx.array:
    """(k,) token ids -> (k, V) log-probs of a point mass on each (0 at the token, -inf elsewhere)."""
    return mx.where(mx.arange(vocab_size)[None, :] == tokens[:, None], 0.0, NEG_INF)


def _categorical(probs: np.ndarray, u: float) -> int:
    """Inverse-CDF draw from unnormalised probabilities (V,) with one uniform u in [0, 1)."""
    cdf = np.cumsum(probs)
    return int(min(np.searchsorted(cdf, u * cdf[-1], side="right"), len(probs) - 1))


def rejection_sample(
    draft_tokens: list[int] | mx.array,
    q_logprobs: mx.array | None,
    p_logprobs: mx.array,
    key: mx.array,
) -> tuple[int, int]:
    """Accept a prefix of the draft and pick the token that follows it.

    draft_tokens: (k,) proposed ids; q_logprobs: (k, V) drafter log-probs the drafts
    were sampled from, or None for deterministic proposals (q = point mass);
    p_logprobs: (k+1, V) verifier log-probs at the k draft positions plus the one
    after them; key: a PRNG key (gives the k acceptance uniforms and the final draw).
    Both distributions must come from the same SamplingParams transform.
    Returns (n_accepted in 0..k, next_token): the correction at the first
    rejected position, or the bonus token drawn from p_k when all k are kept.
    """
    x = draft_tokens if isinstance(draft_tokens, mx.array) else mx.array(list(draft_tokens), dtype=mx.int32)
    k = int(x.shape[0])
    V = p_logprobs.shape[-1]
    if p_logprobs.shape[0] != k + 1:
        raise ValueError(f"p_logprobs must have k+1 = {k + 1} rows, got {p_logprobs.shape[0]}")
    if q_logprobs is not None and q_logprobs.shape != (k, V):
        raise ValueError(f"q_logprobs must have shape {(k, V)}, got {q_logprobs.shape}")
    u = mx.random.uniform(shape=(k + 1,), key=key)  # u[:k] acceptance tests, u[k] the final draw
    if k:
        idx = x.astype(mx.int32)[:, None]
        p_x = mx.take_along_axis(p_logprobs[:k], idx, axis=1)[:, 0]  # (k,)
        q_x = mx.take_along_axis(q_logprobs, idx, axis=1)[:, 0] if q_logprobs is not None else mx.zeros((k,))
        # NaN (p_x = q_x = -inf: a proposal outside both supports) compares False: rejected.
        keep = mx.log(u[:k]) < p_x - q_x
        mx.eval(keep, u)
        keep = np.array(keep)
        n = int(np.argmin(keep)) if not keep.all() else k
    else:
        mx.eval(u)
        n = 0
    u_last = float(np.array(u)[k])
    # Only one row's full distribution is ever needed, computed on the host in float64
    # (MLX's CPU transcendental kernels are slow over a 50k vocabulary).
    p_row = np.exp(np.array(p_logprobs[n], dtype=np.float64))
    if n < k:
        if q_logprobs is None:
            q_row = np.zeros(V)
            q_row[int(np.array(x)[n])] = 1.0
        else:
            q_row = np.exp(np.array(q_logprobs[n], dtype=np.float64))
        resid = np.maximum(p_row - q_row, 0.0)  # normalize(max(0, p - q))
        if resid.sum() > 0:  # empty only through rounding when p == q: use p
            p_row = resid
    return n, _categorical(p_row, u_last)
