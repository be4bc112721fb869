"""Generation as a stack of generators: decoding mode -> stream layer -> text.

A decoding mode yields `Token` records (id, log-prob, source) from its own
step loop; `stream_tokens` turns any of them into text chunks, stopping on
EOS, stop strings, max tokens or the context window, and finalises the stats.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol

import mlx.core as mx

from edgespec.caches.kv import KVCache, cache_arrays
from edgespec.logits.sampling import Sampler
from edgespec.tokenizer import StreamingDetokenizer, Tokenizer

PREFILL_CHUNK = 512


@dataclass
class Token:
    id: int
    logprob: float
    source: str  # "verifier" | "drafter" | "lookahead"
    # With options.logprobs: its logprob and alternatives under the processed verifier
    # distribution (edgespec.logits.processors.TokenLogprob), filled in as the token streams out.
    top_logprobs: object = None


@dataclass
class GenerationStats:
    mode: str = "plain"
    prompt_tokens: int = 0
    generated_tokens: int = 0
    verifier_passes: int = 0  # decode passes of the verifier (prefill excluded)
    drafted: int = 0
    accepted: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    draft_s: float = 0.0  # drafter busy time
    verify_s: float = 0.0  # verifier busy time
    hidden_draft_s: float = 0.0  # drafting overlapped with verification
    draft_tokens: int | None = None  # K in use (speculative), last value
    accepted_by_position: list[int] = field(default_factory=list)  # accepted count per draft index
    drafted_by_position: list[int] = field(default_factory=list)
    accepted_by_source: dict[str, int] = field(default_factory=dict)  # tree modes: kept drafts per source
    notes: list[str] = field(default_factory=list)
    peak_memory_bytes: int = 0
    cached_tokens: int = 0  # prompt positions restored from the prefix cache (not prefilled)
    drafter_cached_tokens: int = 0  # prompt positions the drafter restored from its own store

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    @property
    def tokens_per_pass(self) -> float | None:
        return self.generated_tokens / self.verifier_passes if self.verifier_passes else None

    def record_draft(self, drafted: int, accepted: int) -> None:
        """Count one verification round of `drafted` proposals with `accepted` kept."""
        self.drafted += drafted
        self.accepted += accepted
        while len(self.drafted_by_position) < drafted:
            self.drafted_by_position.append(0)
            self.accepted_by_position.append(0)
        for i in range(drafted):
            self.drafted_by_position[i] += 1
            if i < accepted:
                self.accepted_by_position[i] += 1

    def as_dict(self) -> dict:
        d = {k: v for k, v in self.__dict__.items()}
        d.update(
            tokens_per_s=self.tokens_per_s,
            acceptance_rate=self.acceptance_rate,
            tokens_per_pass=self.tokens_per_pass,
        )
        return d

    def summary(self) -> str:
        parts = [f"{self.generated_tokens} tokens", f"{self.tokens_per_s:.1f} tok/s", f"mode {self.mode}"]
        if self.cached_tokens:
            parts.append(f"{self.cached_tokens} of {self.prompt_tokens} prompt tokens reused")
        if self.verifier_passes:
            parts.append(f"{self.tokens_per_pass:.2f} tokens/pass")
        if self.drafted:
            parts.append(f"acceptance {self.acceptance_rate:.1%}")
            if self.draft_tokens:
                # adaptive: candidate tokens in the last verified tree; speculative modes: K
                parts.append(f"tree {self.draft_tokens}" if self.mode == "adaptive" else f"K={self.draft_tokens}")
        if self.draft_s or self.verify_s:
            parts.append(f"draft {self.draft_s:.2f}s / verify {self.verify_s:.2f}s")
        if self.hidden_draft_s:
            parts.append(f"hidden drafting {self.hidden_draft_s:.2f}s")
        return ", ".join(parts)


class DecodingMode(Protocol):
    """A decoding strategy: yields tokens forever; the stream layer decides when to stop."""

    name: str

    def steps(self, prompt: list[int], sampler: Sampler, stats: GenerationStats) -> Iterator[Token]: ...


def prefill(model, cache: list[KVCache], tokens: list[int], chunk: int = PREFILL_CHUNK,
            features: bool = False) -> mx.array | tuple[mx.array, mx.array]:
    """Run the prompt through the model in chunks; returns logits of its last position (V,).

    features=True also returns the final-norm hidden states of every prompt
    position (P, E) (for a feature drafter): (logits, features)."""
    # The engine's prefix cache (edgespec.caches.prefix), when `model` is a request's view of
    # the verifier: the longest cached prefix is restored and only the rest is run. Not for
    # features=True (the hidden states of the restored positions are not kept).
    reuse_of = None if features else getattr(model, "prefix_reuse", None)
    reuse = reuse_of(cache) if callable(reuse_of) else None
    done = reuse.restore(tokens, cache) if reuse is not None else 0
    # Recurrent layers export their state only where it stands: pause at the last block
    # boundary so the prompt's blocks can be stored whole.
    pause = reuse.pause(len(tokens) - 1, done, len(tokens), cache) if reuse is not None else None
    logits = None
    feats = []
    if len(tokens) - done > chunk:
        for c in cache:
            c.reserve(c.offset + len(tokens) - done)  # one allocation, not one regrowth per chunk
    starts = list(range(done, len(tokens), chunk))
    if pause is not None:
        starts = sorted(set(starts) | {pause})
    for i, start in enumerate(starts):
        end = starts[i + 1] if i + 1 < len(starts) else len(tokens)
        piece = mx.array([int(t) for t in tokens[start:end]], dtype=mx.int32)[None]
        if features:
            logits, h = model(piece, cache, return_hidden=True, last_only=True)
            feats.append(h[0])
        else:
            logits = model(piece, cache, last_only=True)
        if end < len(tokens):
            mx.eval(cache_arrays(cache) + feats)
        if reuse is not None and end == pause:
            reuse.store_prompt(tokens, pause)
    if reuse is not None:
        reuse.store_prompt(tokens, len(tokens))
    if features:
        return logits[0, -1], mx.concatenate(feats, axis=0)
    return logits[0, -1]


def runs_alone(model) -> bool:
    """False while `model` is a sequence's view of a batch (edgespec.batch) that holds other
    sequences too: its calls then return only after the batch's next pass."""
    ctx = getattr(model, "batch_context", None)
    return ctx is None or ctx() is None


