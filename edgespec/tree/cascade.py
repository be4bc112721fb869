"""A three-level cascade: a tiny drafter drafts for a mid-size drafter, which drafts for the verifier.

`CascadeDrafter` is an ordinary Drafter for the speculative mode. Asked for k
tokens, it runs speculative decoding of the *mid* model (an MLX ModelDrafter,
e.g. the verifier's own kept layers) with the *tiny* drafter: the tiny one
proposes j tokens, the mid model scores them in one pass and
`rejection_sample` keeps a prefix plus its own correction, until k tokens
exist. Because that inner step is exact, each returned token x_i is
distributed as q_mid(. | committed + x_<i), and the returned log-probs are
exactly those q_mid rows; the verifier then applies the usual rejection rule
against q_mid, so the output is the verifier's distribution end to end
(greedy: the mid model's argmax chain, checked by the verifier's argmax).

Whether the tiny level pays is measured, not assumed: the cascade times
"mid alone" and "tiny + mid" drafting in seconds per returned token (the
returned tokens, and so the verifier's acceptance, have the same law either
way) and uses the faster, probing the other now and then. The speculative
mode's KController above it decides the draft length and falls back to plain
decoding when no drafting pays.
"""

from __future__ import annotations

import copy
import time

import mlx.core as mx

from edgespec.drafters.base import Draft, DrafterCaps, common_prefix, request_drafter
from edgespec.logits.rejection import rejection_sample


class CascadeDrafter:
    device = "cpu"
    caps = DrafterCaps(forks=True)  # each level forks (request_drafter)
    model = None  # its levels hold the weights

    def __init__(self, mid, tiny, inner_k: int = 3, adaptive: bool = True, probe_every: int = 16):
        for what, d in (("mid", mid), ("tiny", tiny)):
            if not d.caps.syncs:
                raise ValueError(f"the cascade's {what} drafter {d.name!r} must support sync()")
        if not mid.caps.mlx_model:
            raise ValueError(
                "the cascade's mid level must be an MLX ModelDrafter (it verifies the tiny drafts)"
            )
        self.mid, self.tiny = mid, tiny
        self.inner_k = inner_k
        self.adaptive = adaptive
        self.probe_every = probe_every
        self.name = f"cascade:{tiny.name}>{mid.name}"
        self.vocab_size = mid.vocab_size
        self.expected_acceptance = mid.expected_acceptance
        self.rate = {"mid": None, "cascade": None}  # EMA seconds per drafted token
        self.since = {"mid": 0, "cascade": 0}
        self.counts = {"mid": 0, "cascade": 0}
        self.inner_drafted = self.inner_accepted = 0

    def fork(self) -> CascadeDrafter:
        """For one request: both levels forked (drafters.base.request_drafter), the learnt
        rates shared with the engine's cascade."""
        twin = copy.copy(self)
        twin.mid, twin.tiny = request_drafter(self.mid), request_drafter(self.tiny)
        return twin

    # ---------------------------------------------------------------- protocol
    def begin(self, prompt: list[int]) -> None:
        self.mid.begin(prompt)
        self.tiny.begin(prompt)

    def sync(self, committed: list[int]) -> None:
        self.mid.sync(committed)
        self.tiny.sync(committed)

    def accept(self, n_accepted: int, next_token: int) -> None:
        self.mid.accept(n_accepted, next_token)  # the mid keeps the last draft (see _cascade)
        self.tiny.sync(self.mid.seq)

    def close(self) -> None:
        self.mid.close()
        self.tiny.close()

    def choose(self) -> str:
        if not self.adaptive:
            return "cascade"
        for k in ("cascade", "mid"):
            if self.rate[k] is None:
                return k
        best = min(self.rate, key=lambda k: self.rate[k])
        other = "mid" if best == "cascade" else "cascade"
        return other if self.since[other] >= self.probe_every else best

    def draft(self, k: int, sampler) -> Draft:
        if k < 1:
            return Draft([], None)
        kind = self.choose()
        t0 = time.perf_counter()
        d = self._cascade(k, sampler) if kind == "cascade" else self.mid.draft(k, sampler)
        dt = (time.perf_counter() - t0) / max(len(d.tokens), 1)
        old = self.rate[kind]
        self.rate[kind] = dt if old is None else 0.7 * old + 0.3 * dt
        self.counts[kind] += 1
        for key in self.since:
            self.since[key] = 0 if key == kind else self.since[key] + 1
        return d

    # ---------------------------------------------------------------- the inner level
    def _cascade(self, k: int, sampler) -> Draft:
        mid, tiny = self.mid, self.tiny
        committed = list(mid.seq)
        tiny.sync(committed)
        mid._trim_to(common_prefix(mid.fed, committed[:-1]))
        pending = committed[len(mid.fed) :]  # at least the last committed token
        tokens, rows = [], []
        while len(tokens) < k:
            j = min(self.inner_k, k - len(tokens))
            d = tiny.draft(j, sampler)
            x = pending + d.tokens
            logits = mid._forward(mx.array(x, dtype=mx.int32)[None])[-(len(d.tokens) + 1) :]
            p = sampler.logprobs(logits)  # (j+1, V): q_mid after pending[-1] and each draft
            n, nxt = rejection_sample(d.tokens, d.logprobs, p, sampler.next_key())
            for c in mid.cache:
                c.trim(len(d.tokens) - n)  # keep pending + n drafts
            mid.fed.extend(pending + d.tokens[:n])
            tokens += d.tokens[:n] + [nxt]
            rows.append(p[: n + 1])
            pending = [nxt]
            tiny.accept(n, nxt)
            self.inner_drafted += len(d.tokens)
            self.inner_accepted += n
        q = mx.concatenate(rows)[:k]
        mx.eval(q)
        mid._last_draft = tokens[:k]  # so mid.accept(n, next) extends the committed sequence
        return Draft(tokens[:k], q)
