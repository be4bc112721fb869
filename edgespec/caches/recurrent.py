"""State caches of recurrent layers (short convolutions, gated delta rule) and their math.

A recurrent layer holds one state that each new position updates; unlike K/V it cannot be
cut back to an earlier position. The caches here implement the per-layer state protocol of
edgespec.caches.kv (offset, trim, keep, export_span / import_span, span_kind "state") by
*recomputation*: every position written since a base state is logged with the per-position
inputs of the state update (a few vectors, not the (H, Dk, Dv) state), so

- `trim(n)` recomputes the state after the kept prefix from the nearest checkpoint (the
  state before the latest pass, or the base) by the same update plain decoding runs, one
  position at a time: a partially accepted draft commits exactly plain decoding's state;
- `keep(start, indices)` does the same along a tree pass's accepted branch. A tree pass
  runs every node from its parent's state (per-branch states, derived from the tree mask),
  so tree, lookahead and adaptive verification work unchanged on these layers.

Memory stays bounded: once the log holds LOG_LIMIT positions at the start of a pass it
restarts at a snapshot STRIDE..2 STRIDE positions back (the state at an earlier pass start,
kept by reference), so a round in progress (a verify pass, or a drafter's catch-up and K
drafts) can always be undone; older rollbacks are refused by name.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from edgespec.caches.kv import LayerCache
from edgespec.kernels import cpu_delta
from edgespec.kernels.delta import DK_MAX, delta_rule_metal
from edgespec.kernels.delta_reference import delta_recurrent, delta_step  # noqa: F401  (re-exported)
from edgespec.kernels.spec import on_metal

LOG_LIMIT = 160  # positions logged before the log restarts at a snapshot
STRIDE = 32  # positions between kept snapshots (states at pass starts; free: arrays are immutable)
SNAPSHOTS = 2  # snapshots kept: the log restarts STRIDE..2 STRIDE positions back
CHUNK = 64  # chunk length of the chunked gated delta rule (prefill)
RECURRENT_MAX = 32  # passes up to this long (decode, verify) step the recurrence per position
CPU_NATIVE = False  # the CPU device runs the recurrence natively (edgespec.kernels.cpu_delta; see delta_rule)


class StateCache(LayerCache):
    """Base of the recurrent caches: the log, checkpoints and the protocol.

    Subclasses define `advance(state, inputs)`: the state after feeding `inputs` (a tuple of
    (B, n, ...) arrays, positions in order) to `state` (a tuple of arrays), by the same
    per-position update the layer's decode step uses.
    """

    span_kind = "state"

    def __init__(self):
        self.offset = 0
        self._state: tuple | None = None  # after position offset-1 (None: nothing fed yet)
        self._base = 0  # the log starts here
        self._base_state: tuple | None = None
        self._log: list[tuple] = []  # per pass: tuple of (B, T, ...) inputs
        self._parents: list[int] = []  # per logged position: log index of its parent, -1 = base
        self._check: tuple[int, tuple | None] | None = None  # (offset, state) before the latest pass
        self._snaps: list[tuple[int, tuple]] = []  # (offset, state) at pass starts, >= STRIDE apart
        self._tree = False  # the latest pass was a tree: `state` is not a position's state
        self.recomputed = 0  # positions recomputed by trim/keep/rebase (benchmarks read it)

    # ---------------------------------------------------------------- layer side
    @property
    def state(self) -> tuple | None:
        if self._tree:
            raise RuntimeError("a tree pass on a recurrent layer must be committed (keep or trim) before "
                               "the next pass")
        return self._state

    def advance(self, state: tuple | None, inputs: tuple) -> tuple:  # pragma: no cover - abstract
        raise NotImplementedError

    def write(self, inputs: tuple, state: tuple, parents: list[int] | None, before: tuple) -> None:
        """Record a pass of T positions: its per-position update inputs (B, T, ...), the state
        after its last position, each position's parent within the pass (-1 = the state
        before the pass; None = a chain) and the state the pass started from."""
        T = int(inputs[0].shape[1])
        if self._tree:
            raise RuntimeError("a tree pass on a recurrent layer must be committed before the next pass")
        if self._state is None:  # the first pass: its start (zeros) is the base
            self._state = tuple(before)
            if self._base == self.offset and not self._parents:
                self._base_state = self._state
        if len(self._parents) >= LOG_LIMIT:
            self._rebase()
        if not self._snaps or self.offset - self._snaps[-1][0] >= STRIDE:
            self._snaps = (self._snaps + [(self.offset, self._state)])[-SNAPSHOTS:]
        start = len(self._parents)  # log index of the pass's first position
        self._check = (self.offset, self._state)
        if parents is None:
            self._parents.extend(range(start - 1, start + T - 1))
        else:
            self._parents.extend(start - 1 if p < 0 else start + p for p in parents)
            self._tree = any(p != i - 1 for i, p in enumerate(parents))
        self._log.append(tuple(inputs))
        self._state = tuple(state)
        self.offset += T

    # ---------------------------------------------------------------- the protocol
    def _path(self, node: int) -> list[int]:
        path = []
        while node >= 0:
            path.append(node)
            node = self._parents[node]
        return path[::-1]

    def _rebase(self) -> None:
        """Restart the log at the oldest snapshot after the base (STRIDE to 2 STRIDE positions
        back: a round in progress stays undoable), or at the current position."""
        off, state = next(((o, st) for o, st in self._snaps if o > self._base), (self.offset, self._state))
        cut = off - self._base
        logged = self._joined() if self._log else ()
        self._log = [tuple(a[:, cut:] for a in logged)] if off < self.offset else []
        self._parents = list(range(-1, self.offset - off - 1))
        self._base, self._base_state = off, state
        self._snaps = [(o, st) for o, st in self._snaps if o > off]

    def _joined(self) -> tuple:
        if len(self._log) > 1:
            self._log = [tuple(mx.concatenate([p[j] for p in self._log], axis=1)
                               for j in range(len(self._log[0])))]
        return self._log[0]

    def _commit(self, path: list[int]) -> None:
        """Make `path` (log indices from the base, each the parent of the next) the content."""
        if any(self._parents[b] != a for a, b in zip([-1] + path, path, strict=False)):
            raise ValueError("recurrent cache: the kept positions are not one branch from the cached prefix")
        target = self._base + len(path)
        start_state, done = self._base_state, 0
        points = self._snaps + ([self._check] if self._check is not None else [])
        for off, st in points:  # the latest point on the kept chain: recompute from there
            n = off - self._base
            if done < n <= len(path) and path[:n] == list(range(n)):
                start_state, done = st, n
        if path:
            logged = self._joined()
            idx = mx.array(path, dtype=mx.int32)
            inputs = tuple(mx.take(a, idx, axis=1) for a in logged)
            self._log = [inputs]
        else:
            self._log = []
        self._parents = list(range(-1, len(path) - 1))
        if done < len(path):
            rest = tuple(a[:, done:] for a in self._log[0])
            self._state = self.advance(start_state, rest)
            self.recomputed += len(path) - done
        else:
            self._state = start_state
        self._tree = False
        self._check = (target, self._state)
        self._snaps = [(o, st) for o, st in self._snaps if o <= target]
        self.offset = target

    def trim(self, n: int) -> int:
        """Drop the last n positions: the state becomes the one after the kept prefix."""
        n = min(max(n, 0), self.offset)
        if n == 0 and not self._tree:
            return 0
        target = self.offset - n
        if target < self._base:
            raise ValueError(f"recurrent cache: cannot roll back to position {target}; its state is "
                             f"kept from position {self._base} on (one decoding round back)")
        path = self._path(target - self._base - 1)
        if len(path) != target - self._base:
            raise ValueError("recurrent cache: the kept positions of a tree pass are not one branch")
        self._commit(path)
        return n

    def keep(self, start: int, indices: list[int]) -> None:
        """Keep positions `start + indices` of the last pass (a branch from its root) at `start`."""
        if start < self._base:
            raise ValueError(f"recurrent cache: cannot keep a branch from position {start}; its state "
                             f"is kept from position {self._base} on")
        head = list(range(start - self._base))
        branch = [start - self._base + i for i in indices]
        if branch and self._parents[branch[0]] != (head[-1] if head else -1):
            raise ValueError("recurrent cache: the kept branch does not start after the cached prefix")
        self._commit(head + branch)

    def export_span(self, start: int, end: int) -> tuple | None:
        """The state after position end-1 (and `end`), while end == offset; else None."""
        if self._tree or self._state is None or end != self.offset or not 0 <= start < end:
            return None
        parts = tuple(a + 0 for a in self._state) + (mx.array(end, dtype=mx.int32),)
        mx.eval(parts)
        return parts

    def import_span(self, parts: tuple) -> None:
        """Replace the state with an exported one; the offset becomes the exported `end`."""
        *state, end = parts
        self._state = self._base_state = tuple(state)
        self.offset = self._base = int(end.item())
        self._log, self._parents, self._check, self._tree, self._snaps = [], [], None, False, []

    def arrays(self) -> list[mx.array]:
        """What evaluating computes this cache's last pass (see edgespec.caches.kv.cache_arrays)."""
        return list(self._state or ())

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self._state or ()) + sum(a.nbytes for p in self._log for a in p)


