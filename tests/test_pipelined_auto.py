"""Drafting while verifying in `auto` (edgespec.adaptive.pipeline): exact, priced, declined by
declared capability; the device model (edgespec.drafters.remote) it is shown with."""

import pytest
from conftest import make_tiny_model, make_tiny_tokenizer, random_prompts

from edgespec.adaptive.estimate import AcceptanceStats, Costs
from edgespec.adaptive.pipeline import PROBE_EVERY, Overlap, can_draft_ahead, placement
from edgespec.adaptive.policy import Policy, ScriptedPolicy, SeededPolicy, TimedPolicy
from edgespec.adaptive.sources import DrafterSource
from edgespec.drafters.base import DrafterCaps, ModelDrafter
from edgespec.drafters.remote import Contention, PacedVerifier, RemoteDrafter
from edgespec.engine import Engine
from edgespec.kernels import q8
from edgespec.weights.loader import LoadedModel

int8 = pytest.mark.skipif(q8.library() is None, reason="no C compiler for the int8 drafter's kernel")


class Ahead(Policy):
    """Draft k tokens in every round that can, and draft the next round ahead (or never)."""

    def __init__(self, k: int = 4, ahead: bool = True):
        super().__init__()
        self.k, self.ahead = k, ahead

    def choose(self, kind, default, **ctx):
        if kind == "plan" and ctx["can_draft"]:
            return ("tree", self.k)
        if kind == "pipeline":
            return self.ahead
        return default


class AheadBoth(Ahead):
    """Ahead, and from the runner-up premise as well wherever the tree has one."""

    def choose(self, kind, default, **ctx):
        if kind == "runner_up":
            return True
        return super().choose(kind, default, **ctx)


class Recorded(TimedPolicy):
    """The timed choices, the pipeline ones recorded (TimedPolicy records nothing)."""

    def pipeline(self, default):
        self.decisions.append(("pipeline", default))
        return default


_MODELS: dict = {}


def _engine(drafter: str, paced: tuple | None = None) -> Engine:
    """A tiny verifier with the int8 drafter or a small MLX drafter; paced=(verify base_s,
    per-token s, draft per-token s, contention): both through the device model."""
    if "m" not in _MODELS:
        _MODELS["m"] = make_tiny_model(0, scale=3.0)
        _MODELS["d"] = make_tiny_model(5, scale=3.0, num_hidden_layers=1)
    m = _MODELS["m"]
    cont = Contention(paced[3]) if paced else None
    model = PacedVerifier(m, paced[0], paced[1], cont) if paced else m
    eng = Engine(LoadedModel(model, make_tiny_tokenizer(m.args.vocab_size), None), check_exact=True, history="off")
    if drafter == "int8":
        from edgespec.drafters.quantized import QuantizedDrafter, quantize_model

        if "q" not in _MODELS:
            _MODELS["q"] = quantize_model(m)
        d = QuantizedDrafter(m, _MODELS["q"])
    else:
        d = ModelDrafter(_MODELS["d"])
    eng.drafter = RemoteDrafter(d, 0.0, paced[2], cont) if paced else d
    return eng


def _ahead_note(r) -> tuple[int, int] | None:
    for n in r.stats.notes:
        if n.startswith("drafted ahead:"):
            rounds = int(n.split(":")[1].split()[0])
            held = int(n.split("premise held ")[1].split(",")[0])
            return rounds, held
    return None


@pytest.mark.parametrize("drafter", [pytest.param("int8", marks=int8), "model"])
def test_greedy_drafted_ahead_equals_plain(drafter):
    """Every drafting round drafts the next ahead: the output is plain decoding's, token for
    token, with the runtime guard on; premises hold and fail both, over several prompts."""
    eng = _engine(drafter)
    held = rounds = 0
    for p in random_prompts(5, seed=11):
        plain = eng.generate(p, max_tokens=24, mode="plain").tokens
        eng.policy = Ahead(k=3)
        r = eng.generate(p, max_tokens=24, mode="auto")
        eng.policy = None
        assert r.tokens == plain, p
        got = _ahead_note(r)
        assert got is not None
        rounds, held = rounds + got[0], held + got[1]
    assert rounds > 0
    if drafter == "int8":  # it agrees with the verifier nearly always: premises hold (the MLX one's seldom)
        assert held > 0


