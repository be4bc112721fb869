"""Run decoding modes over a prompt set: warm-up, interleaved repeats, equality check.

Modes are interleaved per prompt (plain, A, B on prompt 1; A, B, plain on
prompt 2; ...) so slow drifts of the machine (thermal throttling, other
processes) hit every mode alike instead of whichever ran last. Under greedy
decoding every mode must reproduce the plain tokens exactly; a difference is
recorded as a mismatch, never averaged into the numbers, and classified: a
near-tie when plain's own log-probabilities of its token and the other one at
that position are within NEAR_TIE_LOGPROB (a verifier pass over many positions
rounds differently from a one-token pass, docs/bitwise.md), else a bug. With
bitwise verification on every mismatch is a bug.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from edgespec.adaptive.history import HistoryStore
from edgespec.benchmark.prompts import BenchPrompt
from edgespec.benchmark.specs import ModeSpec
from edgespec.costs.clock import simulate, wrap_methods
from edgespec.drafters import load_drafter
from edgespec.engine import make_options
from edgespec.kernels import exact
from edgespec.modes import available_modes


@dataclass
class RunRecord:
    """One measured generation of one prompt by one mode spec."""

    label: str
    prompt_index: int
    domain: str
    repeat: int
    tokens: list[int]
    finish_reason: str
    wall_s: float  # end to end, prompt encoding excluded
    stats: dict  # GenerationStats.as_dict()
    draft_calls: int = 0  # calls of a drafter's draft() (any source drafting with a model)
    # Under a cost profile (run_benchmark's `profile`): the simulated seconds of the generation
    # (sim_s), of its prompt passes (sim_prefill_s) and of its draft calls (sim_draft_s).
    sim: dict | None = None

    def compact(self) -> dict:
        """JSON-friendly record without the token ids."""
        s = {k: v for k, v in self.stats.items() if k != "notes"}
        return dict(
            label=self.label,
            prompt_index=self.prompt_index,
            domain=self.domain,
            repeat=self.repeat,
            finish_reason=self.finish_reason,
            wall_s=self.wall_s,
            draft_calls=self.draft_calls,
            **(self.sim or {}),
            **s,
        )


@dataclass
class Mismatch:
    label: str
    prompt_index: int
    domain: str
    repeat: int
    position: int  # first differing token index
    expected: int | None  # plain's token there (None: plain's output ended)
    got: int | None
    expected_len: int
    got_len: int
    # plain's log-prob of its token minus that of the other one at `position` (None: one output
    # ended there); near_tie: gap <= NEAR_TIE_LOGPROB and bitwise verification off
    gap: float | None = None
    near_tie: bool = False


NEAR_TIE_LOGPROB = 1e-3  # a flip by rounding: float32 passes of other widths differ by ~1e-5


@dataclass
class BenchRun:
    specs: list[ModeSpec]
    prompts: list[BenchPrompt]
    settings: dict
    records: list[RunRecord] = field(default_factory=list)
    unavailable: dict[str, str] = field(default_factory=dict)  # label -> reason
    errors: dict[str, str] = field(default_factory=dict)  # label -> first error
    mismatches: list[Mismatch] = field(default_factory=list)
    prompt_ids: list[list[int]] = field(default_factory=list)  # each prompt's token ids
    equality: dict = field(
        default_factory=dict
    )  # {"checked": bool, "reason": str, "comparisons": int}

    def status(self, label: str) -> str:
        if label in self.unavailable:
            return "unavailable"
        if label in self.errors:
            return "error"
        mine = [m for m in self.mismatches if m.label == label]
        if any(not m.near_tie for m in mine):
            return "mismatch"
        if mine:
            return "near-tie"
        return "ok"


def encode(engine, p: BenchPrompt, chat: bool) -> list[int]:
    """Token ids of a bench prompt: chat-templated unless raw (messages always are)."""
    if p.messages is not None:
        return engine.encode_prompt(messages=p.messages)
    if chat and engine.tokenizer.chat_template:
        return engine.encode_prompt(messages=[{"role": "user", "content": p.prompt}])
    return engine.encode_prompt(p.prompt)


def run_benchmark(
    engine,
    prompts: list[BenchPrompt],
    specs: list[ModeSpec],
    *,
    max_tokens: int = 128,
    repeats: int = 1,
    warmup: int = 1,
    temperature: float = 0.0,
    seed: int | None = None,
    chat: bool = True,
    on_progress: Callable[[int, str], None] | None = None,
    profile: str | None = None,
    verifier_shape: str | None = None,
    draft_device: str | None = None,
) -> BenchRun:
    """Measure every spec on every prompt `repeats` times after `warmup` rounds.

    specs[0] must be the plain reference (see specs.parse_mode_specs).
    profile: 'PROFILE[:FORMAT]' runs every generation on that Apple-silicon profile's simulated
    clock as well (edgespec.costs.clock.simulate: `auto` decides by its prices, each record keeps
    its simulated seconds); verifier_shape prices the verifier as that published model
    (edgespec.costs.model.SHAPES), draft_device puts every drafter on 'gpu', 'ane' or 'cpu'.
    `on_progress(n_done, description)` is called after each generation (and
    with the count of skipped generations when a mode drops out).
    """
    if not prompts:
        raise ValueError("no prompts to benchmark")
    if not specs or not specs[0].is_reference:
        raise ValueError("the first mode spec must be the plain reference")
    for name, v, lo in (
        ("repeats", repeats, 1),
        ("warmup", warmup, 0),
        ("max_tokens", max_tokens, 1),
    ):
        if not isinstance(v, int) or isinstance(v, bool) or v < lo:
            raise ValueError(f"{name} must be an integer >= {lo}, got {v!r}")
    progress = on_progress or (lambda n, desc: None)
    greedy = temperature == 0.0
    run = BenchRun(
        specs=specs,
        prompts=prompts,
        settings=dict(
            max_tokens=max_tokens,
            repeats=repeats,
            warmup=warmup,
            temperature=temperature,
            seed=seed,
            chat=chat,
            profile=profile,
            verifier_shape=verifier_shape,
            draft_device=draft_device,
        ),
    )
    registered = set(available_modes()) | {"auto"}
    active: list[ModeSpec] = []
    for s in specs:
        if s.mode in registered:
            active.append(s)
        else:
            run.unavailable[s.label] = (
                f"mode {s.mode!r} is not registered in this build; available: {', '.join(sorted(registered))}"
            )
    ids = [encode(engine, p, chat) for p in prompts]
    run.prompt_ids = ids

    def options(spec: ModeSpec, p: BenchPrompt):
        return make_options(
            max_tokens=p.max_tokens or max_tokens,
            temperature=temperature,
            seed=seed,
            mode=spec.mode,
            draft_tokens=spec.draft_tokens,
            **spec.options,
        )

    drafters: dict[str, object] = {}  # per-spec drafters, loaded once, by drafter spec
    history = _EarlierPrompts(engine.history, ids) if engine.history is not None else None
    sim = None  # the Simulation under a profile (set below)
    calls = _DraftCalls()

    def generate(spec: ModeSpec, i: int):
        default = engine.drafter
        if history is not None:
            engine.history = history.before(i)
        if spec.drafter is not None:
            if spec.drafter not in drafters:
                drafters[spec.drafter] = d = load_drafter(engine, spec.drafter)
                if d is not None and sim is not None:
                    sim.price_drafter(d)
                calls.watch(d)
            engine.drafter = drafters[spec.drafter]
        try:
            calls.n = 0
            before = sim.clock.snapshot() if sim is not None else None
            if sim is not None:
                sim.prompt_len = len(ids[i])
            t0 = time.perf_counter()
            res = engine.generate(ids[i], options=options(spec, prompts[i]))
            wall = time.perf_counter() - t0
            if history is not None and spec.is_reference:
                history.answered(i, res.tokens)
            simulated = None
            if sim is not None:
                after = sim.clock.snapshot()
                simulated = dict(sim_s=after[0] - before[0], sim_prefill_s=after[1] - before[1],
                                 sim_draft_s=after[2] - before[2])
            return res, wall, (calls.n, simulated)
        finally:
            engine.drafter = default
            if history is not None:
                engine.history = history.real

    def drop(spec: ModeSpec, err: BaseException, remaining: int):
        run.errors[spec.label] = f"{type(err).__name__}: {err}"
        active.remove(spec)
        if remaining:
            progress(remaining, spec.label)

    n_measured = repeats * len(prompts)

    def measure():
        # Warm-up: compile kernels, fill allocator pools, and find modes that cannot run at all.
        for w in range(warmup):
            for spec in list(active):
                try:
                    generate(spec, w % len(prompts))
                except Exception as e:  # a broken mode is reported, not fatal
                    drop(spec, e, (warmup - w) + n_measured)  # this round's too
                    continue
                progress(1, f"warm-up {spec.label}")

        for r in range(repeats):
            for i, p in enumerate(prompts):
                k = (i + r) % max(len(active), 1)
                for spec in active[k:] + active[:k]:
                    if spec not in active:
                        continue  # dropped earlier in this rotation
                    try:
                        res, wall, (n_calls, simulated) = generate(spec, i)
                    except Exception as e:
                        drop(spec, e, n_measured - (r * len(prompts) + i))
                        continue
                    run.records.append(
                        RunRecord(
                            spec.label,
                            i,
                            p.domain,
                            r,
                            list(res.tokens),
                            res.finish_reason,
                            wall,
                            res.stats.as_dict(),
                            n_calls,
                            simulated,
                        )
                    )
                    progress(1, f"{p.domain} {spec.label}")

    with contextlib.ExitStack() as stack:
        if profile is not None:
            sim = stack.enter_context(simulate(engine, profile, verifier_shape, draft_device))
        for d in (engine.drafter, getattr(engine, "auto_drafter", None)):
            calls.watch(d)
        stack.callback(calls.release)
        try:
            measure()
        except KeyboardInterrupt:  # keep what was measured: the report covers the finished runs
            run.settings["interrupted"] = True

    for d in drafters.values():
        if d is not None and d is not engine.drafter:
            d.close()
    check_equality(run, greedy, lambda ids: _logprobs(engine, ids))
    return run


def _logprobs(engine, ids: list[int]) -> np.ndarray:
    """The verifier's log-probabilities (V,) of the token after `ids` (one prompt pass)."""
    model = engine.loaded.model
    logits = model(mx.array([ids], dtype=mx.int32), model.make_cache(), last_only=True)[0, -1]
    lp = logits.astype(mx.float32) - mx.logsumexp(logits.astype(mx.float32))
    mx.eval(lp)
    return np.array(lp)


