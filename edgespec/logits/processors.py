"""The one step where logits become the distribution every mode draws from.

A request's target distribution at a position is the verifier's logits with
its logits processors applied (repetition / presence / frequency penalties,
then the grammar's token mask: disallowed tokens get -inf), renormalised by
the sampling transform as before (`sampling.logprobs_from_logits`). Every mode
must draw from exactly that law, so the processors are applied where logits
come out of the verifier: `ProcessedModel` wraps the model a mode holds and
transforms every row of every verifier call (prefill's last position, plain
steps, speculative chains, tree and lookahead nodes, batched rows) with that
row's own prefix. Decoders, the batch and the tree code see ordinary logits
and need no branch of their own: a greedy argmax or a sampled draw of a
processed row is the constrained draw; a drafted token the grammar forbids has
probability 0 under its parent row, so it is never accepted.

A row's prefix is derived from the call itself: the cache offset o says how
many positions are committed (the prompt plus the tokens the mode has emitted,
which `follow` records as they stream out, or failing that the inputs of
earlier calls written at those positions); a causal call's row i adds
inputs[:i+1]; a tree call's row j adds its ancestors, read from the tree mask
(row j attends to slot o+i iff node i is j's ancestor or j itself).

Processors keep their state per committed prefix and fork it per row (the
grammar matcher consumes a row's path and rolls back), so every tree node is
processed exactly as plain decoding would process that position.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Protocol

import mlx.core as mx
import numpy as np

from edgespec.logits.exactness import ExactnessGuard, guard_enabled
from edgespec.logits.sampling import Sampler
from edgespec.logits.structured import GrammarError

NEG_INF = float("-inf")


@dataclass(frozen=True)
class Penalties:
    """OpenAI's presence/frequency penalties over the reply's tokens and the CTRL/HF
    repetition penalty over prompt and reply (a logit l of a seen token becomes l / r if
    l > 0, else l * r). Defaults: off."""

    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0

    def __post_init__(self):
        for name, v, lo, hi in (("presence_penalty", self.presence, -2.0, 2.0),
                                ("frequency_penalty", self.frequency, -2.0, 2.0),
                                ("repetition_penalty", self.repetition, 1e-6, 10.0)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not np.isfinite(v) or not lo <= v <= hi:
                if name == "repetition_penalty":
                    raise ValueError(f"repetition_penalty must be a number in (0, 10] (1 = off), got {v!r}")
                raise ValueError(f"{name} must be a number in [-2, 2] (0 = off), got {v!r}")

    @property
    def active(self) -> bool:
        return self.presence != 0.0 or self.frequency != 0.0 or self.repetition != 1.0


@dataclass
class TokenLogprob:
    """A token's log-probability under the request's processed verifier distribution
    (penalised, masked, temperature 1), and the `top` most likely tokens there."""

    token: int
    logprob: float
    top: list[tuple[int, float]]


class LogitsProcessor(Protocol):
    """Transforms verifier logits, row by row, given each row's generated prefix."""

    def process(self, logits: mx.array, committed: list[int], paths: list[list[int] | None]) -> mx.array:
        """logits (T, V); committed: the reply's committed tokens; paths[i]: the tokens row i
        adds after them (None: a row of the prompt, left alone). Returns (T, V)."""
        ...


class PenaltyProcessor:
    def __init__(self, penalties: Penalties, prompt: list[int], vocab_size: int):
        self.p = penalties
        self.V = vocab_size
        self.prompt_counts = np.bincount(np.asarray(prompt, dtype=np.int64), minlength=vocab_size)[:vocab_size]
        self._counts = np.zeros(vocab_size, dtype=np.int64)  # of committed reply tokens
        self._n = 0
        self._committed: list[int] = []

    def _sync(self, committed: list[int]) -> None:
        if self._n > len(committed) or self._committed[: self._n] != committed[: self._n]:
            self._counts[:] = 0
            self._n = 0
        if len(committed) > self._n:
            np.add.at(self._counts, np.asarray(committed[self._n:], dtype=np.int64), 1)
            self._n = len(committed)
        self._committed = list(committed)

    def process(self, logits, committed, paths):
        self._sync(committed)
        T = logits.shape[0]
        counts = np.zeros((T, self.V), dtype=np.float32)
        live = np.zeros((T, 1), dtype=bool)
        for i, path in enumerate(paths):
            if path is None:
                continue
            live[i] = True
            counts[i] = self._counts
            if path:
                np.add.at(counts[i], np.asarray(path, dtype=np.int64), 1)
        if not live.any():
            return logits
        x = logits.astype(mx.float32)
        p = self.p
        if p.repetition != 1.0:
            seen = mx.array(((counts > 0) | (self.prompt_counts[None] > 0)) & live)
            x = mx.where(seen, mx.where(x > 0, x / p.repetition, x * p.repetition), x)
        if p.presence or p.frequency:
            bias = p.frequency * counts + p.presence * (counts > 0)
            x = x - mx.array(bias.astype(np.float32))
        return x