# ---------------------------------------------------------------- short causal convolution


def conv_windows(x: mx.array, state: mx.array, parents: list[int] | None) -> tuple[mx.array, mx.array]:
    """Inputs (B, T, C) after `state` (B, K-1, C) -> each position's window (B, T, K, C) and the
    state after the last position (B, K-1, C). A tree's windows follow each node's ancestors."""
    B, T, C = x.shape
    K = state.shape[1] + 1
    full = mx.concatenate([state.astype(x.dtype), x], axis=1)  # (B, K-1+T, C)
    if parents is None:
        idx = np.arange(T)[:, None] + np.arange(K)[None, :]  # window of t: full[t .. t+K-1]
        last = full[:, T:]
    else:
        idx = np.zeros((T, K), dtype=np.int64)
        for t in range(T):
            chain, node = [], t
            while len(chain) < K and node >= 0:
                chain.append(K - 1 + node)
                node = parents[node]
            pad = K - len(chain)  # the rest comes from the state before the pass
            chain.extend(range(K - 2, K - 2 - pad, -1))
            idx[t] = chain[::-1]
        last = full[:, T:]  # meaningless for a tree: the cache recomputes after keep()
    win = mx.take(full, mx.array(idx.reshape(-1), dtype=mx.int32), axis=1).reshape(B, T, K, C)
    return win, last