@pytest.mark.parametrize("drafter", [pytest.param("int8", marks=int8), "model"])
def test_seeded_sampling_drafted_ahead_equals_plain(drafter):
    """Sampled with a seed: drafted ahead, synchronously and plain all draw the same tokens
    (the verifier's draws are keyed by position, never by how a round was drafted)."""
    eng = _engine(drafter)
    for i, p in enumerate(random_prompts(3, seed=12)):
        opts = dict(max_tokens=20, temperature=1.0, seed=77 + i)
        plain = eng.generate(p, mode="plain", **opts).tokens
        for ahead in (True, False):
            eng.policy = Ahead(k=4, ahead=ahead)
            got = eng.generate(p, mode="auto", **opts)
            eng.policy = None
            assert got.tokens == plain
            assert (_ahead_note(got) is not None) == ahead


def test_seeded_policies_explore_and_replay_the_pipeline_choice():
    """SeededPolicy draws the pipeline choice per drafting round; its decisions replay."""
    eng = _engine("model")
    p = random_prompts(1, seed=13)[0]
    plain = eng.generate(p, max_tokens=30, mode="plain").tokens
    seeded = SeededPolicy(3, p_plain=0.1)
    eng.policy = seeded
    got = eng.generate(p, max_tokens=30, mode="auto").tokens
    kinds = {d[1] for d in seeded.decisions if d[0] == "pipeline"}
    eng.policy = ScriptedPolicy(seeded.decisions)
    again = eng.generate(p, max_tokens=30, mode="auto").tokens
    eng.policy = None
    assert got == plain == again
    assert kinds == {True, False}


def test_option_pipeline_off_never_drafts_ahead():
    eng = _engine("model")
    p = random_prompts(1, seed=14)[0]
    eng.policy = Ahead(k=3)
    r = eng.generate(p, max_tokens=16, mode="auto", pipeline=False)
    eng.policy = None
    assert _ahead_note(r) is None
    assert r.tokens == eng.generate(p, max_tokens=16, mode="plain").tokens


def test_declared_capabilities_decide_who_drafts_ahead():
    class D:
        def __init__(self, caps):
            self.caps = caps

    assert can_draft_ahead(D(DrafterCaps())) is None
    assert "features" in can_draft_ahead(D(DrafterCaps(reads="features")))
    assert "roll back" in can_draft_ahead(D(DrafterCaps(syncs=False)))
    # a drafter that reads the verifier's cache (DFlash, MTP, Gemma 4's assistant) is declined,
    # unless it pins the cache and keeps the premise in a scratch (the int8 drafter)
    assert "cache" in can_draft_ahead(D(DrafterCaps(reads="verifier_cache")))
    assert can_draft_ahead(D(DrafterCaps(reads="verifier_cache", ahead=True))) is None
    from edgespec.drafters.quantized import QuantizedDrafter

    assert QuantizedDrafter.caps.ahead


def test_overlap_prices_the_choice():
    """Ahead when max(v*s_v, d'*s_d) + (1-p)*d' < v + d (d' = d + the guess token); unmeasured,
    it probes now and then."""
    apart = Overlap(fixed=(1.05, 1.05))
    assert apart.choose(0.020, 0.008, 0.002, 0.8)  # a Mac-like ratio: the draft hides in the pass
    shared = Overlap(fixed=(2.0, 2.0))
    assert not shared.choose(0.010, 0.008, 0.002, 0.8)  # on one CPU each halves the other
    assert not Overlap(fixed=(1.0, 1.0)).choose(0.010, 0.008, 0.002, 0.0)  # a premise that never holds
    learnt = Overlap("shared")
    picks = []
    for _ in range(2 * PROBE_EVERY + 2):  # each choice carried out
        picks.append(learnt.choose(0.010, 0.008, 0.002, 0.8))
        learnt.ran(picks[-1])
    assert picks.count(True) == 2 and picks[PROBE_EVERY]  # a probe after PROBE_EVERY synchronous rounds
    assert not learnt.choose(0.010, 0.008, 0.002, 0.8)  # the probe ran: the clock starts again
    for _ in range(PROBE_EVERY):
        learnt.ran(False)
    assert not learnt.choose(0.010, 0.008, 0.002, 0.1)  # no probe where the premise seldom holds
    for _ in range(3):  # measured: each side as fast beside the other as alone
        learnt.observe("v_alone", 0.010, 0.010)
        learnt.observe("v_over", 0.010, 0.010)
        learnt.observe("d_over", 0.008, 0.008)
    assert learnt.measured and learnt.s_v == pytest.approx(1.0)
    assert learnt.choose(0.010, 0.008, 0.002, 0.8)