class GrammarProcessor:
    """The grammar's token mask per row.

    The matcher `m` only ever moves forward, along the committed reply, as plain decoding's
    does. Every state past the reply is reached on a copy (`deep_copy`), never by rolling
    back: llguidance (1.9.1) keeps what a mask computation left behind across `rollback()`
    and `reset()`, and serves it at the next state that looks alike to its lexer. After
    `..."list": [` a mask computed after `{"` (an object key: `":` allowed, `",` forbidden),
    then a rollback of that token and `["` consumed, gave the key's mask to the string value:
    issue 42's miss, where `",` was masked out and ` Job` drawn. A copy of a rolled-back
    matcher carries the same stale state, so copies are only taken of matchers that never
    went back.

    A copy costs time in proportion to the reply (about 35 µs per 1,000 tokens here), so a
    call's rows are masked in one walk of their trie: a node's mask first, then its children,
    each on a copy except the last, which goes on in the node's own matcher. A chain costs one
    copy, a tree one per leaf.
    """

    ASKED = 64  # the sources' contexts past the reply kept until it advances

    def __init__(self, matcher, vocab_size: int):
        self._start = matcher.deep_copy()  # the start state, never consumed into: rebuilds copy it
        self.m = matcher
        self.V = vocab_size
        self.state: list[int] = []  # reply tokens `m` has consumed
        self._asked: dict[tuple[int, ...], object | None] = {}  # a context past `state` -> a matcher there
        self.rebuilds = 0  # times the reply went back and `m` was rebuilt (tests read it)
        self.copies = 0  # matcher copies taken (tests read it)

    def _check(self, m) -> None:
        if m.is_error():
            raise GrammarError(f"the grammar matcher failed: {m.get_error()}")

    def _copy(self, m):
        self.copies += 1
        return m.deep_copy()

    def _follow(self, committed: list[int]) -> bool:
        """Bring `m` forward to `committed`; False when the grammar forbids it (`m` is then at
        its longest allowed prefix). A reply that does not extend the matcher's state (never
        in decoding: committed tokens are final) rebuilds it from the start."""
        s = self.state
        n = len(s)
        if len(committed) < n or committed[:n] != s:
            self.m = self._copy(self._start)
            s = self.state = []
            n = 0
            self.rebuilds += 1
            self._asked.clear()
        rest = committed[n:]
        if not rest:
            return True
        self._asked.clear()
        took = self.m.try_consume_tokens(rest)
        s.extend(rest[:took])
        self._check(self.m)
        return took == len(rest)

    def _state_at(self, seq: list[int]):
        """A matcher after reply tokens `seq` (a source's context), for questions only (do not
        consume into it), or None when the grammar forbids `seq`; `m` stays at the reply."""
        n = len(self.state)
        if len(seq) >= n and seq[:n] == self.state:
            rest = tuple(seq[n:])
            if not rest:
                return self.m
            if rest not in self._asked:
                if len(self._asked) >= self.ASKED:
                    self._asked.clear()
                m = self._copy(self.m)
                ok = m.try_consume_tokens(list(rest)) == len(rest)
                self._check(m)
                self._asked[rest] = m if ok else None
            return self._asked[rest]
        m = self._copy(self._start)  # a context behind the reply (never in decoding): its own matcher
        ok = m.try_consume_tokens(list(seq)) == len(seq)
        self._check(m)
        return m if ok else None

    def sync(self, committed: list[int]) -> None:
        """Follow the committed reply: a committed token the grammar forbids is an error."""
        if not self._follow(committed):
            raise GrammarError(f"token {committed[len(self.state)]} was committed where the grammar forbids it")

    def allowed(self, m=None) -> np.ndarray:
        """(V,) bool: the tokens allowed at matcher `m` (default: at the committed reply)."""
        m = self.m if m is None else m
        bits = np.frombuffer(m.compute_bitmask(), dtype=np.uint8)
        self._check(m)
        mask = np.unpackbits(bits, bitorder="little")[: self.V].astype(bool)
        if mask.shape[0] < self.V:
            mask = np.concatenate([mask, np.zeros(self.V - mask.shape[0], dtype=bool)])
        return mask

    # The sources' questions (edgespec.adaptive.sources.ForcedSource) run on a throwaway copy:
    # whatever llguidance does inside them to look ahead stays out of the kept matchers.
    def forced(self, committed: list[int], limit: int) -> list[int]:
        """The tokens the grammar forces after `committed` (its single continuation), up to
        `limit`: llguidance's fast-forward tokens."""
        m = self._state_at(committed)
        if m is None or m.is_stopped():
            return []
        return list(self._copy(m).compute_ff_tokens())[:limit]

    def allowed_prefix(self, committed: list[int], tokens: list[int]) -> int:
        """How many of `tokens`, continuing `committed`, the grammar allows."""
        m = self._state_at(committed)
        if m is None:
            return 0
        return int(self._copy(m).validate_tokens(list(tokens)))

    def accepting(self, committed: list[int]) -> bool:
        m = self._state_at(committed)
        return m is not None and m.is_accepting()

    def _masks(self, paths: list) -> dict[tuple[int, ...], np.ndarray]:
        """The mask after each of `paths` (past the reply), by one walk of their trie; a path
        the grammar forbids is left out."""
        want = {tuple(p) for p in paths if p is not None}
        children: dict[tuple[int, ...], list[tuple[int, ...]]] = {}
        seen: set[tuple[int, ...]] = {()}
        for p in want:
            for j in range(len(p), 0, -1):
                if p[:j] in seen:
                    break
                seen.add(p[:j])
                children.setdefault(p[: j - 1], []).append(p[:j])
        out: dict[tuple[int, ...], np.ndarray] = {}
        stack = [((), self.m, False)]  # (node, a matcher at it, whether the walk may consume into it)
        while stack:
            node, m, owned = stack.pop()
            if node in want:
                out[node] = self.allowed(m)
            kids = children.get(node, ())
            for i, kid in enumerate(kids):
                c = m if owned and i == len(kids) - 1 else self._copy(m)  # copies first, then the last
                if c.try_consume_tokens([kid[-1]]) != 1:
                    self._check(c)
                    continue  # the grammar forbids it: its subtree is left alone
                self._check(c)
                stack.append((kid, c, True))
        return out

    def process(self, logits, committed, paths):
        self.sync(committed)
        masks = self._masks(paths)
        if not masks:
            return logits
        rows = np.ones((logits.shape[0], self.V), dtype=bool)
        for i, path in enumerate(paths):
            if path is not None and tuple(path) in masks:
                rows[i] = masks[tuple(path)]
            # else: a row of the prompt, or a prefix that leaves the grammar (a drafted token it
            # forbids: its parent row gave that token probability 0, so this row is never drawn from)
        return mx.where(mx.array(rows), logits, NEG_INF)


