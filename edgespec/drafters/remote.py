"""A device model: a drafter that computes "elsewhere", and a verifier with a set pass time.

Drafting while verifying pays when the drafter runs on another unit than the verifier (a
Mac's Neural Engine beside its GPU). To see that overlap, and the planner's choice, without
a second unit, `RemoteDrafter` wraps a real drafter (its tokens are real) and makes every
draft call last `per_call_s + k * per_token_s` of wall time, waiting in `time.sleep` (the
GIL released, no core busy) for whatever the wrapped drafter's own compute did not use.
`PacedVerifier` does the same for a verifier pass (`base_s + per_token_s * T`, nearly flat
in T on a GPU). Both may share a `Contention`: while both are busy, each one's remaining
time runs `factor` times slower (two units that share memory bandwidth, or one CPU's cores).

Test and benchmark support (tests/test_pipelined_auto.py, benchmarks/pipelined.py); not a
drafter kind a user loads.
"""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import mlx.core as mx


class Contention:
    """Two sides (verifier, drafter) that slow each other down by `factor` while both are busy.

    A side's wait sleeps on a condition, woken only when the other side starts or ends a call
    (its rate changes then): no polling, so the GIL is not fought over."""

    def __init__(self, factor: float = 1.0):
        self.factor = float(factor)
        self._busy = {"verify": 0, "draft": 0}
        self._cond = threading.Condition()

    def enter(self, side: str) -> float:
        """`side` starts a call (its own compute, then `wait`): the call's start time."""
        with self._cond:
            self._busy[side] += 1
            self._cond.notify_all()
        return time.perf_counter()

    def _slow(self, side: str) -> float:
        return self.factor if self._busy["draft" if side == "verify" else "verify"] > 0 else 1.0

    def wait(self, side: str, seconds: float, started: float) -> None:
        """End `side`'s call (begun with `enter` at `started`) once `seconds` of its work are
        done: work done alone counts 1, beside the other side 1/factor (the call's own compute
        before the wait is counted at the rate of the moment the wait begins)."""
        with self._cond:
            try:
                done = (time.perf_counter() - started) / self._slow(side)
                while done < seconds:
                    slow = self._slow(side)
                    t0 = time.perf_counter()
                    self._cond.wait(timeout=(seconds - done) * slow)
                    done += (time.perf_counter() - t0) / slow
            finally:
                self._busy[side] -= 1
                self._cond.notify_all()


class RemoteDrafter:
    """`inner`'s drafts, each call lasting per_call_s + k * per_token_s of wall time (module notes).

    It runs on "elsewhere" (`device`), so the planner's prior is that overlap is nearly free;
    what it measures decides. Everything else is the wrapped drafter's."""

    device = "elsewhere"

    def __init__(self, inner, per_call_s: float = 0.0, per_token_s: float = 0.001,
                 contention: Contention | None = None):
        self.inner = inner
        self.per_call_s, self.per_token_s = float(per_call_s), float(per_token_s)
        self.contention = contention if contention is not None else Contention(1.0)
        self.caps = replace(inner.caps, runs_on="elsewhere")
        self.name = f"remote({inner.name})"
        self.calls: list[int] = []  # k of every draft call (counts, for tests)

    def draft(self, k: int, sampler, **ranking):
        t0 = self.contention.enter("draft")
        try:
            out = self.inner.draft(k, sampler, **ranking)
            self.calls.append(k)
        finally:
            self.contention.wait("draft", self.per_call_s + k * self.per_token_s if k > 0 else 0.0, t0)
        return out

    def fork(self) -> RemoteDrafter:
        twin = RemoteDrafter(self.inner.fork() if self.inner.caps.forks else self.inner, self.per_call_s,
                             self.per_token_s, self.contention)
        twin.calls = self.calls  # one count for the engine's drafter and its requests' forks
        return twin

    def __getattr__(self, name):
        return getattr(self.inner, name)


class PacedVerifier:
    """A model whose every forward call lasts at least base_s + per_token_s * T of wall time
    (T: the tokens it is given), whatever its own compute took (module notes)."""

    def __init__(self, model, base_s: float = 0.01, per_token_s: float = 0.0,
                 contention: Contention | None = None):
        self._model = model
        self.base_s, self.per_token_s = float(base_s), float(per_token_s)
        self.contention = contention if contention is not None else Contention(1.0)

    def __call__(self, x, *args, **kwargs):
        t0 = self.contention.enter("verify")
        try:
            out = self._model(x, *args, **kwargs)
            mx.eval(out)  # the pass itself, then the rest of its set time
        finally:
            self.contention.wait("verify", self.base_s + self.per_token_s * int(x.shape[-1]), t0)
        return out

    def __getattr__(self, name):
        return getattr(self._model, name)
