"""The Drafter protocol every speculative drafter implements, and a base for MLX-model drafters.

A drafter proposes k tokens continuing the *committed* sequence (prompt plus
every token the verifier has emitted). The speculative mode verifies them and
reports back with `accept(n_accepted, next_token)`: the first n_accepted
proposals were kept and `next_token` (the verifier's correction or bonus token)
follows them. `accept` may also come without a preceding `draft` (n_accepted=0)
when the verifier stepped alone (controller fallback to plain decoding).

What a drafter kind can do beyond that is declared by its class in `caps` (a
`DrafterCaps`), never probed: whether it has `sync(committed)` (set the committed
sequence to any list sharing a prefix with what it has seen: pipelining, `auto` and
the cascade need it), `fork()` (a state of its own per request), what it reads from
the verifier (`add_features` / `bind_verifier_cache`), whether it is an MLX causal LM
(tree growing, the cascade's mid level), whether its cache goes through a prefix store,
where it runs, the modes it drafts in, and whether its next draft first catches up on
committed tokens it has not seen (`unseen`, priced apart).
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Protocol, runtime_checkable

import mlx.core as mx
import numpy as np

from edgespec.caches.kv import KVCache, cache_arrays
from edgespec.caches.prefix import Reuse
from edgespec.generate import PREFILL_CHUNK


@dataclass
class Draft:
    tokens: list[int]  # k proposed token ids
    # (k, V) the drafter's *filtered* log-probs q (same SamplingParams transform as the
    # verifier, via sampler.logprobs); None = deterministic proposals (point mass on each token)
    logprobs: mx.array | None
    # With `draft(..., ranks=A)` (DrafterCaps.ranks): (ids, probs), each (k, A) numpy, the A
    # most likely tokens at every drafted position under the drafter's own unfiltered
    # distribution, the drafted token first. What a confident drafter is sure of, and its
    # runner-ups (edgespec.adaptive.sources.DrafterSource prices and branches on them).
    ranked: tuple | None = None


@dataclass
class DraftTree:
    """A drafter's own tree of guesses after the committed sequence (`draft_tree`, DrafterCaps.trees):
    node i is `tokens[i]` below node `parents[i]` (-1: below the last committed token), parents
    before children; `probs[i]` the drafter's own probability of it given its parent's path,
    `scores[i]` the product of those along its path (never larger than its parent's)."""

    tokens: list[int]
    parents: list[int]
    scores: list[float]
    probs: list[float]
    levels: int = 0  # drafter calls that grew it (one per depth)

    def __len__(self) -> int:
        return len(self.tokens)


CHAIN_MODES = frozenset({"speculative", "auto"})  # modes that draft along the committed sequence
ALL_MODES = CHAIN_MODES | {"tree", "cascade"}
READS = ("nothing", "features", "verifier_cache")


@dataclass(frozen=True)
class DrafterCaps:
    """What a drafter kind can do, declared once by its class (`caps`) and read by the modes,
    the batch and the engine instead of probing for methods.

    reads: what it takes from the verifier: "nothing"; "features" (the verifier's hidden
        states of the committed positions, through `features_needed` / `add_features`:
        drafts in mode 'speculative' only, unpipelined); "verifier_cache" (drafts from the
        live verifier cache handed over with `bind_verifier_cache`: no pipelining; trees only of its
        own (`trees`)).
    syncs: has `sync(committed)` (roll back to any committed sequence).
    forks: has `fork()`, a state of its own per request (the batch runs several at once).
    mlx_model: is an MLX causal LM with its own cache (`model`, `layer_ids`, `_forward`,
        `_trim_to`, `fed`): tree modes grow branches with it, the cascade verifies with it.
    prefix_store: its cache can go through the drafter prefix store (`prefix_reuse`,
        `reuses_prefixes()`, `stored_caches()`).
    runs_on: "mlx", "coreml" or "host" (no model).
    modes: the modes it drafts in.
    catches_up: its next draft call first feeds the committed tokens it has not seen yet
        (all but the last: tokens other sources' rounds committed since it drafted), and
        `unseen(committed)` counts them beforehand; callers price that catch-up apart from
        the drafting steps (edgespec.adaptive.sources.DrafterSource).
    ranks: `draft(k, sampler, ranks=A, floor=f)` also returns every drafted position's A most
        likely tokens and their probabilities (`Draft.ranked`), and stops drafting early once
        the product of its own top probabilities falls below f (at least one token).
    ahead: a drafter that reads the verifier's cache can still draft while the verifier's next
        pass runs (pipelined `auto`, edgespec.adaptive.pipeline): `pin()` reads the cache's
        verified positions now, and its next draft feeds every committed token after them
        from a scratch of its own, never looking at the cache the pass is changing.
    trees: `draft_tree(depth, width, topk, keep)` grows a tree of its own guesses after the
        committed sequence (`DraftTree`, EAGLE-2's dynamic tree: each depth expands the `width`
        best nodes by path score, `topk` children each, the best `keep` nodes kept) in one call
        per depth; mode `tree` verifies those trees, `auto` prices their nodes by the drafter's
        confidence like a chain's runner-ups (edgespec.adaptive.sources.DrafterSource).
    """

    reads: str = "nothing"
    syncs: bool = True
    forks: bool = False
    mlx_model: bool = False
    prefix_store: bool = False
    runs_on: str = "mlx"
    modes: frozenset = ALL_MODES
    catches_up: bool = False
    ranks: bool = False
    ahead: bool = False
    trees: bool = False

    def __post_init__(self):
        if self.reads not in READS:
            raise ValueError(f"reads must be one of {READS}, got {self.reads!r}")

    @property
    def needs_features(self) -> bool:
        return self.reads == "features"

    @property
    def reads_verifier(self) -> bool:
        """Drafts from the verifier's live cache (`bind_verifier_cache`)."""
        return self.reads == "verifier_cache"


@runtime_checkable
class Drafter(Protocol):
    name: str
    device: str  # "cpu" | "gpu" | "ane" | "none"
    vocab_size: int
    caps: ClassVar[DrafterCaps]
    model: object  # its own MLX model (weights), or None
    expected_acceptance: float  # prior per-token acceptance before any is measured

    def begin(self, prompt: list[int]) -> None: ...

    def draft(self, k: int, sampler) -> Draft: ...

    def accept(self, n_accepted: int, next_token: int) -> None: ...

    def close(self) -> None: ...


def ranked_tokens(logits: mx.array, token: mx.array, n: int) -> tuple[mx.array, mx.array]:
    """The n most likely tokens of `logits` (V,) under their softmax, `token` (the drafted
    one) first, then the others by falling probability: (ids (n,), probs (n,)), lazy."""
    p = mx.softmax(logits.astype(mx.float32), axis=-1)
    n = min(n, p.shape[-1])
    token = token.astype(mx.int32).reshape(1)
    # the drafted token out of the race (a tie broken otherwise than the sampler's argmax)
    others = mx.where(mx.arange(p.shape[-1]) == token, -1.0, p)
    rest = mx.argpartition(-others, n - 1)[: n - 1] if n > 1 else mx.zeros((0,), dtype=mx.int32)
    rest = rest[mx.argsort(-others[rest])] if n > 1 else rest
    ids = mx.concatenate([token, rest.astype(mx.int32)])
    return ids, p[ids]


def request_drafter(drafter):
    """The drafter one request drafts with: a fork with a state of its own when the drafter
    has one (`ModelDrafter.fork`), else the engine's drafter itself."""
    return drafter.fork() if drafter is not None and drafter.caps.forks else drafter


def fork_backend(backend):
    """A Core ML (or executor) backend for one request: the same loaded functions and
    weights, a state of its own (`reset` makes a new one)."""
    twin = copy.copy(backend)
    twin.reset()
    return twin


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class AcceptsDrafts:
    """accept() of the drafters: the committed sequence `seq` grows by the accepted part of
    `_last_draft` and the verifier's token (subclasses' `sync` drops what left the path);
    `_finish` ends a draft call."""

    seq: list[int]
    _last_draft: list[int]
    model = None  # no MLX model of its own unless a subclass has one
    host_bytes = 0  # bytes of weights it holds outside an MLX model (the int8 drafter's)
    expected_acceptance = 0.5

    def sync(self, committed: list[int]) -> None:
        raise NotImplementedError

    def accept(self, n_accepted: int, next_token: int) -> None:
        if not 0 <= n_accepted <= len(self._last_draft):
            raise ValueError(f"n_accepted must be in 0..{len(self._last_draft)}, got {n_accepted}")
        self.sync(self.seq + self._last_draft[:n_accepted] + [int(next_token)])

    def _finish(self, toks: list, rows: list) -> Draft:
        """The k sampled tokens (scalar arrays) and their log-prob rows (V,) of a draft call ->
        the Draft, evaluated at once (no host round trip between the steps)."""
        q = mx.stack(rows)  # (k, V)
        t = mx.stack(toks)
        mx.eval(t, q)
        self._last_draft = [int(x) for x in t.tolist()]
        return Draft(list(self._last_draft), q)


class ReadsVerifierCache(AcceptsDrafts):
    """The protocol of the drafters that own no cache of the committed text and read the
    verifier's (`reads="verifier_cache"`: Gemma 4's assistant, the verifier in int8): `begin`
    and `sync` only replace the committed sequence, `bind_verifier_cache` hands over the
    cache of the generation it serves, `close` lets it go."""

    cache = None

    def bind_verifier_cache(self, cache) -> None:
        """The verifier cache of the generation this drafter now serves."""
        self.cache = cache

    def begin(self, prompt: list[int]) -> None:
        if not prompt:
            raise ValueError("the drafter needs a non-empty prompt")
        self.sync(prompt)

    def sync(self, committed: list[int]) -> None:
        self.seq = list(committed)
        self._last_draft = []

    def close(self) -> None:
        self.cache = None

    def _no_draft(self) -> Draft:
        self._last_draft = []
        return Draft([], None)


class CommittedSequence(AcceptsDrafts):
    """sync() shared by the drafters that cache what they were fed.

    State: `seq` the committed sequence, `fed` the tokens whose entries are in the
    drafter's cache (a prefix of `seq`, plus draft tokens after a draft) and
    `_last_draft`. Subclasses implement `_trim_to(n)`: keep only the first n fed
    entries (drop KV positions, or just shorten `fed` for a fixed buffer).
    """

    seq: list[int]
    fed: list[int]
    _last_draft: list[int]

    def _trim_to(self, n: int) -> None:
        raise NotImplementedError

    def _rollback(self) -> None:
        """Drop cached entries that are not on the committed path (the last token is fed later)."""
        self._trim_to(common_prefix(self.fed, self.seq[:-1]))

    def sync(self, committed: list[int]) -> None:
        """Make `committed` the committed sequence; cached entries off that path are dropped."""
        self.seq = list(committed)
        self._last_draft = []
        self._rollback()

    def unseen(self, committed: list[int]) -> int:
        """Tokens of `committed` but its last that the next draft feeds before drafting (its
        catch-up), counted before the call: nothing changes. `fed` agrees with `seq` up to
        `seq`'s last token (sync and draft keep it so), so when `committed` extends the last
        synced sequence (the adaptive decoder's only grows) just the tail after it is compared."""
        body = len(committed) - 1
        if body <= 0:
            return 0
        n = len(self.seq)
        if 0 < n <= len(committed):
            i = min(len(self.fed), n - 1)
            while i < len(self.fed) and i < body and self.fed[i] == committed[i]:
                i += 1
            return body - i
        return body - common_prefix(self.fed, committed[:-1])


class ModelDrafter(CommittedSequence):
    """A drafter backed by an MLX causal LM with its own KV cache.

    State: `seq` is the committed sequence; the cache holds `cached` tokens,
    always a prefix of `seq` plus, after a draft, the draft tokens fed so far.
    The tokens of `seq` beyond the cache are fed in one pass at the next draft,
    so a fully accepted round costs no extra drafter pass.
    Subclasses set `model`, `vocab_size` and may override `_forward`.
    """

    name = "mlx"
    device = "cpu"
    caps = DrafterCaps(forks=True, mlx_model=True, prefix_store=True, catches_up=True, ranks=True)
    vocab_map = None  # a reduced-vocabulary drafter's VocabMap (DistilledDrafter sets its own)

    def __init__(self, model, layer_ids: list[int] | None = None):
        self.model = model
        self.layer_ids = layer_ids
        self.vocab_size = model.args.vocab_size
        self.cache: list[KVCache] = []
        self.seq: list[int] = []
        self.fed: list[int] = []  # tokens whose K/V are in the cache (len == cache offset)
        self._last_draft: list[int] = []
        # The request's use of the drafter's prefix store (DrafterReuse), set on a fork.
        self.prefix_reuse: DrafterReuse | None = None
        self.prefilled = 0  # positions begin() ran through the model (the rest were restored)

    def fork(self) -> ModelDrafter:
        """This drafter for one request: the same model and weights, a state of its own.

        The engine owns one drafter, while the batch (edgespec.batch) runs several requests
        at once, each in its own greenlet, switching at every verifier call: between a draft
        and its accept another request's draft would run. Each request's mode drafts with a
        fork, so no request's cache or committed sequence is another's."""
        twin = copy.copy(self)
        twin.cache, twin.seq, twin.fed, twin._last_draft = [], [], [], []
        twin.prefix_reuse, twin.prefilled = None, 0
        return twin

    def reuses_prefixes(self) -> bool:
        """Whether its cache can go through a prefix store: all layers, or a subset of a model
        whose layers each read only their own cache (Gemma 4's shared-key layers read others')."""
        return self.layer_ids is None or bool(getattr(self.model, "layerwise", True))

    def stored_caches(self) -> list:
        """The caches that hold the drafter's positions (a layer subset: only its layers)."""
        if self.layer_ids is None:
            return self.cache
        return [self.cache[i] for i in self.layer_ids]

    # -- model call: (1, T) tokens -> (T, V) logits, appending T positions to the cache
    def _forward(self, x: mx.array, last_only: bool = False) -> mx.array:
        """x (1, T) int32 -> logits (T, V); `last_only`: the last position's alone, (1, V)."""
        return self.model(x, self.cache, layer_ids=self.layer_ids, last_only=last_only)[0]

    def _trim_to(self, n: int) -> None:
        drop = len(self.fed) - n
        if drop > 0:
            for c in self.cache:
                c.trim(drop)
            del self.fed[n:]

    def begin(self, prompt: list[int]) -> None:
        if not prompt:
            raise ValueError("the drafter needs a non-empty prompt")
        self.cache = self.model.make_cache()
        self.fed = []
        self.seq = list(prompt)
        self._last_draft = []
        # Prefill all but the last token; it is fed with the first draft step. With the
        # drafter's prefix store, the longest cached prefix is restored first (whole blocks,
        # at most len(prompt) - 1 positions: exactly what the prefill would compute).

        body = self.seq[:-1]
        reuse = self.prefix_reuse
        done = reuse.restore(self.seq, self.stored_caches()) if reuse is not None else 0
        self.fed.extend(body[:done])
        self.prefilled = len(body) - done
        starts = list(range(done, len(body), PREFILL_CHUNK))
        # recurrent layers export their state only where it stands: pause at the last block
        # boundary so the prompt's blocks can be stored whole (as generate.prefill)
        pause = reuse.pause(len(body), done, len(body)) if reuse is not None else None
        if pause is not None:
            starts = sorted(set(starts) | {pause})
        for i, start in enumerate(starts):
            end = starts[i + 1] if i + 1 < len(starts) else len(body)
            piece = body[start:end]
            self._forward(mx.array(piece, dtype=mx.int32)[None])
            self.fed.extend(piece)
            mx.eval(cache_arrays(self.cache))
            if end == pause and end < len(body):
                reuse.store_prompt(self.seq, pause)
        if reuse is not None:
            reuse.store_prompt(self.seq, len(body))

    def draft(self, k: int, sampler, ranks: int = 0, floor: float = 0.0) -> Draft:
        """k tokens continuing `seq`; q (k, V) filtered with the sampler's params.

        ranks > 0: also the `ranks` most likely tokens of every drafted position with their
        probabilities (`Draft.ranked`, see DrafterCaps.ranks); drafting then stops early,
        after at least one token, once the product of the drafted tokens' own probabilities
        is below `floor` (each step is evaluated before the next: a host round trip a step)."""
        if k < 1:
            return Draft([], None)
        # Roll back anything not on the committed path, then feed the pending tokens.
        self._rollback()
        pending = self.seq[len(self.fed) :]
        toks, rows, tops = [], [], []
        feed = mx.array(pending, dtype=mx.int32)[None]  # (1, T)
        sure = 1.0
        for _ in range(k):
            # A catch-up feeds many tokens; only the last one's logits are drafted from.
            logits = self._forward(feed, last_only=True)[-1]  # (V,)
            lp = sampler.logprobs(logits)
            tok = sampler.sample(lp)
            toks.append(tok)
            rows.append(lp)
            feed = tok.reshape(1, 1).astype(mx.int32)
            if ranks:
                top = self._rank(logits, tok, ranks)
                tops.append(top)
                if floor > 0.0:
                    # the next step waits for this one: stop where the chain is unlikely to hold
                    mx.eval(top)
                    sure *= float(top[1][0].item())
                    if sure < floor:
                        break
            # else: all k steps are built lazily (each token feeds the next as an array) and
            # evaluated once: no host round trip between drafter steps.
        d = self._finish(toks, rows)
        if ranks:
            ids, probs = mx.stack([t[0] for t in tops]), mx.stack([t[1] for t in tops])
            mx.eval(ids, probs)
            d.ranked = (np.array(ids).astype(np.int64), np.array(probs).astype(np.float64))
        self.fed.extend(pending + d.tokens[:-1])
        return d

    def _rank(self, logits: mx.array, token: mx.array, n: int) -> tuple[mx.array, mx.array]:
        """`ranked_tokens` of one drafted position (a reduced-vocabulary drafter ranks its own
        slots: a softmax over the full vocabulary costs more than a drafting step's share)."""
        return ranked_tokens(logits, token, n)

    def close(self) -> None:
        self.cache = []
        self.fed = []


class DrafterReuse(Reuse):
    """One request's use of the drafter's prefix store (edgespec.caches.prefix, the engine's
    `drafter_prefix_cache`): the verifier's Reuse over the drafter's caches.
    `ModelDrafter.begin` restores from it and stores the prompt into it; at the request's end
    (`commit`, from the batch) the positions the drafter's cache holds on the committed path
    are kept: after rollback its cache may still hold rejected drafts, so only the leading
    positions whose tokens are both fed and committed."""

    stats_field = "drafter_cached_tokens"

    def __init__(self, store, drafter: ModelDrafter, stats=None):
        super().__init__(store, stats)
        self.drafter = drafter

    def needs_boundary(self, caches=None) -> bool:
        return super().needs_boundary(self.drafter.stored_caches() if caches is None else caches)

    def store_prompt(self, tokens: list[int], upto: int) -> None:
        self.store.store(tokens, self.drafter.stored_caches(), upto)

    def commit(self, tokens: list[int]) -> None:
        """`tokens`: the request's prompt + the reply handed out."""
        d = self.drafter
        if not d.cache:
            return  # it never began (a request the drafter did not draft for)
        upto = common_prefix(d.fed, tokens)
        if upto:
            self.store.store(tokens, d.stored_caches(), upto)


def read_folder_config(path: str | Path, name: str = "config.json") -> dict | None:
    """A drafter folder's JSON config as a dict; None when missing, unreadable or not an object
    (the folder is then not of the kind asking)."""
    p = Path(path) / name
    if not p.is_file():
        return None
    try:
        cfg = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return None
    return cfg if isinstance(cfg, dict) else None