@pytest.mark.parametrize("slowdown,want", [((1.0, 1.0), True), ((2.5, 2.5), False)])
def test_the_planner_drafts_ahead_when_the_injected_costs_favour_it(slowdown, want):
    """The decoder's timed choice: a 20 ms pass, a drafter at 2 ms a token that agrees 90% of
    the time: ahead with no slowdown, synchronous when each side slows the other 2.5x."""
    from edgespec.adaptive.decoder import AdaptiveDecoder

    m = make_tiny_model(0)
    costs = Costs([1, 2, 4, 8, 16], [0.020, 0.020, 0.021, 0.022, 0.024])
    src = DrafterSource(ModelDrafter(m), draft_s=0.002)
    dec = AdaptiveDecoder(m, [], costs, drafter=src, overlap=Overlap(fixed=slowdown))
    dec.acc = AcceptanceStats({"drafter": 0.9})
    dec.overlap = dec._overlap_given
    dec._early = None
    assert dec._ahead_pays(costs.verify(5), 4, 0.020) is want


def test_remote_drafter_keeps_its_tokens_and_sits_apart():
    eng = _engine("model", paced=(0.002, 0.0, 0.001, 1.0))
    d = eng.drafter
    assert placement(d) == "apart" and placement(d.inner) == "shared"
    p = random_prompts(1, seed=15)[0]
    eng.policy = Ahead(k=3)
    r = eng.generate(p, max_tokens=12, mode="auto")
    eng.policy = None
    assert r.tokens == eng.generate(p, max_tokens=12, mode="plain").tokens
    assert d.calls and all(k in (3, 4) for k in d.calls)  # k drafted, + the guess when ahead


@int8
def test_device_model_planner_choice_is_recorded():
    """With the device model (a flat 6 ms pass, the int8 drafter, which agrees with the tiny
    verifier nearly always, at 0.5 ms a token on its own unit, the slowdown fixed at none), the
    timed planner drafts ahead in the rounds it drafts."""
    eng = _engine("int8", paced=(0.006, 0.0, 0.0005, 1.0))
    pol = Recorded()
    eng.policy = pol
    p = random_prompts(1, seed=16)[0] * 3
    key_seen = []
    orig = Overlap.__init__

    def fixed(self, where="shared", fixed=None):
        key_seen.append(where)
        orig(self, where, (1.0, 1.0))

    Overlap.__init__ = fixed
    try:
        r = eng.generate(p, max_tokens=30, mode="auto")
    finally:
        Overlap.__init__ = orig
        eng.policy = None
    assert key_seen == ["apart"]
    choices = [d[1] for d in pol.decisions if d[0] == "pipeline"]
    assert r.tokens == eng.generate(p, max_tokens=30, mode="plain").tokens
    assert any(choices)
    assert _ahead_note(r)[0] > 0


@pytest.mark.parametrize("drafter", [pytest.param("int8", marks=int8), "model"])
def test_the_project_prompts_drafted_ahead_equal_plain(drafter):
    """The built-in prompt set (one prompt a domain, through the tiny tokenizer, its last 40
    tokens), greedy: drafted ahead in every drafting round, token for token plain's."""
    from edgespec.benchmark import load_prompts, select_prompts
    from edgespec.benchmark.runner import encode

    eng = _engine(drafter)
    ahead = 0
    for bp in select_prompts(load_prompts(None), per_domain=1):
        ids = encode(eng, bp, chat=False)[-40:]
        plain = eng.generate(ids, max_tokens=16, mode="plain").tokens
        eng.policy = Ahead(k=4)
        got = eng.generate(ids, max_tokens=16, mode="auto")
        eng.policy = None
        assert got.tokens == plain, bp.id
        ahead += (_ahead_note(got) or (0, 0))[0]
    assert ahead > 0