class ProcessedModel:
    """The verifier as a request's modes see it: every row of every call comes out processed.

    Calls that are not the verifier's own sequence (no cache, a layer subset: self-speculative
    drafting; a cache this wrapper did not make) pass through unchanged.
    """

    KEEP_CALLS = 4  # calls whose processed rows stay available for the logprobs of emitted tokens
    GUARD_CALLS = 32  # ... and for the exactness guard (a mode may call ahead of what it hands out)

    def __init__(self, model, prompt: list[int], processors: list, logprobs: int | None = None, guard=None):
        """guard: an edgespec.logits.exactness.ExactnessGuard checking every emitted token, or None."""
        self._model = model
        self.prompt = list(prompt)
        self.processors = list(processors)
        self.logprobs = logprobs
        self.guard = guard
        self.emitted: list[int] = []
        self._records: dict[int, list[int]] = {}  # id(cache[0]) -> token at each cache position
        # Per call: (committed count, [(k, path)], processed rows, raw rows or None)
        self._rows: deque = deque(maxlen=self.GUARD_CALLS if guard is not None else self.KEEP_CALLS)

    def __getattr__(self, name):
        return getattr(self._model, name)

    def make_cache(self):
        caches = self._model.make_cache()
        if caches:
            self._records[id(caches[0])] = list(self.prompt)
        return caches

    # A request's processors apply to its own verifier caches only; calls on other caches (a
    # drafter's, a mid level's) pass through.

    # -------------------------------------------------------------- following the reply
    def follow(self, steps):
        """Pass a mode's tokens through, recording them (and their logprobs when asked). With
        the guard on, the request is replayed when it ends: its reply complete, or its reader
        done (max_tokens, a stop, a cancel: the generator is closed)."""
        try:
            for tok in steps:
                if self.logprobs is not None:
                    tok.top_logprobs = self.token_logprobs(len(self.emitted), tok.id)
                if self.guard is not None:
                    k = len(self.emitted)
                    self.guard.check(k, tok.id, list(self.emitted), *self._row_of(k))
                self.emitted.append(tok.id)
                yield tok
        except GeneratorExit:
            if self.guard is not None:
                self.guard.replay(self.prompt, self.emitted)
            raise
        if self.guard is not None:
            self.guard.replay(self.prompt, self.emitted)

    def committed(self, record: list[int], offset: int) -> list[int]:
        """The reply's tokens at cache positions [len(prompt), offset)."""
        P = len(self.prompt)
        n = offset - P
        if n <= 0:
            return []
        known = self.emitted[:n]
        if len(known) < n:  # written by earlier calls, not handed out yet
            known = known + record[P + len(known): P + n]
        if len(known) < n:
            # A mode called the verifier after a tree step before handing out that step's
            # tokens: the prefix is unknown, and guessing it would break exactness.
            raise GrammarError(f"the verifier was called at position {offset} with only {P + len(known)} "
                               "positions known (a mode must hand out a tree step's tokens first)")
        return known

    # -------------------------------------------------------------- the call
    def __call__(self, inputs, cache=None, mask=None, positions=None, layer_ids=None, return_hidden=False,
                 last_only=False):
        out = self._model(inputs, cache, mask=mask, positions=positions, layer_ids=layer_ids,
                          return_hidden=return_hidden, last_only=last_only)
        record = self._records.get(id(cache[0])) if cache else None
        if record is None or layer_ids is not None or inputs.ndim != 2 or inputs.shape[0] != 1:
            return out
        logits = out[0] if return_hidden else out
        toks = [int(t) for t in inputs[0].tolist()]
        T = len(toks)
        # The model has written this call's T positions (a layer without positions, e.g. a
        # recurrent state, may have none: the furthest that has one counts).
        offsets = [c.offset for c in cache]
        offset = max(offsets) if offsets else None
        if offset is None:
            raise RuntimeError("the verifier's caches keep no positions: response_format, penalties and "
                               "logprobs need them")
        offset -= T
        P = len(self.prompt)
        committed = self.committed(record, offset)
        # Ancestors of each row among this call's tokens (causal unless a tree mask says otherwise).
        if mask is None or isinstance(mask, str):
            paths_idx = None
        else:
            m = np.array(mask.astype(mx.bool_) if mask.dtype == mx.bool_ else (mask > -1e4))
            m = m.reshape(-1, m.shape[-2], m.shape[-1])[0][:, offset: offset + T]
            paths_idx = [np.nonzero(m[j, : j + 1])[0].tolist() for j in range(T)]
        # Record what the call wrote at each position (the causal chain; a tree's nodes are
        # resolved from what the mode then emits). Positions a tree step committed since the
        # last chain call are known once handed out: filled from the reply first, so that the
        # record stays aligned with the cache's positions; where they are not known yet, the
        # record stops short (and a call that would need them is refused, not guessed).
        if len(record) < offset:
            record.extend((self.prompt + self.emitted)[len(record): offset])
        del record[offset:]
        if paths_idx is None and len(record) == offset:
            record.extend(toks)
        rows = [T - 1] if last_only else list(range(T))
        paths: list[list[int] | None] = []
        ks: list[int] = []
        for j in rows:
            idx = list(range(j + 1)) if paths_idx is None else paths_idx[j]
            depth = len(idx)
            k = offset - P + depth  # the reply index of the token this row's distribution draws
            ks.append(k)
            if k < 0:
                paths.append(None)  # a row of the prompt
                continue
            path = [toks[i] for i in idx]
            if offset < P:  # a prefill reaching into the reply: only the reply's part counts
                path = path[P - offset:]
            paths.append(path)
        rows2d = logits.reshape(-1, logits.shape[-1])
        sel = rows2d if not last_only else rows2d[-1:]
        if sel.shape[0] != len(rows):
            raise RuntimeError(f"the verifier returned {sel.shape[0]} rows for a call of {len(rows)}: "
                               "cannot apply the request's logits processors")
        processed = sel
        if any(p is not None for p in paths):
            for proc in self.processors:
                processed = proc.process(processed, committed, paths)
        if self.logprobs is not None or self.guard is not None:
            self._rows.append((len(committed), [(k, tuple(p) if p is not None else None) for k, p in
                                                zip(ks, paths, strict=True)], processed,
                               sel if self.guard is not None else None))
        new = processed.reshape(logits.shape).astype(logits.dtype) if processed is not sel else logits
        return (new, out[1]) if return_hidden else new

    # -------------------------------------------------------------- logprobs
    def _row_of(self, k: int) -> tuple[mx.array | None, mx.array | None]:
        """(raw row, processed row) that drew reply token k after the emitted reply, from the
        latest calls; (None, None) when none did."""
        for c, entries, processed, raw in reversed(self._rows):
            if c > k:
                continue
            want = tuple(self.emitted[c:k])
            for i, (kk, path) in enumerate(entries):
                if kk == k and path == want:
                    return (raw[i] if raw is not None else None), processed[i]
        return None, None

    def token_logprobs(self, k: int, token: int) -> TokenLogprob | None:
        """The logprob of reply token k (= `token`) and the top alternatives, from the processed
        row that drew it (looked up among the latest calls)."""
        for c, entries, processed, _raw in reversed(self._rows):
            if c > k:
                continue
            want = tuple(self.emitted[c:k])
            for i, (kk, path) in enumerate(entries):
                if kk == k and path == want:
                    row = processed[i].astype(mx.float32)
                    lp = row - mx.logsumexp(row)
                    n = int(self.logprobs)
                    if n > 0:
                        top = mx.argpartition(-lp, kth=n - 1)[:n]
                        mx.eval(lp, top)
                        top_ids = np.array(top).tolist()
                    else:
                        mx.eval(lp)
                        top_ids = []
                    lp_np = np.array(lp)
                    pairs = sorted(((int(t), float(lp_np[t])) for t in top_ids if np.isfinite(lp_np[t])),
                                   key=lambda x: (-x[1], x[0]))
                    return TokenLogprob(int(token), float(lp_np[token]), pairs)
        return None


