"""Lookahead decoding (Fu et al., 2024) as a step generator: no drafter weights.

Per verifier pass the model sees one token tree (see edgespec.lookahead.tree):
x0, the trie of up to G pooled n-grams keyed by x0 (verification branch) and
a W x (N-1) Jacobi window (lookahead branch), under one boolean mask with
explicit RoPE positions. The longest accepted root path is committed
(greedy: exact match; sampling: recursive rejection, see lookahead.verify),
its KV entries packed into place and the rest dropped. The window then
advances one Jacobi level: level j <- level j+1, the top level <- the
verifier's argmax at the old top level, and each column's trajectory
(N tokens) goes into the pool. A controller (lookahead.controller) measures
full steps, "lean" steps (pool candidates only) and plain steps on the fly
and runs the fastest, so lookahead never settles on something slower than plain.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import mlx.core as mx

from edgespec.adaptive.policy import policy_for
from edgespec.generate import GenerationStats, Token, prefill
from edgespec.logits.sampling import Sampler
from edgespec.lookahead import JacobiWindow, NgramPool, StepController, StepTree, verify_step
from edgespec.modes.registry import register_mode, validate_mode_options
from edgespec.modes.schema import Option

# CPU: measured with SmolLM2-135M on the project's 2-core Linux machine (a sweep of
# (W, N, G) in {(2,3,2), (4,4,4), (6,4,6), (3,5,4), (8,3,4)}): copying gave the same
# tokens/pass for (2,3,2) and (4,4,4), and every extra fed token costs CPU time, so
# the small tree won on copy and chat. GPU: wide passes are nearly free there, so the
# paper's larger window (not measured here: no Mac).
DEFAULTS = {"window": 2, "ngram": 3, "guesses": 2, "span": 8, "adaptive": True}
DEFAULTS_GPU = {"window": 5, "ngram": 4, "guesses": 5, "span": 8, "adaptive": True}  # a guess (never run on a Mac); edgespec.costs.priors
OPTIONS = [
    Option("window", "int", None, "Jacobi window columns W (0 = pooled n-grams only)", 0, 32),
    Option("ngram", "int", None, "n-gram size N: Jacobi levels + 1", 2, 8),
    Option("guesses", "int", None, "pooled candidates G verified per step", 0, 32),
    Option("span", "int", None, "tokens of the best copied candidate", 1, 32),
    Option("adaptive", "bool", None, "1: the step controller may drop the window or step plainly; 0: never"),
]


def default_options() -> dict:
    on_gpu = mx.default_device().type == mx.DeviceType.gpu
    return dict(DEFAULTS_GPU if on_gpu else DEFAULTS)


def parse_options(mode_options: dict) -> dict:
    """Lookahead settings: the device defaults, overridden by the validated mode_options."""
    return {**default_options(), **validate_mode_options("lookahead", mode_options)}


class LookaheadMode:
    name = "lookahead"

    def __init__(
        self,
        model,
        window: int = 2,
        ngram: int = 3,
        guesses: int = 2,
        span: int = 8,
        adaptive: bool = True,
        memory: dict | None = None,
    ):
        """memory: kept by the engine across requests; holds the step controller, so a window
        that did not pay on earlier replies is not warmed up again for every new one."""
        self.model = model
        self.memory = memory if memory is not None else {}
        self.policy = None  # the engine's Policy: the step kinds (make_lookahead sets it)
        self.W, self.N, self.G = window, ngram, guesses
        self.span = max(span, ngram - 1)
        self.adaptive = adaptive

    def _now(self) -> float:
        """The time rounds are priced by: the policy's clock (a cost profile's simulated one under
        `edgespec bench --profile`, edgespec.costs.clock; a paced one in tests), else the host's."""
        return self.policy.clock() if self.policy is not None else time.perf_counter()

    def steps(self, prompt: list[int], sampler: Sampler, stats: GenerationStats) -> Iterator[Token]:
        model, W, N = self.model, self.W, self.N
        cache = model.make_cache()
        t0 = self._now()
        logits = prefill(model, cache, prompt)
        lp = sampler.logprobs(logits)
        tok = sampler.sample(lp)
        mx.eval(tok, lp)
        x0 = int(tok.item())
        stats.prefill_s += self._now() - t0
        yield Token(x0, float(lp[x0].item()), "verifier")

        seq = list(prompt) + [x0]
        pool = NgramPool(self.span, N - 1)
        pool.add_text(seq)
        window = JacobiWindow(W, N, prompt) if W > 0 else None
        if "ctl" not in self.memory:
            self.memory["ctl"] = StepController(
                adaptive=self.adaptive, kinds=("full", "lean", "plain") if W > 0 else ("lean", "plain")
            )
        ctl = self.memory["ctl"]
        fell_back_noted = False
        while True:
            kind = ctl.choose(self.policy)
            t_step = self._now()
            tree = StepTree.rooted(x0)
            if kind != "plain":
                for cand in pool.candidates(seq, self.G):
                    tree.add_path(cand)
            if kind == "lean" and len(tree) == 1:
                kind = "plain"
            if kind == "full":
                tree.add_window(window.levels)
            T = len(tree)
            path, nxt, lps, pred_l = verify_step(model, cache, tree, sampler, want_pred=kind == "full")
            new = [tree.tokens[n] for n in path] + [nxt]
            seq.extend(new)
            pool.add_text(seq)
            if kind == "full":  # advance the window one Jacobi level, harvesting each column's N-gram
                window.advance(pool, [pred_l[n] for n in tree.window[-1]])
            x0 = nxt
            dt = self._now() - t_step
            ctl.record(kind, len(new), dt)
            stats.verifier_passes += 1
            stats.verify_s += dt
            depth = max((len(tree.path_to(n)) for n in range(T)), default=0) if T > 1 else 0
            if depth:
                stats.record_draft(depth, len(path))
            if ctl.fell_back and not fell_back_noted:
                fell_back_noted = True
                stats.notes.append(
                    "lookahead: the Jacobi window did not pay here; mostly pooled n-grams or plain steps"
                )
            for n, lpv in zip(path, lps, strict=False):
                yield Token(tree.tokens[n], lpv, "lookahead")
            yield Token(nxt, lps[-1], "verifier")


@register_mode(
    "lookahead",
    "weight-free lookahead decoding: Jacobi window + n-gram pool in one verifier pass",
    options=OPTIONS,
)
def make_lookahead(engine, options):
    o = parse_options(options.mode_options)
    memory = engine.memory.lookahead.setdefault(tuple(sorted(o.items())), {})
    mode = LookaheadMode(engine.model, **o, memory=memory)
    mode.policy = policy_for(engine)  # the step kinds (a seeded or scripted policy in tests)
    return mode
