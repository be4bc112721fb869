"""The batch's policy, apart from its mechanics (edgespec.batch.batcher): which requests are
admitted and when (FIFO, while the batch has room and the memory budget holds their reserve;
the prefix cache gives way first), whether a step's adaptive rows may speculate (a regime the
measured guard chooses, credited with the step's tokens and time: edgespec.batch.guard), and
what a pass costs (the learnt pass-cost curve the rows price their speculation against).

`BatchPolicy` is the Batcher's base: it reads and decides over the Batcher's state (`_live`,
`_waiting`, `_arena`, `_reserved`, the step's regime fields) and never runs a pass.
"""

from __future__ import annotations

import functools
import time

from greenlet import greenlet

import edgespec.batch.memory as memory
from edgespec.batch.arena import KVArena
from edgespec.batch.cost import PassCost, Peer, StepCost
from edgespec.batch.request import Request
from edgespec.batch.seq import _Seq
from edgespec.generate import Chunk

# A request whose prompt + max_tokens may pass this keeps caches of its own instead of an arena
# row (the arena's rows are all as long as its longest one).
ARENA_POSITIONS = 1024


class BatchPolicy:
    """Admission, speculation regime and pass pricing of the Batcher (see the module docstring)."""

    # ------------------------------------------------------------ admission
    def submit(self, req: Request) -> None:
        """Queue `req`; raises MemoryBudgetError when it could never fit."""
        P, m = len(req.ids), req.options.max_tokens
        req.need_bytes = memory.reserve_bytes(self.engine, P, m)
        req.own_bytes, req.arena_positions = req.need_bytes, 0
        if P + m + memory.TREE <= ARENA_POSITIONS:  # its verifier K/V goes to an arena row
            req.arena_positions = memory.positions(self.engine, P, m, KVArena.step)
            req.own_bytes = memory.drafter_kv_per_token(self.engine) * memory.positions(self.engine, P, m)
        memory.check_fits(req.own_bytes + memory.arena_bytes(self.engine, 1, req.arena_positions), self.budget)
        with self._cv:
            self._waiting.append(req)
            if self._thread is None:
                self._start_worker()
            self._cv.notify()

    def _take_waiting(self) -> list[_Seq]:
        """Admit waiting requests in order while the batch has room and memory (lock held)."""
        new = []
        while self._waiting and len(self._live) < self.max_batch:
            req = self._waiting[0]
            if req.cancelled:  # its client left while it waited: never touch the model
                self._waiting.popleft()
                req.send("chunk", Chunk("", [], "cancelled"))
                req.send("done", req.stats)
                continue
            self._make_room(req)
            if self._live and self.held_bytes(req) > self.budget:
                break  # waits for memory (FIFO: nobody overtakes it)
            self._waiting.popleft()
            self._reserved += req.own_bytes
            seq = _Seq(req, None)
            seq.glet = greenlet(functools.partial(self._run, seq), parent=self._hub)
            self._live.append(seq)
            new.append(seq)
        return new

    def _make_room(self, req: Request) -> None:
        """The prefix cache (edgespec.caches.prefix) and the drafter's store joined to it hold
        only what the live sequences and `req` leave of the budget: their least recently used
        blocks go first."""
        pc = self.engine.prefix_cache
        if pc.group_bytes and self.budget != float("inf"):  # the drafter's store too (joined)
            pc.shrink_to(int(self.budget - self.held_bytes(req)))

    def held_bytes(self, new: Request | None = None) -> int:
        """Bytes the live sequences' caches may come to hold, with `new` admitted too: each
        one's own caches at their largest, plus the KV arena with a row for every short
        request (or the rows it already holds, if more), each row as long as the longest of
        them (or as it already is)."""
        short = [s.req.arena_positions for s in self._live if s.req.arena_positions]
        own = self._reserved
        if new is not None:
            own += new.own_bytes
            if new.arena_positions:
                short.append(new.arena_positions)
        a = self._arena
        rows = max(a.rows if a is not None else 0, len(short))
        longest = max([a.positions if a is not None else 0, *short])
        return own + memory.arena_bytes(self.engine, rows, longest)

    # ------------------------------------------------------------ speculation in a batch
    def _credit(self, n: int, t_step: float) -> None:
        """The tokens committed in this step came from the passes the last step built: credit
        them, with this step's time, to the regime that planned those passes, when adaptive
        rows asked for it and neither step ran a prompt's pass (edgespec.batch.guard)."""
        prev = self._prev
        clean = all(s.emitted for s in self._live) and self._clean
        if prev is not None and prev[2] and prev[3] and clean:
            self.guard.record(prev[1], prev[0], self._step_tokens, time.perf_counter() - t_step)
        self._prev = (self._regime, n, self._asked, clean)

    def speculation_allowed(self) -> bool:
        if self._regime is None:  # the step's first ask: the guard's turn (alone: always spec)
            n = self._step_n
            self._regime = self.guard.choose(n) if n > 1 else "spec"
        self._asked = True
        return self._regime == "spec"

    # ------------------------------------------------------------ pricing
    def _step_cost(self) -> StepCost:
        """step(sizes) on the adaptive decoder's measured pass-cost curve when the engine has
        one, else on a CPU-like shape (8 tokens ~1.4x one), in relative units."""
        curve = self.engine.memory.tree_costs
        key = id(curve)
        if self._cost is None or self._cost[0] != key:
            pc = PassCost(curve.sizes, curve.verify_s) if curve is not None else PassCost([1, 64], [1.0, 1 + 64 / 20])
            self._cost = (key, StepCost(pc))
        return self._cost[1]

    def _pass_cost(self, tokens: int) -> float:
        return self._step_cost().pass_cost(tokens)

    def batch_context(self, me: _Seq | None):
        peers = [Peer(s.size, s.gains, s.key, s.extra_s) for s in self._live if s is not me]
        if not peers or me is None:
            return None
        return peers, self._step_cost(), me.key