def make_processors(options, prompt: list[int], tokenizer, vocab_size: int) -> list:
    """The logits processors a request's options ask for (penalties, then the grammar)."""
    procs: list = []
    pen = getattr(options, "penalties", None)
    if pen is not None and pen.active:
        procs.append(PenaltyProcessor(pen, prompt, vocab_size))
    grammar = getattr(options, "response_format", None)
    if grammar is not None:
        procs.append(GrammarProcessor(grammar.matcher(tokenizer, vocab_size), vocab_size))
    return procs


def wrap_processors(model, mode, engine, options, prompt: list[int], sampler=None):
    """A request's processors over `model`, the model its mode runs (see ProcessedModel); the
    sources that declare `grammar` get the request's grammar. Returns (the model the mode is to
    run, the wrapper for its token stream: records emitted tokens, adds logprobs, runs the
    exactness guard when it is on: edgespec.logits.exactness), `model` and the identity when nothing
    applies. `sampler`: the request's (the guard recomputes its draws). The stack is set on the
    mode by its one composer, edgespec.batch.stack.compose_request."""
    V = engine.model.args.vocab_size
    procs = make_processors(options, prompt, engine.tokenizer, V)
    guard = None
    if guard_enabled(engine) and model is not None:
        # Without the request's sampler its draws can be recomputed only when its seed is fixed.
        known = sampler is not None or options.sampling.seed is not None
        replay = None
        if engine.kv_bits is None:  # quantized KV: a one-shot replay is not plain's (exactness.py)
            replay = (engine.model, engine.make_cache, make_processors(options, prompt, engine.tokenizer, V))
        guard = ExactnessGuard(make_processors(options, prompt, engine.tokenizer, V),
                               sampler if sampler is not None else Sampler(options.sampling),
                               getattr(mode, "name", "?"), len(prompt), draws_known=known, replay=replay)
    if not procs and options.logprobs is None and guard is None:
        return model, lambda steps: steps
    if model is None:
        raise ValueError(f"mode {getattr(mode, 'name', '?')!r} cannot apply response_format, penalties or "
                         "logprobs (it does not expose its verifier)")
    pm = ProcessedModel(model, prompt, procs, options.logprobs, guard)
    grammar = next((p for p in procs if isinstance(p, GrammarProcessor)), None)
    for source in getattr(mode, "sources", ()):
        caps = getattr(source, "caps", None)
        if caps is not None and getattr(caps, "grammar", False):
            source.bind(grammar, len(prompt))
    return pm, pm.follow
