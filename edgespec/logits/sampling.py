"""Sampling settings and the logits -> log-probabilities transform shared by every mode.

Every decoding mode turns raw logits into the *same* filtered, normalised
log-probabilities with `logprobs_from_logits`, for the verifier and the drafter
alike. Rejection sampling compares those two distributions, so the output
follows exactly the distribution plain sampling draws from under the same
temperature / top-k / top-p / min-p. Greedy (temperature 0) is the one-hot limit.
"""

from __future__ import annotations

import hashlib
import math
import os
from dataclasses import dataclass

import mlx.core as mx

NEG_INF = float("-inf")
GREEDY_BELOW = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off
    seed: int | None = None

    def __post_init__(self):
        t = self.temperature
        if not isinstance(t, (int, float)) or isinstance(t, bool) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {t!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        p = self.top_p
        if not isinstance(p, (int, float)) or isinstance(p, bool) or not (0 < p <= 1):
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {p!r}")
        m = self.min_p
        if not isinstance(m, (int, float)) or isinstance(m, bool) or not (0 <= m < 1):
            raise ValueError(f"min_p must be in [0, 1) (0 = off), got {m!r}")
        if self.seed is not None and (
            not isinstance(self.seed, int) or isinstance(self.seed, bool) or not 0 <= self.seed < 2**63
        ):
            raise ValueError(f"seed must be an integer in [0, 2**63), got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        # Below this, logits / temperature overflows float32: the limit is greedy anyway.
        return self.temperature < GREEDY_BELOW


def logprobs_from_logits(logits: mx.array, params: SamplingParams) -> mx.array:
    """(..., V) raw logits -> (..., V) normalised log-probs after all filters.

    Filtered tokens get -inf. Greedy returns a one-hot distribution at the
    argmax (log-prob 0 there), so greedy is rejection sampling's limit case.
    """
    logits = logits.astype(mx.float32)
    V = logits.shape[-1]
    if params.greedy:
        best = mx.argmax(logits, axis=-1, keepdims=True)
        onehot = mx.arange(V) == best
        return mx.where(onehot, 0.0, NEG_INF)
    x = logits / params.temperature
    if params.top_k and params.top_k < V:
        kth = mx.sort(x, axis=-1)[..., V - params.top_k : V - params.top_k + 1]
        x = mx.where(x >= kth, x, NEG_INF)
    if params.top_p < 1.0:
        # Keep the smallest set of most likely tokens whose mass reaches top_p:
        # a token stays if the mass strictly above it is < top_p.
        lp = x - mx.logsumexp(x, axis=-1, keepdims=True)
        order = mx.argsort(-lp, axis=-1)
        sorted_p = mx.exp(mx.take_along_axis(lp, order, axis=-1))
        mass_before = mx.cumsum(sorted_p, axis=-1) - sorted_p
        keep_sorted = mass_before < params.top_p
        inv = mx.argsort(order, axis=-1)
        keep = mx.take_along_axis(keep_sorted, inv, axis=-1)
        x = mx.where(keep, x, NEG_INF)
    if params.min_p > 0.0:
        top = mx.max(x, axis=-1, keepdims=True)
        x = mx.where(x >= top + math.log(params.min_p), x, NEG_INF)
    return x - mx.logsumexp(x, axis=-1, keepdims=True)


def _position_seed(seed: int, position: int) -> int:
    h = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") >> 1


class Sampler:
    """Draws tokens from log-probs with its own reproducible random stream.

    Two ways to draw: `sample` consumes the sampler's stream in call order;
    `sample_at` draws the token of sequence position i with noise that depends
    only on (seed, i) (Gumbel-max), so any decoder that evaluates position i
    under the same prefix draws the same token: plain decoding and the adaptive
    decoder give identical sampled text for one seed.
    """

    def __init__(self, params: SamplingParams):
        self.params = params
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(4), "little")
        self.seed = seed
        self._key = mx.random.key(seed)

    def next_key(self) -> mx.array:
        self._key, sub = mx.random.split(self._key)
        return sub

    def logprobs(self, logits: mx.array) -> mx.array:
        return logprobs_from_logits(logits, self.params)

    def sample(self, logprobs: mx.array) -> mx.array:
        """(..., V) log-probs -> (...) token ids."""
        if self.params.greedy:
            return mx.argmax(logprobs, axis=-1)
        return mx.random.categorical(logprobs, axis=-1, key=self.next_key())

    def position_noise(self, positions: list[int], vocab_size: int) -> mx.array:
        """(len(positions), V) Gumbel noise, each row a function of (seed, position) only."""
        rows = [mx.random.gumbel(shape=(vocab_size,), key=mx.random.key(_position_seed(self.seed, int(p))))
                for p in positions]
        return mx.stack(rows) if len(rows) > 1 else rows[0][None]

    def sample_at(self, logprobs: mx.array, positions: list[int]) -> mx.array:
        """(T, V) log-probs of positions `positions` -> (T,) tokens (argmax when greedy)."""
        if self.params.greedy:
            return mx.argmax(logprobs, axis=-1)
        return mx.argmax(logprobs + self.position_noise(positions, logprobs.shape[-1]), axis=-1)

    def uniform(self, shape=()) -> mx.array:
        return mx.random.uniform(shape=shape, key=self.next_key())