class _DraftCalls:
    """Counts the draft calls of the drafters watched (`n`, reset per generation): a drafter's
    `draft` wrapped (edgespec.costs.clock.wrap_methods), unwrapped by `release`."""

    def __init__(self):
        self.n = 0
        self._undo: list = []
        self._seen: set[int] = set()

    def watch(self, drafter) -> None:
        if drafter is None or id(drafter) in self._seen or not hasattr(drafter, "draft"):
            return
        self._seen.add(id(drafter))

        def draft(obj, original, *a, **kw):
            self.n += 1
            return original(obj, *a, **kw)

        self._undo.append(wrap_methods(drafter, "Counted", draft=draft))

    def release(self) -> None:
        for u in reversed(self._undo):
            u()
        self._undo.clear()
        self._seen.clear()


class _EarlierPrompts:
    """The history a bench generation may draft from: the replies to *earlier* prompts of the run.

    Prompt i sees prompts 0..i-1 (file order) with plain's replies, and nothing of
    itself, in every repeat: a warm-up or repeat never replays the answer being measured.
    The engine's own history is left untouched.
    """

    def __init__(self, real, ids: list[list[int]]):
        self.real = real
        self.ids = ids
        self.replies: dict[int, list[int]] = {}
        self.stores: dict[int, object] = {}

    def answered(self, i: int, tokens: list[int]) -> None:
        self.replies.setdefault(i, list(tokens))

    def before(self, i: int):
        store = self.stores.get(i)
        if store is None:
            store = _ReadOnly(HistoryStore(self.real.max_bytes))
            for j in range(i):
                if j in self.replies:
                    store.store.add(self.ids[j] + self.replies[j])
            if all(j in self.replies for j in range(i)):
                self.stores[i] = store  # complete: reuse in later repeats
        return store


