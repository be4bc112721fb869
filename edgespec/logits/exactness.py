"""The runtime exactness guard: every emitted token checked against the row that drew it.

Every mode's tokens must be the ones plain decoding draws (greedy: token for token;
sampled: from the same processed distribution). The decoders get there through
machinery with many moving parts (tree rows derived from masks, grammar matchers
forked per row and rolled back, caches packed and restored), so a misalignment
would only show as a wrong word far downstream. The guard checks each token where
it is handed out, against an independent recomputation:

1. the processed verifier row that drew reply token k is looked up by (k, the
   committed path) among the latest calls (`ProcessedModel` keeps them); none
   found is an error (a token no verifier row drew);
2. that row is recomputed from the call's *raw* logits by shadow processors that
   only ever follow the committed reply, as plain decoding does (a fresh grammar
   matcher consuming token by token, never rolled back; penalties counted anew), and
   must equal the row the mode used, bit for bit;
3. greedy: the token must be that row's argmax (a tie with the argmax is allowed);
   sampled: the token must have probability > 0 there, and for the modes that draw
   by position (plain, adaptive: Gumbel noise keyed by (seed, position)) it must be
   exactly that draw.

On with `EDGESPEC_CHECK_EXACT=1` (the test suite sets it) or `Engine(check_exact=True)`;
off by default in production, where it costs a grammar matcher and a row's argmax per
token. A failure raises `ExactnessError` in the request that broke, naming the token.
"""

from __future__ import annotations

import os

import mlx.core as mx
import numpy as np

# Modes whose sampled draws are Gumbel-max with noise keyed by (seed, position)
# (edgespec.logits.sampling.Sampler.sample_at): the guard can recompute their exact draw.
POSITION_DRAW_MODES = ("plain", "adaptive")


class ExactnessError(AssertionError):
    """A token was emitted that plain decoding would not draw there (a bug, never user error)."""


def guard_enabled(engine=None) -> bool:
    flag = getattr(engine, "check_exact", None) if engine is not None else None
    if flag is not None:
        return bool(flag)
    return os.environ.get("EDGESPEC_CHECK_EXACT", "").strip().lower() in ("1", "true", "on", "yes")


class ExactnessGuard:
    """Checks each emitted token of one request (see the module docstring)."""

    def __init__(self, shadow_processors: list, sampler, mode_name: str, prompt_len: int,
                 draws_known: bool = True):
        """draws_known: `sampler` is the request's own (or has its seed), so a position's draw
        can be recomputed."""
        self.shadow = list(shadow_processors)
        self.sampler = sampler
        self.by_position = mode_name in POSITION_DRAW_MODES and draws_known
        self.mode_name = mode_name
        self.prompt_len = prompt_len
        self.checked = 0

    def check(self, k: int, token: int, committed: list[int], raw: mx.array | None,
              processed: mx.array | None) -> None:
        """Reply token k (= `token`, after `committed` = the reply's first k tokens), drawn
        from `processed` (the mode's row) computed from `raw` (the verifier's row)."""
        where = f"mode {self.mode_name!r}, reply token {k} (id {token})"
        if raw is None or processed is None:
            raise ExactnessError(f"{where}: no verifier row computed this token's distribution")
        ref = raw[None]
        for proc in self.shadow:
            ref = proc.process(ref, committed, [[]])
        ref_np = np.array(ref[0].astype(mx.float32))
        got_np = np.array(processed.astype(mx.float32))
        if not np.array_equal(ref_np, got_np):  # -inf (masked) entries compare equal
            diff = np.nonzero(ref_np != got_np)[0]
            raise ExactnessError(f"{where}: the row it was drawn from differs from the verifier's row processed "
                                 f"along the committed reply ({len(diff)} entries, e.g. token ids {diff[:5].tolist()}): "
                                 "a logits processor (grammar mask, penalties) saw the wrong prefix")
        if self.sampler.params.greedy:
            best = float(np.max(ref_np))
            if not ref_np[token] >= best:
                raise ExactnessError(f"{where}: not the argmax of its row (its logit {ref_np[token]:.6g}, "
                                     f"argmax {int(np.argmax(ref_np))} at {best:.6g})")
        else:
            lp = self.sampler.logprobs(mx.array(ref_np))
            lp_np = np.array(lp)
            if not np.isfinite(lp_np[token]):
                raise ExactnessError(f"{where}: has probability 0 in its row's sampling distribution")
            if self.by_position:
                draw = int(self.sampler.sample_at(lp[None], [self.prompt_len + k])[0].item())
                if draw != token:
                    raise ExactnessError(f"{where}: the position's draw there is {draw}")
        self.checked += 1