def depthwise(win: mx.array, weight: mx.array, bias: mx.array | None) -> mx.array:
    """Windows (B, T, K, C), weight (C, 1, K) as Hugging Face stores it -> (B, T, C)."""
    w = weight.reshape(weight.shape[0], -1).T  # (K, C)
    out = (win * w.astype(win.dtype)).sum(axis=2)
    return out if bias is None else out + bias


class ConvCache(StateCache):
    """A short causal convolution's state: its last K-1 inputs (B, K-1, C)."""

    def advance(self, state, inputs):
        (conv,) = state
        (x,) = inputs
        K1 = conv.shape[1]
        return (mx.concatenate([conv.astype(x.dtype), x], axis=1)[:, -K1:],)


# ---------------------------------------------------------------- gated delta rule


def delta_rule(q, k, v, g, beta, S, parents: list[int] | None = None, inference: bool = False):
    """The recurrent form's dispatcher: q, k (B, T, Hk, Dk) with Hk dividing v's Hv heads (value
    head h reads key head h // (Hv / Hk)), v (B, T, Hv, Dv), g, beta (B, T, Hv), S (B, Hv, Dk, Dv)
    -> (outputs (B, T, Hv, Dv) float32, state after the last position).

    With `inference` (a call with a cache: no gradient needed), the Metal kernel on an Apple GPU
    (edgespec.kernels.delta) and, where CPU_NATIVE is set, the native loop on the CPU device
    (edgespec.kernels.cpu_delta); elsewhere `delta_recurrent`, the MLX reference. Every pass of
    a model (decoding steps, verify passes, rollback recomputation) takes the same one, so
    their states agree bit for bit."""
    H, Hk = v.shape[2], k.shape[2]
    if H % Hk or q.shape[2] != Hk:
        raise ValueError(f"gated delta rule: q and k need the same number of heads, dividing v's {H}; "
                         f"got {q.shape[2]} and {Hk}")
    if inference and on_metal() and k.shape[-1] <= DK_MAX:
        return delta_rule_metal(q, k, v, g, beta, S, parents)
    if inference and CPU_NATIVE and mx.default_device() == mx.cpu:
        if cpu_delta.kernel() is not None:
            return cpu_delta.delta_rule_cpu(q, k, v, g, beta, S, parents)
    if Hk != H:
        q, k = mx.repeat(q, H // Hk, axis=2), mx.repeat(k, H // Hk, axis=2)
    return delta_recurrent(q, k, v, g, beta, S, parents)


def unit_lower_inverse(L: mx.array) -> mx.array:
    """(I + L)^-1 for strictly lower triangular L (..., C, C): L is nilpotent, so the inverse is
    the finite series sum_j (-L)^j = (I - L)(I + L^2)(I + L^4)... (log2 C matrix products,
    on whatever device runs the rest; no triangular solve needed)."""
    C = L.shape[-1]
    M = -L
    inv = mx.eye(C, dtype=L.dtype) + M
    span = 2
    while span < C:
        M = M @ M
        inv = inv + inv @ M
        span *= 2
    return inv


def delta_chunked(q, k, v, g, beta, S, chunk: int = CHUNK):
    """The same as delta_recurrent for a chain, in chunks of `chunk` positions: within a chunk
    the updates are condensed into matrix products (prefill)."""
    B, T, H, Dk = k.shape
    Dv = v.shape[-1]
    pad = (-T) % chunk
    q, k, v = (mx.pad(a, [(0, 0), (0, pad), (0, 0), (0, 0)]).transpose(0, 2, 1, 3) for a in (q, k, v))
    g, beta = (mx.pad(a, [(0, 0), (0, pad), (0, 0)]).transpose(0, 2, 1) for a in (g, beta))
    N = (T + pad) // chunk
    q, k, v = (a.reshape(B, H, N, chunk, -1) for a in (q, k, v))
    g, beta = (a.reshape(B, H, N, chunk) for a in (g, beta))
    cum = mx.cumsum(g, axis=-1)  # (B, H, N, C)
    lower = mx.tril(mx.ones((chunk, chunk), dtype=mx.bool_))
    decay = mx.exp(mx.where(lower, cum[..., :, None] - cum[..., None, :], -mx.inf))  # (.., C, C)
    kb = k * beta[..., None]
    vb = v * beta[..., None]
    strict = mx.tril(mx.ones((chunk, chunk), dtype=mx.bool_), -1)
    inv = unit_lower_inverse(mx.where(strict, (kb @ k.swapaxes(-1, -2)) * decay, 0.0))
    u = inv @ vb  # the chunk's delta-rule updates condensed: (I + L)^-1 (beta v)
    w = inv @ (kb * mx.exp(cum)[..., None])
    intra = (q @ k.swapaxes(-1, -2)) * decay
    qd = q * mx.exp(cum)[..., None]
    kd = k * mx.exp(cum[..., -1:] - cum)[..., None]
    step_decay = mx.exp(cum[..., -1])[..., None, None]  # (B, H, N, 1, 1)
    outs = []
    for n in range(N):
        v_new = u[:, :, n] - w[:, :, n] @ S
        outs.append(qd[:, :, n] @ S + intra[:, :, n] @ v_new)
        S = S * step_decay[:, :, n] + kd[:, :, n].swapaxes(-1, -2) @ v_new
    out = mx.stack(outs, axis=2).reshape(B, H, N * chunk, Dv)[:, :, :T]
    return out.transpose(0, 2, 1, 3), S


class DeltaCache(StateCache):
    """A Gated DeltaNet layer's state: its convolution's last K-1 inputs (B, K-1, C) and the
    recurrent state (B, H, Dk, Dv). Logged per position: the convolution input and the
    update's k, v, g, beta."""

    def advance(self, state, inputs):
        conv, S = state
        x, k, v, g, beta = inputs
        conv = mx.concatenate([conv.astype(x.dtype), x], axis=1)[:, -conv.shape[1]:]
        if (on_metal() and k.shape[-1] <= DK_MAX) or CPU_NATIVE:  # what the passes ran: bit for bit their state
            return conv, delta_rule(k, k, v, g, beta, S, inference=True)[1]
        for t in range(k.shape[1]):
            S = delta_step(S, k[:, t], v[:, t], g[:, t], beta[:, t])
        return conv, S


# ---------------------------------------------------------------- tree passes


def tree_parents(mask, offset: int, T: int) -> list[int] | None:
    """Each new position's parent within a pass (-1: the cached prefix), read off the pass's
    boolean mask (T, S) (or broadcastable (B, 1, T, S) with one row); None for a causal chain.

    A recurrent layer follows exactly one parent per node, so the mask must be a tree: node
    i sees the whole cached prefix, itself, and its parent's ancestors plus the parent.
    """
    if mask is None or isinstance(mask, str) or T == 1:
        return None
    m = np.array(mask.astype(mx.bool_) if mask.dtype != mx.bool_ else mask)
    if m.ndim > 2:
        if int(np.prod(m.shape[:-2])) != 1:
            raise ValueError("recurrent layers run one sequence per pass (a batch of masks was given)")
        m = m.reshape(m.shape[-2], m.shape[-1])
    m = np.broadcast_to(m, (T, offset + T))
    if not m[:, :offset].all():
        raise ValueError("recurrent layers need every position of a pass to follow the whole cached "
                         "prefix (a tree continued across passes, e.g. a tree drafter, is not supported "
                         "on them: use chain drafts)")
    own = m[:, offset:]
    parents = []
    for i in range(T):
        anc = np.flatnonzero(own[i, :i])
        p = int(anc[-1]) if anc.size else -1
        want = own[p].copy() if p >= 0 else np.zeros(T, dtype=bool)
        want[i] = True
        if not own[i, i] or not np.array_equal(own[i], want):
            raise ValueError("recurrent layers need a tree mask (each position sees its parent's "
                             "ancestors, its parent and itself)")
        parents.append(p)
    if parents == list(range(-1, T - 1)):
        return None
    return parents
