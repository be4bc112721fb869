"""The gated delta rule position by position in MLX: the reference every kernel of it is checked
against (edgespec.kernels.delta on Metal, edgespec.kernels.cpu_delta on the CPU), and what
edgespec.caches.recurrent runs where neither applies."""

from __future__ import annotations

import mlx.core as mx


def delta_step(S: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array) -> mx.array:
    """One position of the gated delta rule: S (B, H, Dk, Dv), k (B, H, Dk), v (B, H, Dv),
    g, beta (B, H) -> S' = exp(g) S + k (beta (v - k^T exp(g) S))^T."""
    S = S * mx.exp(g)[..., None, None]
    mem = (k[..., None, :] @ S)[..., 0, :]  # (B, H, Dv)
    delta = (v - mem) * beta[..., None]
    return S + k[..., :, None] * delta[..., None, :]


def delta_recurrent(q, k, v, g, beta, S, parents: list[int] | None = None):
    """Position by position: q, k (B, T, H, Dk), v (B, T, H, Dv), g, beta (B, T, H), S (B, H, Dk, Dv)
    -> outputs (B, T, H, Dv), state after the last position. A tree runs each node from its
    parent's state."""
    T = q.shape[1]
    # A tree keeps only the states some later node branches from (a node whose parent is the
    # position before it continues from `cur`): the rest are freed as the chain goes on.
    kept = set() if parents is None else {p for t, p in enumerate(parents) if p >= 0 and p != t - 1}
    states, outs, cur = {}, [], S
    for t in range(T):
        if parents is None or parents[t] == t - 1:
            prev = cur
        else:
            prev = S if parents[t] < 0 else states[parents[t]]
        cur = delta_step(prev, k[:, t], v[:, t], g[:, t], beta[:, t])
        outs.append((q[:, t, :, None, :] @ cur)[:, :, 0, :])
        if t in kept:
            states[t] = cur
    return mx.stack(outs, axis=1), cur