class PlainMode:
    """Autoregressive decoding: the baseline every other mode must reproduce."""

    name = "plain"

    def __init__(self, model):
        self.model = model

    def steps(self, prompt: list[int], sampler: Sampler, stats: GenerationStats) -> Iterator[Token]:
        model = self.model
        cache = model.make_cache()
        t0 = time.perf_counter()
        logits = prefill(model, cache, prompt)

        def pick(logits, position):
            if sampler.params.greedy:
                # The greedy distribution is one-hot: log-prob 0 at the argmax. Skipping
                # the (V,) transform keeps the per-token graph as small as possible.
                return mx.argmax(logits, axis=-1), mx.array(0.0)
            lp = sampler.logprobs(logits)
            tok = sampler.sample_at(lp[None], [position])[0]  # noise keyed by position (see Sampler)
            return tok, lp[tok]

        position = len(prompt)
        tok, lp = pick(logits, position)
        mx.eval(tok, lp)
        stats.prefill_s += time.perf_counter() - t0
        while True:
            position += 1
            if position == len(prompt) + 1 or not runs_alone(model):
                # The first token goes out before the next step is queued (queueing can take
                # most of a pass: MLX's CPU async_eval waits while many tasks are pending).
                # In a batch every call waits for the batch's next pass: hand the token out
                # first, or it would reach its reader a whole step late.
                stats.verifier_passes += 1  # one per token, as below (the prefill's token counts one)
                yield Token(int(tok.item()), float(lp.item()), "verifier")
                tok, lp = pick(model(tok.reshape(1, 1), cache)[0, -1], position)
                continue
            # Alone: queue the next step before handing out this token so graph building
            # and Python overhead overlap the computation (mx.async_eval).
            nxt_logits = model(tok.reshape(1, 1), cache)[0, -1]
            nxt_tok, nxt_lp = pick(nxt_logits, position)
            mx.async_eval(nxt_tok, nxt_lp)
            stats.verifier_passes += 1
            yield Token(int(tok.item()), float(lp.item()), "verifier")
            tok, lp = nxt_tok, nxt_lp


@dataclass
class Chunk:
    """One piece of streamed output."""

    text: str
    tokens: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "context" | "cancelled" | None
    # With options.logprobs: one edgespec.logits.processors.TokenLogprob per token of `tokens`.
    logprobs: list | None = None
    # Engine.stream(tools=...): the tool calls (edgespec.logits.tools.ToolCall) completed in this chunk.
    tool_calls: list | None = None


def _stop_holdback(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:n]):
                best = max(best, n)
                break
    return best


def stream_tokens(
    steps: Iterator[Token],
    tokenizer: Tokenizer,
    stats: GenerationStats,
    max_tokens: int,
    stop: list[str] | None = None,
    context_left: int | None = None,
    cancel=None,
) -> Iterator[Chunk]:
    """Detokenize a mode's tokens into chunks; stop on EOS, stop strings, limits or `cancel()`.

    Text that could be the start of a stop string is held back until it is
    known not to be one, so a stop string never leaks into the output.
    """
    stop = [s for s in (stop or []) if s]
    detok = StreamingDetokenizer(tokenizer)
    pending_text = ""  # decoded, not yet emitted (possible stop-string prefix)
    pending_tokens: list[int] = []
    pending_lps: list = []
    want_lps = False
    limit = max_tokens if context_left is None else min(max_tokens, context_left)
    finish = "length" if limit == max_tokens else "context"
    stopped_on_string = False
    t0 = time.perf_counter()
    try:
        if limit <= 0:
            yield Chunk("", [], finish)
            return
        for tok in steps:
            if cancel is not None and cancel():
                finish = "cancelled"
                break
            if tok.id in tokenizer.eos_token_ids:
                finish = "stop"
                break
            stats.generated_tokens += 1
            pending_tokens.append(tok.id)
            if tok.top_logprobs is not None:
                want_lps = True
            pending_lps.append(tok.top_logprobs)
            pending_text += detok.add(tok.id)
            hold = 0
            if stop:
                hits = [i for i in (pending_text.find(s) for s in stop) if i >= 0]
                if hits:
                    pending_text = pending_text[: min(hits)]
                    finish, stopped_on_string = "stop", True
                    break
                hold = _stop_holdback(pending_text, stop)
            if len(pending_text) > hold:
                cut = len(pending_text) - hold
                yield Chunk(pending_text[:cut], pending_tokens, None, pending_lps if want_lps else None)
                pending_text, pending_tokens, pending_lps = pending_text[cut:], [], []
            if stats.generated_tokens >= limit:
                break
        if not stopped_on_string:
            pending_text += detok.flush()
        stats.decode_s = max(time.perf_counter() - t0 - stats.prefill_s, 1e-9)
        yield Chunk(pending_text, pending_tokens, finish, pending_lps if want_lps else None)
    finally:
        if stats.decode_s == 0.0:  # stopped early (Ctrl-C, a closed stream): time what ran
            stats.decode_s = max(time.perf_counter() - t0 - stats.prefill_s, 1e-9)
        close = getattr(steps, "close", None)
        if close is not None:
            close()
