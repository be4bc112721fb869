"""The simulated clock: a decoder run on a profile's time instead of the host's.

`simulate(engine, "m4-pro")` (a context manager) makes every verifier pass the engine's model runs
advance a `SimClock` by the roofline price of that pass (T positions after the cache's L,
edgespec.costs.model.RooflineCosts.verify), and every draft call of the engine's drafters by a
drafted token's price on the drafter's device (the catch-up over the tokens it had not seen
first). Tokens are the real ones (the real model runs; exactness is checked as always); only the
time is the profile's. While it is active, `default_clock()` is the simulated clock, so the
planner's policy (edgespec.adaptive.policy) times its rounds, plain steps and draft calls by it,
and the engine's learnt costs start from the profile's curve, in memory only
(edgespec.calibration.cost_store): decisions are priced by the profile, and the same run gives
the same simulated figures on any host.

`PassCosts` is the one interface a round is priced with: verify(T, L), a draft step, a prefill.
On the host it is answered by measurement (`edgespec.adaptive.estimate.Costs`), under a profile by
`RooflineCosts`.

Not modelled: pipelining (a drafter drafting round r+1 while the GPU verifies round r) happens only
where a mode overlaps them; `RooflineCosts.concurrent` prices it for the mode that does.
Decisions of modes other than `auto` made by their own timers (lookahead's and tree's step
controllers) still use the host clock; their simulated time is still the profile's.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from typing import Protocol

from edgespec.costs.model import FORMATS, SHAPES, RooflineCosts, Shape
from edgespec.costs.profiles import MID_RANGE, Profile, get

ENV = "EDGESPEC_COST_PROFILE"


class PassCosts(Protocol):
    """Seconds of what a round is made of."""

    def verify(self, T: int, L: int = 0) -> float: ...

    def prefill(self, P: int, L0: int = 0) -> float: ...


class SimClock:
    """Seconds that pass only when a priced piece of work runs (`advance`)."""

    def __init__(self):
        self.t = 0.0
        self.prefill_s = 0.0  # of which prompt passes
        self.draft_s = 0.0  # of which draft calls
        self.passes = 0  # verifier passes after the prompt
        self._lock = threading.Lock()

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float, kind: str = "verify") -> None:
        with self._lock:
            self.t += seconds
            if kind == "prefill":
                self.prefill_s += seconds
            elif kind == "draft":
                self.draft_s += seconds
            else:
                self.passes += 1

    def snapshot(self) -> tuple[float, float, float, int]:
        return self.t, self.prefill_s, self.draft_s, self.passes


_ACTIVE: list[Simulation] = []


def active() -> Simulation | None:
    """The simulation in force (None: the host's timer prices everything)."""
    return _ACTIVE[-1] if _ACTIVE else None


def default_clock():
    """What a decoder times with when none is given: the simulated clock under a profile,
    else the host's perf_counter."""
    sim = active()
    return sim.clock if sim is not None else time.perf_counter


def parse(spec: str) -> tuple[Profile, str]:
    """'m4-pro' or 'm4-pro:f16' -> (profile, weight format; q4_0 by default: the Mac's
    default-model configuration loads GGUF Q4)."""
    name, _, fmt = str(spec).partition(":")
    fmt = (fmt or "q4_0").strip().lower()
    if fmt not in FORMATS:
        raise ValueError(f"unknown weight format {fmt!r} in cost profile {spec!r}; known: {', '.join(FORMATS)}")
    return get(name), fmt


def from_env() -> str | None:
    """$EDGESPEC_COST_PROFILE (None when unset or empty); 'mid' names the mid-range profile."""
    v = os.environ.get(ENV, "").strip()
    if not v:
        return None
    return MID_RANGE if v.lower() == "mid" else v


class Simulation:
    """One profile's prices for one engine's passes (see the module docstring)."""

    def __init__(self, profile: Profile, fmt: str, shape: Shape, draft_device: str | None = None):
        self.profile, self.fmt, self.shape = profile, fmt, shape
        self.costs = RooflineCosts(profile, shape, fmt)
        self.clock = SimClock()
        self.prompt_len = 0  # positions of the current prompt: passes within them are prefill
        self.draft_device = draft_device

    def verify_pass(self, T: int, L: int) -> None:
        kind = "prefill" if L + T <= self.prompt_len else "verify"
        self.clock.advance(self.costs.verify(T, L), kind)

    def context_s(self) -> float:
        """The profile's price of one cached position for a one-token pass (Costs.ctx_s)."""
        return (self.costs.verify(1, 4096) - self.costs.verify(1, 0)) / 4096

    def curve(self, sizes, L: int = 256) -> list[float]:
        """The profile's verify curve over `sizes` at context L (the planner's starting prices)."""
        return [self.costs.verify(T, L) for T in sizes]


def _shape_of(model) -> Shape | None:
    try:
        return Shape.of(model)
    except (AttributeError, TypeError, ValueError):
        return None


def wrap_methods(obj, tag: str, **methods):
    """Give `obj` (this instance alone) a subclass of its class whose methods named in `methods`
    are `fn(self, original, *args, **kw)`: identity, attributes and isinstance unchanged, and a
    copy of the object (a drafter forked for a pipelined round) keeps working on its own state.
    -> undo (restores the class; undo in reverse order of wrapping)."""
    cls = type(obj)

    def make(name, fn):
        original = getattr(cls, name)

        def method(self, *a, **kw):
            return fn(self, original, *a, **kw)
        method.__name__ = name
        return method

    obj.__class__ = type(f"{tag}{cls.__name__}", (cls,), {n: make(n, f) for n, f in methods.items()})

    def undo():
        obj.__class__ = cls
    return undo


def _price_model(model, sim: Simulation):
    """Make `model`'s calls advance the clock by the price of the pass. -> undo."""
    def call(self, original, inputs, cache=None, *args, **kw):
        shape = getattr(inputs, "shape", (1, 1))
        T = int(shape[0]) * int(shape[1]) if len(shape) >= 2 else int(shape[0])
        L = int(getattr(cache[0], "offset", 0) or 0) if cache else 0
        sim.verify_pass(T, L)
        return original(self, inputs, cache, *args, **kw)

    return wrap_methods(model, "Priced", __call__=call)


def _price_drafter(drafter, sim: Simulation, verifier_shape: Shape):
    """Make a drafter's calls advance the clock: `sync` notes the tokens it has not seen yet,
    `draft` prices a drafted token each on its device, the first after feeding those. -> undo."""
    name = str(getattr(drafter, "name", ""))
    own = getattr(drafter, "model", None)
    shape = _shape_of(own) if own is not None else None
    fmt = sim.fmt
    free = False
    if shape is None:  # a drafter over the verifier's weights (int8), or one without weights
        shape, fmt = verifier_shape, "int8"
        free = not ("int8" in name or "quant" in name)  # prompt lookup and the like: host work only
    device = sim.draft_device or ("ane" if "coreml" in name else "gpu")
    state: dict[int, list[int]] = {}  # per drafter object (a fork has its own): [seen, unseen]

    def sync(self, original, seq, *a, **kw):
        st = state.setdefault(id(self), [-1, 0])
        st[1] = len(seq) if st[0] < 0 else max(len(seq) - st[0], 0)
        st[0] = len(seq)
        return original(self, seq, *a, **kw)

    def draft(self, original, k, *a, **kw):
        d = original(self, k, *a, **kw)
        if free:
            return d
        st = state.setdefault(id(self), [0, 0])
        n = max(len(getattr(d, "tokens", []) or []), 1)
        L = max(st[0], 0)
        first = sim.costs.draft_step(shape, fmt, device, unseen=st[1], L=L)
        rest = sim.costs.draft_step(shape, fmt, device, L=L)
        sim.clock.advance(first + (n - 1) * rest, "draft")
        st[0], st[1] = L + n, 0
        return d

    return wrap_methods(drafter, "Priced", sync=sync, draft=draft)


def attach(engine, spec: str, verifier_shape: Shape | str | None = None, draft_device: str | None = None):
    """Put `engine` on a profile's time until the returned `detach()` (see `simulate`, whose
    arguments these are) -> (the Simulation, detach). $EDGESPEC_COST_PROFILE does this for the
    engine `edgespec.load` makes, for the process's life."""
    profile, fmt = parse(spec)
    if isinstance(verifier_shape, str):
        if verifier_shape not in SHAPES:
            raise ValueError(f"unknown verifier shape {verifier_shape!r}; known: {', '.join(SHAPES)}")
        verifier_shape = SHAPES[verifier_shape]
    shape = verifier_shape or Shape.of(engine.model)
    sim = Simulation(profile, fmt, shape, draft_device)
    undo = [_price_model(engine.model, sim)]
    seen: set[int] = set()
    for d in (getattr(engine, "drafter", None), getattr(engine, "auto_drafter", None)):
        if d is not None and id(d) not in seen and hasattr(d, "draft") and hasattr(d, "sync"):
            seen.add(id(d))
            undo.append(_price_drafter(d, sim, shape))
    sim.price_drafter = lambda d: undo.append(_price_drafter(d, sim, shape))  # drafters loaded later
    # What the engine learnt on the host's time is set aside: a store priced by this profile,
    # in memory only (calibration.cost_store), and the decoders' memories start afresh.
    memory = getattr(engine, "memory", None)
    kept = {k: getattr(memory, k) for k in MEMORY_FIELDS if hasattr(memory, k)}
    for k, v in kept.items():
        setattr(memory, k, None if k == "cost_store" else type(v)())
    _ACTIVE.append(sim)

    def detach():
        if sim not in _ACTIVE:
            return
        _ACTIVE.remove(sim)
        for u in reversed(undo):
            u()
        for k, v in kept.items():
            setattr(memory, k, v)
    sim.detach = detach
    return sim, detach


@contextlib.contextmanager
def simulate(engine, spec: str, verifier_shape: Shape | str | None = None, draft_device: str | None = None):
    """Run `engine` on a profile's time (see the module docstring) -> the Simulation.

    spec: 'PROFILE[:FORMAT]' (edgespec.costs.profiles; format q4_0 by default).
    verifier_shape: price the verifier's passes as another model's (a SHAPES name such as
    'qwen3-4b', or a Shape): the tokens stay the engine's model's, the costs are the larger one's.
    draft_device: 'gpu', 'ane' or 'cpu' for every drafter (default: a Core ML drafter on the
    Neural Engine, the others on the GPU)."""
    sim, detach = attach(engine, spec, verifier_shape, draft_device)
    try:
        yield sim
    finally:
        detach()


MEMORY_FIELDS = ("cost_store", "adaptive", "speculative", "lookahead")
