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

Those checks take the verifier's raw rows as given, so keys and values that do not belong to
the tokens they are stored for (a prefix-cache or history restore, a rolled-back or packed
cache, a row of the batch arena) would pass them. When the request ends (its reply complete,
cut short by max_tokens or a stop, or cancelled) the guard therefore also *replays* it
(`ExactnessGuard.replay`): the verifier runs over prompt + reply from empty caches of its own,
in fixed chunks as a prefill does, and every reply token is checked against that independent
row processed along the reply by a third, fresh set of processors (greedy: within
`REPLAY_TOLERANCE` of the argmax, the difference a pass of another width can round to;
sampled: probability > 0). Not replayed: quantized KV (a one-shot prefill quantizes other
blocks than the decode did, so its rows are not plain's).

On with `EDGESPEC_CHECK_EXACT=1` (the test suite sets it) or `Engine(check_exact=True)`;
off by default in production, where it costs a grammar matcher and a row's argmax per
token, and one prefill per request. A failure raises `ExactnessError` in the request that
broke, naming the token.
"""

from __future__ import annotations

import os

import mlx.core as mx
import numpy as np

# Modes whose sampled draws are Gumbel-max with noise keyed by (seed, position)
# (edgespec.logits.sampling.Sampler.sample_at): the guard can recompute their exact draw.
POSITION_DRAW_MODES = ("plain", "adaptive")

# How far (nats of log-probability) a replayed greedy token may fall below its row's best: the
# replay's passes are wider than the decode's, and float32 passes of other widths differ by
# ~1e-5 (measured on the default model: 6e-5 at most); a token from a row whose keys and values
# belong elsewhere is typically off by far more (the reported miss: 1.95).
REPLAY_TOLERANCE = 1e-2
REPLAY_CHUNK = 256  # positions per replay pass (bounded memory on long contexts)


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
                 draws_known: bool = True, replay=None):
        """draws_known: `sampler` is the request's own (or has its seed), so a position's draw
        can be recomputed. replay: (model, make_cache, fresh processors) to replay the finished
        request with (see `replay`), or None."""
        self.shadow = list(shadow_processors)
        self._replay = replay
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

    def replay(self, prompt: list[int], reply: list[int]) -> None:
        """The whole request again, from empty caches: each reply token against the verifier's
        row computed apart from everything the mode used (see the module docstring)."""
        if self._replay is None or not reply:
            return
        model, make_cache, procs = self._replay
        self._replay = None  # once per request
        seq = list(prompt) + list(reply[:-1])
        P = len(prompt)
        cache = make_cache()
        k = 0  # the reply token the next replayed row draws
        for start in range(0, len(seq), REPLAY_CHUNK):
            chunk = seq[start: start + REPLAY_CHUNK]
            logits = model(mx.array([chunk], dtype=mx.int32), cache)
            first = max(P - 1 - start, 0)  # rows that draw reply tokens: positions P-1 ...
            if first < len(chunk):
                out = logits[0, first:].astype(mx.float32)
                mx.eval(out)
                for row in out:  # checked as they come: one chunk's rows held at a time
                    self._check_replayed(k, reply, row, procs)
                    k += 1

    def _check_replayed(self, k: int, reply: list[int], row: mx.array, procs: list) -> None:
        token = reply[k]
        where = f"mode {self.mode_name!r}, reply token {k} (id {token}), replayed"
        ref = row[None]
        for proc in procs:
            ref = proc.process(ref, list(reply[:k]), [[]])
        row = ref[0].astype(mx.float32)
        lp = np.array(row - mx.logsumexp(row))
        if not np.isfinite(lp[token]):
            raise ExactnessError(f"{where}: has probability 0 in the verifier's row processed along the reply")
        if self.sampler.params.greedy:
            best = int(np.argmax(lp))
            gap = float(lp[best] - lp[token])
            if gap > REPLAY_TOLERANCE:
                raise ExactnessError(
                    f"{where}: the verifier alone prefers {best} there by {gap:.4g} nats (log-prob "
                    f"{lp[token]:.4f} vs {lp[best]:.4f}): the rows the mode drew from were not the "
                    "verifier's for this reply (keys and values of other tokens, or another row)")