class _ReadOnly:
    """A history store whose add() is a no-op (the bench decides what goes in)."""

    def __init__(self, store):
        self.store = store

    def add(self, tokens) -> None:
        pass

    def lookup(self, *args, **kwargs):
        return self.store.lookup(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.store, name)


def _first_difference(a: list[int], b: list[int]) -> int | None:
    for j, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return j
    return None if len(a) == len(b) else min(len(a), len(b))


def check_equality(run: BenchRun, greedy: bool, logprobs=None) -> None:
    """Compare every record's tokens with plain's first run of the same prompt (greedy only).
    `logprobs(ids) -> (V,)`: plain's distribution after `ids` (the prompt and plain's tokens
    before the difference), to classify a mismatch as a near-tie or a bug; None: all bugs."""
    bitwise = exact.enabled()
    run.settings.setdefault("bitwise", bitwise)
    ref = run.specs[0].label
    if not greedy:
        run.equality = dict(
            checked=False,
            reason="sampling (temperature > 0): outputs legitimately differ",
            comparisons=0,
        )
        return
    if ref in run.errors:
        run.equality = dict(
            checked=False, reason=f"the plain reference failed: {run.errors[ref]}", comparisons=0
        )
        return
    expected: dict[int, list[int]] = {}
    for rec in run.records:
        if rec.label == ref and rec.prompt_index not in expected:
            expected[rec.prompt_index] = rec.tokens
    n = 0
    for rec in run.records:
        want = expected.get(rec.prompt_index)
        if want is None:
            continue
        n += 1
        j = _first_difference(want, rec.tokens)
        if j is not None:
            gap = None
            if logprobs is not None and j < len(want) and j < len(rec.tokens):
                lp = logprobs(run.prompt_ids[rec.prompt_index] + want[:j])
                gap = float(lp[want[j]] - lp[rec.tokens[j]])
            run.mismatches.append(
                Mismatch(
                    label=rec.label,
                    prompt_index=rec.prompt_index,
                    domain=rec.domain,
                    repeat=rec.repeat,
                    position=j,
                    expected=want[j] if j < len(want) else None,
                    got=rec.tokens[j] if j < len(rec.tokens) else None,
                    expected_len=len(want),
                    got_len=len(rec.tokens),
                    gap=gap,
                    near_tie=gap is not None and not bitwise and gap <= NEAR_TIE_LOGPROB,
                )
            )
    run.equality = dict(
        checked=True,
        reason="greedy: every mode must reproduce plain token for token",
        comparisons=n,
        near_tie_logprob=NEAR_TIE_LOGPROB,
        bitwise=bitwise,
    )