def test_a_request_dropped_on_the_drafter_s_thread_does_not_wait_for_that_thread():
    """The garbage collector finalises an abandoned request's generator on whichever thread
    allocates at the time, the drafter's worker included (seen: a fuzzer case whose request
    raised, collected during an int8 draft call). Its clean-up waits for the worker to be idle:
    on the worker itself that wait must not happen (it would never end)."""
    from concurrent.futures import TimeoutError as FutureTimeout

    from edgespec.adaptive.pipeline import Worker

    eng = _engine("model")
    eng.policy = Ahead(k=3, ahead=True)
    prompt = random_prompts(1, seed=9)[0]
    held = [eng.stream(prompt, max_tokens=40, mode="adaptive", sources="drafter")]
    it = iter(held[0])
    for _ in range(4):
        next(it)  # rounds drafted ahead are under way
    del it

    def drop():
        held.pop()  # the last reference: the generator is finalised here, on the worker
        return Worker().call(lambda: "inner")[0]  # and a call from the worker runs in place

    try:
        assert Worker().submit(drop).result(timeout=60)[0] == "inner"
    except FutureTimeout:
        pytest.fail("the request's clean-up waited for the drafter's worker from the worker")
    # the engine serves the next request
    assert eng.generate(prompt, max_tokens=8, mode="plain").tokens


def _runner_up_note(r) -> int:
    n = next(n for n in r.stats.notes if n.startswith("drafted ahead:"))
    return int(n.split("runner-up held ")[1].split(";")[0])


@pytest.mark.parametrize("drafter", [pytest.param("int8", marks=int8), "model"])
def test_runner_up_premises_drafted_ahead_equal_plain(drafter):
    """Every drafting round drafts ahead from the drafter's premise and from the runner-up (the
    likeliest other branch the tree leaves open): greedy output is plain's token for token.
    Through the device model (a 30 ms pass, the drafter on its own unit at 0.5 ms a token) the
    runner-up's draft starts before the pass ends; with prompts that repeat (the context source's
    branches beside the drafter's chain) and the small MLX drafter (which seldom agrees with the
    verifier), its premise holds where the drafter's fails, and its early chain is the next round's."""
    eng = _engine(drafter, paced=(0.03, 0.0, 0.0005, 1.0))
    held = 0
    for p in random_prompts(4, seed=21, max_len=12):
        p = p * 3
        plain = eng.generate(p, max_tokens=24, mode="plain").tokens
        eng.policy = AheadBoth(k=3)
        r = eng.generate(p, max_tokens=24, mode="auto")
        eng.policy = None
        assert r.tokens == plain, p
        held += _runner_up_note(r)
    o = next(v["overlap"] for v in eng.memory.adaptive.values() if "overlap" in v)
    assert o.runner_ups["drafted"] + o.runner_ups["skipped"] > 0
    assert o.runner_ups["held"] == held
    if drafter == "model":
        assert held > 0


def test_seeded_policies_draw_and_replay_the_runner_up_choice():
    """SeededPolicy draws the runner-up choice too (its own stream: the other choices of a seed
    are unchanged); the decisions replay to the same output."""
    eng = _engine("model")
    p = random_prompts(1, seed=22, max_len=12)[0] * 3
    plain = eng.generate(p, max_tokens=30, mode="plain").tokens
    seeded = SeededPolicy(5, p_plain=0.1)
    eng.policy = seeded
    assert eng.generate(p, max_tokens=30, mode="auto").tokens == plain
    kinds = {d[0] for d in seeded.decisions}
    assert "runner_up" in kinds
    eng.policy = ScriptedPolicy(seeded.decisions)
    assert eng.generate(p, max_tokens=30, mode="auto").tokens == plain
    eng.policy = None


def test_overlap_prices_the_runner_up():
    """A second early draft pays where it fits beside the pass (a drafter on its own unit) and
    its premise is likely enough; not where both share the cores and it outlasts the pass."""
    import threading

    from edgespec.adaptive.pipeline import unless

    apart, shared = Overlap(fixed=(1.0, 1.0)), Overlap(fixed=(2.0, 2.0))
    assert apart.runner_up_pays(0.020, 0.004, 0.5, 0.3)
    assert not apart.runner_up_pays(0.020, 0.004, 0.5, 0.0)  # a premise that never holds
    assert not shared.runner_up_pays(0.020, 0.015, 0.5, 0.3)
    ended, calls = threading.Event(), []
    assert unless(ended, calls.append, 1) is None and calls == [1]
    ended.set()
    assert unless(ended, calls.append, 2) is None and calls == [1]  # not started once the pass ended
