"""Drafting while verifying: the drafter's worker thread, and what overlap is worth.

A drafter whose work runs off the verifier's thread (an MLX drafter on its own stream, the
int8 host drafter whose native pass releases the GIL, a Core ML drafter on the Neural
Engine) can draft round r+1 while round r is verified: from the premise that round r
commits the branch the drafter itself expects (its chain up to where the tree keeps it,
then its own next token). When the verification commits exactly that, the next round's
draft is already in hand; otherwise it is dropped. Modes `speculative` and `auto` both run
their drafter on the one `Worker` below.

`Overlap` prices the choice, in the steady state of each way. Synchronous drafting costs
v + d a round (the verify pass, then the next round's draft of k tokens); drafting ahead
drafts d' = d + one token (the guess the premise ends with) beside the pass, max(v * s_v,
d' * s_d), and d' again after it when the premise fails (probability 1 - p). s_v and s_d are what each side slows the other by when both run at once
(shared cores, shared memory bandwidth): measured from the overlapped rounds, as the
ratio of their times to the same work's priced time alone; before that, a prior by where
the two run (one CPU: they compete; different units: nearly free). Until a few overlapped
rounds are measured, one drafting round in `PROBE_EVERY` overlaps anyway to measure them
(where its premise is likely to hold).

The runner-up: the tree verified holds other branches than the drafter's, and a branch a
source proposed past what the tree keeps ends in a token the verifier may draw next (a
"frontier" node). The likeliest of those besides the drafter's own premise is the runner-up
premise: where the pass leaves the drafter time (or what it saves outweighs the wait,
`Overlap.runner_up_pays`), a second early draft from it follows the first on the worker,
and is skipped if the pass has ended before it starts (`unless`).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx

# Slowdown priors (time overlapped / time alone), before any overlapped round is measured.
# "shared": drafter and verifier on the same CPU cores (a guess: two passes that each want
# every core roughly halve each other's speed; measured values replace it at once).
# "apart": the drafter on its own unit (Neural Engine, another GPU stream, another machine);
# memory bandwidth is still shared (a guess, for a Mac's unified memory).
PRIOR_SLOWDOWN = {"shared": (1.8, 1.8), "apart": (1.1, 1.1)}
PROBE_EVERY = 16  # drafting rounds between overlap probes while fewer than MEASURED are in
MEASURED = 3  # overlapped rounds measured before the prices alone decide
PROBE_P = 0.5  # a probe only where the premise is at least this likely to hold (else it measures a waste)
EMA = 0.2  # weight of a new measurement


class Worker:
    """One long-lived thread with its own MLX stream; runs drafter calls in submission order.

    A single process-wide worker: a stream made with mx.new_stream per generation
    left the process aborting at exit, so the thread (and with it its default
    stream) lives as long as the process.
    """

    _pool: ThreadPoolExecutor | None = None
    _guard = threading.Lock()

    def __init__(self):
        with Worker._guard:
            if Worker._pool is None:
                Worker._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="edgespec-drafter")
                # Runs at interpreter shutdown before concurrent.futures joins its threads.
                threading._register_atexit(Worker._shutdown)

    @staticmethod
    def _shutdown():
        # Drain the worker's MLX stream and stop the thread before the interpreter
        # finalizes: an MLX stream thread that still holds Python-owned buffers would
        # otherwise try to take the GIL during finalization, and the forced unwind of
        # that thread through MLX's C++ frames aborts the process (seen as exit 134).
        pool, Worker._pool = Worker._pool, None
        if pool is not None:
            pool.submit(mx.synchronize).result()
            pool.shutdown(wait=True)
        mx.synchronize()

    @staticmethod
    def _run(fn, args):
        # MLX gives every thread its own default stream, so the drafter's graphs are
        # scheduled apart from the verifier's; evaluated arrays are safe to share.
        _ON_WORKER.yes = True
        t0 = time.perf_counter()
        out = fn(*args)
        return out, time.perf_counter() - t0

    def submit(self, fn, *args):
        """A future of (fn(*args), seconds on the worker)."""
        return Worker._pool.submit(Worker._run, fn, args)

    def call(self, fn, *args):
        if on_worker():  # from a call already on the worker: run it here (queued, it would wait for itself)
            return Worker._run(fn, args)
        return self.submit(fn, *args).result()

    def close(self):
        # Wait for work still queued (an early draft) so the drafter is idle afterwards. Not on
        # the worker's own thread: a decoder's generator can be finalised there (the garbage
        # collector runs wherever an allocation triggers it, a draft call's included), and waiting
        # for the worker from the worker never ends. The work queued behind runs after it anyway.
        if on_worker():
            return
        self.submit(lambda: None).result()


_ON_WORKER = threading.local()


def unless(ended: threading.Event, fn, *args):
    """fn(*args), or None without calling it when `ended` is set already (work queued behind
    another that is only worth starting while the verifier's pass still runs)."""
    return None if ended.is_set() else fn(*args)


def on_worker() -> bool:
    """Whether this thread is the drafter's worker."""
    return getattr(_ON_WORKER, "yes", False)


class Direct:
    """Same interface as Worker, running on the caller's thread (nothing is ever ahead)."""

    def call(self, fn, *args):
        t0 = time.perf_counter()
        out = fn(*args)
        return out, time.perf_counter() - t0

    def close(self):
        pass


def can_draft_ahead(drafter) -> str | None:
    """Why `drafter` (a Drafter) cannot draft while the verifier runs, or None when it can.

    It must roll back a wrong premise (`sync`) and read nothing the verifier has not computed
    yet: a feature drafter never drafts ahead; a drafter that reads the verifier's cache only
    when it declares `DrafterCaps.ahead` (it pins the cache's verified positions before the
    verifier's pass and keeps the premise's own positions in a scratch: the int8 drafter)."""
    caps = drafter.caps
    if caps.needs_features:
        return "it reads the verifier's features"
    if not caps.syncs:
        return "it cannot roll back a wrong guess"
    if caps.reads_verifier and not getattr(caps, "ahead", False):
        return "it reads the verifier's cache and cannot pin it"
    return None


def placement(drafter) -> str:
    """"apart" when the drafter computes on another unit than the verifier, else "shared"."""
    dev = getattr(drafter, "device", "cpu")
    return "shared" if dev in ("cpu", "none", mx.default_device().type.name) else "apart"


class Overlap:
    """What drafting ahead costs and saves (module notes): measured slowdowns, priced.

    fixed: (s_v, s_d) held fixed (tests, benchmarks: injected costs); else learnt."""

    def __init__(self, where: str = "shared", fixed: tuple[float, float] | None = None):
        s_v, s_d = fixed if fixed is not None else PRIOR_SLOWDOWN[where]
        self.fixed = fixed is not None
        # time / priced time of verify passes ("v") and drafts ("d"), alone and overlapped:
        # the slowdown is their quotient, so a cost model that is off by a factor cancels out
        self.ratio = {"v_alone": 1.0, "v_over": s_v, "d_alone": 1.0, "d_over": s_d}
        self.n = dict.fromkeys(self.ratio, 0)
        self.drafting_rounds = 0  # drafting rounds since the last probe
        self.rounds = {"sync": 0, "ahead": 0}  # rounds run each way (counts, for reports)
        self.hits = 0  # early drafts whose premise held
        self.runner_ups = {"drafted": 0, "held": 0, "skipped": 0}  # runner-up premises (counts)

    @property
    def s_v(self) -> float:
        """A verify pass's time beside a draft, over its time alone."""
        return self.ratio["v_over"] / self.ratio["v_alone"]

    @property
    def s_d(self) -> float:
        """A draft's time beside a verify pass, over its time alone."""
        return self.ratio["d_over"] / self.ratio["d_alone"]

    # ------------------------------------------------------------ measured
    def observe(self, key: str, seconds: float, priced: float) -> None:
        """A verify pass or a draft (`key`: "v_alone", "v_over", "d_alone", "d_over") took
        `seconds` where its price alone was `priced`."""
        if self.fixed or priced <= 0 or seconds <= 0:
            return
        r = seconds / priced
        self.ratio[key] = r if self.n[key] == 0 else (1 - EMA) * self.ratio[key] + EMA * r
        self.n[key] += 1

    @property
    def measured(self) -> bool:
        return self.fixed or min(self.n["v_over"], self.n["d_over"]) >= MEASURED

    # ------------------------------------------------------------ priced
    def price(self, verify_s: float, draft_s: float, token_s: float, p: float) -> tuple[float, float]:
        """(synchronous, ahead) seconds a round: verify_s the pass alone, draft_s the next
        round's draft alone, token_s one more drafted token (the guess), p the chance the
        premise holds."""
        sync = verify_s + draft_s
        ahead_d = draft_s + token_s
        ahead = max(verify_s * self.s_v, ahead_d * self.s_d) + (1.0 - p) * ahead_d
        return sync, ahead

    def runner_up_pays(self, verify_s: float, draft_s: float, p: float, p2: float) -> bool:
        """Draft ahead from the runner-up premise too (after the first, on the same worker)?
        draft_s: one early draft alone (k + 1 tokens); p, p2: the chances the first and the
        runner-up premise hold (exclusive: two different committed sequences). It pays where the
        second draft fits beside the pass, or saves more than it makes the round wait:
        max(v s_v, 2 d s_d) + (1 - p - p2) d  <  max(v s_v, d s_d) + (1 - p) d."""
        v = verify_s * self.s_v
        one = max(v, draft_s * self.s_d) + (1.0 - p) * draft_s
        two = max(v, 2.0 * draft_s * self.s_d) + max(1.0 - p - p2, 0.0) * draft_s
        return two < one

    def choose(self, verify_s: float, draft_s: float, token_s: float, p: float) -> bool:
        """Draft ahead this round? Priced (ahead must be cheaper), or a probe while unmeasured
        (after PROBE_EVERY drafting rounds run synchronously, `ran`, where the premise is likely)."""
        sync, ahead = self.price(verify_s, draft_s, token_s, p)
        if ahead < sync:
            return True
        return not self.measured and self.drafting_rounds >= PROBE_EVERY and p >= PROBE_P

    def ran(self, ahead: bool) -> None:
        """A drafting round ran, drafted ahead or not (counts; the probe's clock)."""
        self.rounds["ahead" if ahead else "sync"] += 1
        self.drafting_rounds = 0 if ahead else self.drafting_rounds + 1

    def describe(self) -> dict:
        return {"s_verify": round(self.s_v, 3), "s_draft": round(self.s_d, 3), "measured": self.measured,
                "rounds": dict(self.rounds), "hits": self.hits, "runner_ups": dict(self.runner_ups)}
