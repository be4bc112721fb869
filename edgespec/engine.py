"""The Engine: one verifier (and optionally a drafter) behind a thread-safe generate/stream API.

About 650 lines: the public API's one class. Its settings are checked at load, a request's
options and mode are resolved per call, and its stream goes through the batch worker; all of
it reads the Engine's declared state (EngineMemory), so it stays one class in one module.
"""

from __future__ import annotations

import inspect
import logging
import numbers
import os
import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edgespec.adaptive.corpus import FILENAME as CORPUS_FILE
from edgespec.adaptive.corpus import CorpusError, CorpusTable
from edgespec.adaptive.history import make_history
from edgespec.adaptive.pipeline import on_worker
from edgespec.batch import Batcher, Request, memory
from edgespec.batch.request import cancel_callable as check
from edgespec.caches.kv_quant import check_settings, quantize_caches
from edgespec.caches.prefix import MEMORY, PrefixCache, check_limit, default_limit
from edgespec.drafters.registry import shipped_drafter_path
from edgespec.errors import ContextLengthError, ModelLoadError, UnknownOptionError
from edgespec.generate import Chunk, GenerationStats
from edgespec.logits.processors import Penalties
from edgespec.logits.sampling import SamplingParams
from edgespec.logits.tools import plan_tools
from edgespec.lookahead.memory import drafter_fits
from edgespec.modes import available_modes, make_mode
from edgespec.modes.adaptive import drafter_usable, make_adaptive_mode
from edgespec.options import GenerateOptions
from edgespec.tokenizer import chat_messages
from edgespec.weights.loader import LoadedModel

log = logging.getLogger("edgespec.engine")


def corpus_paths(engine) -> list[Path]:
    """Where a corpus for this model is looked for: the bundle's own, the attached drafter's
    folder (`edgespec distill` writes one there), then the one shipped beside this model's
    distilled drafter (edgespec/data/drafters/<name>/)."""
    out = []
    if engine.loaded.path is not None and Path(engine.loaded.path).is_dir():
        out.append(Path(engine.loaded.path) / CORPUS_FILE)
    if engine.drafter_folder is not None:
        out.append(Path(engine.drafter_folder) / CORPUS_FILE)
    shipped = shipped_drafter_path(engine)
    if shipped is not None:
        out.append(shipped / CORPUS_FILE)
    return out

# The prefix cache's default bound: this share of what the memory budget leaves for caches
# (it gives way to running requests: the batch evicts from it before admitting one), or
# this many bytes when nothing is known.
PROMPT_CACHE_SHARE = 0.2
PROMPT_CACHE_UNKNOWN_BUDGET = 512 << 20


@dataclass
class GenerationResult:
    text: str
    tokens: list[int]
    finish_reason: str
    stats: GenerationStats
    prompt_tokens: int = 0
    logprobs: list | None = None  # with options.logprobs: a TokenLogprob per token
    # chat(tools=...): the calls the model made (edgespec.logits.tools.ToolCall); `text` is then
    # the rest of the reply, and finish_reason "tool_calls" when there are calls.
    tool_calls: list = field(default_factory=list)


@dataclass
class EngineMemory:
    """What the engine keeps from request to request for the modules that learn or cache per
    engine, declared in one place (each field names its owner, the one module that fills it):
    nothing else is stored on an Engine from outside it."""

    speculative: dict = field(default_factory=dict)  # modes.speculative: (id(drafter), mode) -> controller memory
    lookahead: dict = field(default_factory=dict)  # modes.lookahead: its options -> controller memory
    adaptive: dict = field(default_factory=dict)  # modes.adaptive: (source names, id(drafter)) -> memory
    prompt_lookup_drafters: dict = field(default_factory=dict)  # modes.prompt_lookup: (ngram_max, ngram_min) -> drafter
    cascade_drafters: dict = field(default_factory=dict)  # modes.cascade: its settings -> CascadeDrafter
    cascade_students: dict = field(default_factory=dict)  # modes.cascade: shipped folder -> its tiny drafter
    cost_store: Any = None  # calibration.cost_store: the learnt verify/draft costs (a CostStore)
    tree_costs: Any = None  # calibration.CostStore.publish: the curve the batcher prices steps on (TreeCosts)
    fingerprint: str | None = None  # sessions.model_fingerprint: the verifier's identity


@dataclass
class Engine:
    """Owns the models; concurrent generations run together in one continuous batch.

    Every generation keeps its own KV caches, sampling settings, stop strings and
    seed; `stream`/`generate` from several threads join the same batch
    (edgespec.batch), up to `max_batch` at once (default: what the memory budget holds).
    """

    loaded: LoadedModel
    drafter: Any = None  # a Drafter (see edgespec.drafters) or None
    # The drafter mode auto drafts with instead of `drafter` when none was named at load: the
    # verifier's own weights in int8 where they can run (edgespec.drafters.registry.auto_drafter).
    auto_drafter: Any = None
    default_mode: str = "auto"
    memory_budget: int | None = None  # bytes; None = use the free memory detected
    # Earlier prompts and replies as a draft source: "memory" (default, this process only),
    # "disk" ($EDGESPEC_HOME/history), "off"; None = $EDGESPEC_HISTORY or "memory".
    history: Any = None
    # A frozen n-gram table of the verifier's own answers as a draft source (edgespec.adaptive.
    # corpus): None = the first corpus.bin of corpus_paths (the bundle's, the attached drafter
    # folder's, the one shipped for this model), read at the first adaptive request; "off" =
    # none; a path to a corpus file (read now); or a CorpusTable.
    corpus: Any = None
    # The folder the attached drafter was loaded from (edgespec.drafters.attach_drafter), or None.
    drafter_folder: Path | None = None
    max_batch: int | None = None  # generations decoded together; None = from the memory budget
    # Bytes of earlier prompts' and replies' caches kept for reuse (edgespec.caches.prefix):
    # None = edgespec.caches.prefix.default_limit (a few contexts' KV, capped), "memory" =
    # PROMPT_CACHE_SHARE of the memory budget's cache share, 0 = no reuse.
    prompt_cache_bytes: int | None = None
    # Whether the drafter's own cache is reused too (its store joins the prefix cache's bound);
    # None = $EDGESPEC_DRAFTER_REUSE ("on"/"off", default on). Off: the drafter prefills the
    # whole prompt every request (for side-by-side measurements).
    drafter_prefix_reuse: bool | None = None
    # KV-cache quantization (edgespec.caches.kv_quant; changes the output, so off by default):
    # bits 8 or 4, groups of kv_group_size along the head size, positions before
    # quantized_kv_start kept in full precision.
    kv_bits: int | None = None
    kv_group_size: int = 64
    quantized_kv_start: int = 0
    # Carries out every timing-driven decoding choice (edgespec.adaptive.policy); None = the
    # timed default. Tests put a SeededPolicy or ScriptedPolicy here to explore or replay.
    policy: Any = None
    # Check every emitted token against the verifier row that drew it (edgespec.logits.exactness);
    # None = $EDGESPEC_CHECK_EXACT (the test suite turns it on), default off.
    check_exact: bool | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    last_stats: GenerationStats | None = None
    _notes_said: set = field(default_factory=set, repr=False)
    # Notes from attaching the drafter (e.g. Core ML unavailable -> its MLX copy); modes show them.
    drafter_notes: list = field(default_factory=list, repr=False)
    memory: EngineMemory = field(default_factory=EngineMemory, repr=False, init=False)
    # Made at first use (properties below), under _lock.
    _prefix_cache: Any = field(default=None, repr=False, init=False)
    _drafter_prefix_cache: Any = field(default=None, repr=False, init=False)  # (drafter, PrefixCache)
    _batcher: Any = field(default=None, repr=False, init=False)
    _corpus_table: Any = field(default=None, repr=False, init=False)  # (resolved,) once looked up
    last_dropped: int = field(default=0, repr=False, init=False)  # turns the last truncate_oldest dropped
    load_notes: list = field(default_factory=list, repr=False)  # for the user, from edgespec.load (hub names)
    # Under $EDGESPEC_COST_PROFILE (edgespec.load): the profile's Simulation the decoders price by
    # (edgespec.costs.clock.attach); None: the host's timer.
    simulation: Any = field(default=None, repr=False)

    def __post_init__(self):
        check_settings(self.kv_bits, self.kv_group_size, self.quantized_kv_start,
                       getattr(self.model.args, "head_dim", None))
        if self.history is None or isinstance(self.history, str):
            self.history = make_history(self.history, self.history_key)
        if self.corpus is not None:  # given: checked now, before any request (the found one: lazily)
            self._corpus_table = (self._load_corpus(),)

    @property
    def history_key(self) -> str:
        """Names this model's history file: the vocabulary hash when the bundle records one."""
        m = self.loaded.manifest or {}
        key = m.get("vocab_hash") or (m.get("source") or {}).get("name")
        if not key:
            key = f"vocab{self.model.args.vocab_size}"
        return str(key)

    @property
    def model(self):
        return self.loaded.model

    @property
    def tokenizer(self):
        return self.loaded.tokenizer

    @property
    def context_length(self) -> int:
        return self.loaded.context_length

    @property
    def modes(self) -> list[str]:
        """The modes this engine can run now ("auto" resolves to one of them).

        speculative, tree (its default source is the drafter) and cascade need a drafter.
        """
        needs_drafter = ("speculative", "tree", "cascade")
        return [m for m in available_modes() if self.drafter is not None or m not in needs_drafter]

    # ------------------------------------------------------------------ prompts
    def encode_prompt(self, prompt: str | list[int] | None = None, messages: list[dict] | None = None,
                      tools: list[dict] | None = None) -> list[int]:
        """Token ids of a prompt or a conversation; `tools` (checked, OpenAI's shape) are
        rendered into the conversation by the chat template (edgespec.logits.tools)."""
        if (prompt is None) == (messages is None):
            raise ValueError("give exactly one of prompt or messages")
        if tools and messages is None:
            raise ValueError("tools need messages (a chat): a raw prompt has no template to render them")
        if messages is not None:  # checked message by message (tokenizer.chat_messages)
            ids = self.tokenizer.encode_chat(messages, context_length=self.context_length, tools=tools)
        elif isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            ids = self.tokenizer.encode(prompt, context_length=self.context_length)
        else:
            if isinstance(prompt, (bytes, bytearray, memoryview)):
                raise ValueError("prompt is bytes: decode it to text first (e.g. data.decode('utf-8')), "
                                 "or pass a list of token ids")
            try:
                items = list(prompt)
            except TypeError:
                raise ValueError(
                    f"prompt must be text or a list of token ids, got {type(prompt).__name__}"
                ) from None
            bad_type = [t for t in items if isinstance(t, bool) or not isinstance(t, numbers.Integral)]
            if bad_type:
                raise ValueError(f"token ids must be integers, got {bad_type[:3]!r}")
            ids = [int(t) for t in items]
            if not ids:
                raise ValueError("prompt is empty")
            V = self.model.args.vocab_size
            bad = [t for t in ids if not 0 <= t < V]
            if bad:
                raise ValueError(f"token ids out of range [0, {V}): {bad[:5]}")
        if len(ids) >= self.context_length:
            raise ContextLengthError(
                f"the prompt has {len(ids)} tokens; the context window is {self.context_length} "
                "(prompt plus reply must fit): shorten the prompt or the conversation"
            )
        return ids

    def fit_messages(self, messages: list[dict], room: int, tools: list[dict] | None = None) -> tuple[list[int], int]:
        """The conversation's tokens with its oldest whole turns dropped (a turn: a user message
        and what answers it) until `room` tokens are left for the reply; the leading system
        messages and the last turn always stay. Returns (ids, turns dropped); ContextLengthError
        when even the last turn does not fit."""
        messages = chat_messages(messages)
        head = 0
        while head < len(messages) and messages[head]["role"] == "system":
            head += 1
        system, rest = messages[:head], messages[head:]
        starts = [i for i, m in enumerate(rest) if m["role"] == "user"] or [0]
        room = max(0, min(room, self.context_length // 4))
        for dropped, start in enumerate([0, *[s for s in starts if s > 0]]):
            try:
                ids = self.encode_prompt(messages=system + rest[start:], tools=tools)
            except ContextLengthError:
                ids = None
            if ids is not None and len(ids) + room <= self.context_length:
                return ids, dropped
            if start == starts[-1]:
                if ids is not None:
                    return ids, dropped  # the last turn alone: its reply gets what is left
                break
        raise ContextLengthError(
            f"the last message alone does not fit the context window of {self.context_length} tokens: "
            "shorten it")

    def prompt_ids(self, prompt, messages, options: GenerateOptions, context_overflow: str = "error",
                   tools: list[dict] | None = None) -> list[int]:
        """The request's tokens; context_overflow="truncate_oldest" drops a conversation's
        oldest turns when it does not fit (with room for max_tokens), instead of refusing it.
        `tools`: rendered by the chat template (see encode_prompt)."""
        if context_overflow not in ("error", "truncate_oldest"):
            raise ValueError(f"context_overflow must be 'error' or 'truncate_oldest', got {context_overflow!r}")
        if context_overflow == "truncate_oldest" and messages is not None:
            if prompt is not None:
                raise ValueError("give exactly one of prompt or messages")
            ids, dropped = self.fit_messages(messages, options.max_tokens, tools)
            if dropped:
                self.last_dropped = dropped
            return ids
        return self.encode_prompt(prompt, messages, tools)

    def check_options(self, options: GenerateOptions) -> None:
        """What needs the model to check, checked before a request joins the batch: the
        response format compiles for this tokenizer (compiled once per tokenizer, cached)."""
        if options.response_format is not None:
            options.response_format.matcher(self.tokenizer, self.model.args.vocab_size)

    def resolve_mode(self, options: GenerateOptions) -> str:
        """'auto' -> the adaptive decoder, which picks the best source each round.

        A drafter that reads the verifier's features drafts in mode 'speculative' only,
        so auto keeps that mode for it.
        """
        if options.mode != "auto":
            return options.mode

        if self.drafter is not None and not drafter_usable(self.drafter) and self._drafter_fits():
            return "speculative"
        return "adaptive"

    def _drafter_fits(self) -> bool:
        return drafter_fits(self, self.memory_budget)

    def limit_memory(self, budget: int) -> None:
        """Hold the engine to `budget` bytes (`memory_budget`); the int8 drafter mode auto would
        draft with (`auto_drafter`) is let go, with a note, when its weights do not fit beside the
        verifier's and its caches: auto then drafts with the attached drafter, as before."""
        self.memory_budget = budget
        if self.auto_drafter is not None and not drafter_fits(self, budget, self.auto_drafter):
            self.auto_drafter = None
            self.load_notes.append("the int8 drafter does not fit the memory budget: auto drafts without it")

    def note_once(self, message: str) -> bool:
        """True the first time a note is seen (apps show each fallback message once)."""
        if message in self._notes_said:
            return False
        self._notes_said.add(message)
        return True

    # ------------------------------------------------------------------ generation
    def stream(
        self,
        prompt: str | list[int] | None = None,
        *,
        messages: list[dict] | None = None,
        options: GenerateOptions | None = None,
        cancel: Callable[[], bool] | None = None,
        stats: GenerationStats | None = None,
        context_overflow: str = "error",
        tools: list[dict] | None = None,
        tool_choice=None,
        parallel_tool_calls: bool | None = None,
        **kwargs,
    ) -> Iterator[Chunk]:
        """Yield text chunks as they are generated; the last chunk carries finish_reason.

        Keyword shortcuts: max_tokens, stop, temperature, top_k, top_p, min_p,
        seed, mode, draft_tokens (or pass `options`). Pass your own `stats`
        object to read this generation's stats when several threads share the
        engine (`last_stats` is whichever generation finished last).
        `context_overflow="truncate_oldest"`: a conversation longer than the context
        window loses its oldest turns instead of being refused. With `tools`
        (and `tool_choice`, `parallel_tool_calls`, as for chat), a chunk's `text` is
        content only and each call comes in `chunk.tool_calls` as soon as it is complete;
        finish_reason is then "tool_calls".
        """
        plan = None
        if messages is not None and (tools or tool_choice is not None):
            plan = self._tool_plan(tools, tool_choice, parallel_tool_calls, kwargs, options)
            tools = plan.render_tools
        options = resolve_options(options, kwargs)
        cancel = cancel_callable(cancel)  # refused here, not when the stream is first read
        ids = self.prompt_ids(prompt, messages, options, context_overflow, tools)
        self.check_options(options)
        mode_name = self.resolve_mode(options)
        chunks = self._stream(ids, options, mode_name, cancel, stats)
        return _tool_chunks(chunks, plan) if plan is not None and plan.parses else chunks

    def _tool_plan(self, tools, tool_choice, parallel_tool_calls, kwargs: dict, options):
        """The request's tool plan (edgespec.logits.tools); a constraint it needs goes into `kwargs`."""
        plan = plan_tools(tools, tool_choice, parallel_tool_calls, self.tokenizer.chat_template)
        if plan.response_format is not None:
            given = kwargs.get("response_format")
            if given is None and isinstance(options, dict):
                given = options.get("response_format")
            if given is None and isinstance(options, GenerateOptions):
                given = options.response_format
            if given is not None:
                raise ValueError(f"tool_choice {plan.choice!r} constrains the reply to a tool call; "
                                 "it cannot be combined with response_format")
            kwargs["response_format"] = plan.response_format
        return plan

    def build_mode(self, options: GenerateOptions, mode_name: str, stats: GenerationStats):
        """The decoding mode object for one generation (runs on the batch worker's thread)."""
        if mode_name == "adaptive" and options.mode == "auto" and (self.auto_drafter or self.drafter) is not None \
                and not drafter_fits(self, self.memory_budget, self.auto_drafter or self.drafter):
            # No extra weights: the drafter would not fit the memory budget.
            mode = make_adaptive_mode(self, options, use_drafter=False)
            stats.notes.append("auto: the drafter does not fit the memory budget; weight-free sources only")
        else:
            mode = make_mode(mode_name, self, options)
        stats.mode = getattr(mode, "name", mode_name)
        return mode

    @property
    def corpus_table(self):
        """The corpus source's table (edgespec.adaptive.corpus), or None; read at first use. A
        file that is damaged or built for another vocabulary is not used: a warning says why,
        and the engine drafts without it."""
        got = self._corpus_table
        if got is None:
            with self._lock:
                got = self._corpus_table
                if got is None:
                    got = self._corpus_table = (self._load_corpus(),)
        return got[0]

    def _vocab_hash(self) -> str:
        """The tokenizer's vocabulary hash: the bundle's record of it, else computed (~0.1 s
        for a 49k vocabulary, so not on a first request's path when the bundle has it)."""
        return (self.loaded.manifest or {}).get("vocab_hash") or self.loaded.tokenizer.vocab_hash()

    def set_drafter_folder(self, folder: Path | None) -> None:
        """Record where the attached drafter came from; a corpus found automatically is looked
        up again at the next request (the drafter's folder may hold one)."""
        with self._lock:
            self.drafter_folder = folder
            if self.corpus is None:
                self._corpus_table = None

    def _load_corpus(self):
        spec = self.corpus
        if spec == "off":
            return None
        if isinstance(spec, CorpusTable):
            return spec
        if spec is not None:
            paths, explicit = [Path(spec).expanduser()], True
        else:
            paths, explicit = corpus_paths(self), False
        for path in paths:
            if explicit or path.is_file():
                try:
                    table = CorpusTable.load(path, self._vocab_hash())
                    if table.max_token >= self.model.args.vocab_size:
                        raise CorpusError(f"{path}: token {table.max_token} is outside this model's vocabulary "
                                          f"({self.model.args.vocab_size})")
                    return table
                except (OSError, CorpusError) as e:
                    if explicit:
                        raise ModelLoadError(f"corpus: {e}") from None
                    log.warning("corpus not used: %s", e)
                    return None
        return None

    @property
    def prefix_cache(self):
        """The prefix cache every generation restores from and stores into (created at first use)."""
        pc = self._prefix_cache
        if pc is None:
            with self._lock:
                pc = self._prefix_cache
                if pc is None:
                    pc = self._prefix_cache = PrefixCache(self._prompt_cache_limit())
        return pc

    @property
    def drafter_prefix_cache(self):
        """The store of the engine's drafter's own caches (edgespec.caches.prefix), joined to
        `prefix_cache`: one byte bound and one least recently used order over both. A second
        store, not the same trie: the drafter's blocks are keyed by the same tokens but hold
        another model's keys and values (and another layer layout). None when reuse is off,
        the drafter has no cache of its own to reuse, or drafter reuse is turned off."""
        d = self.drafter
        if d is None or not d.caps.prefix_store or not d.reuses_prefixes():
            return None
        if not self._drafter_reuse_on():
            return None
        pc = self.prefix_cache
        if not pc.enabled:
            return None
        held = self._drafter_prefix_cache
        if held is None or held[0] is not d or held[1]._group is not pc._group:
            with self._lock:
                held = self._drafter_prefix_cache
                if held is None or held[0] is not d or held[1]._group is not pc._group:
                    if held is not None:
                        held[1].leave()  # another drafter's (or an earlier cache's) blocks go
                    held = self._drafter_prefix_cache = (d, PrefixCache(joins=pc))
        return held[1]

    def _drafter_reuse_on(self) -> bool:
        flag = self.drafter_prefix_reuse
        if flag is None:
            env = os.environ.get("EDGESPEC_DRAFTER_REUSE", "on").strip().lower()
            if env not in ("on", "off", "1", "0"):
                raise ValueError(f"EDGESPEC_DRAFTER_REUSE must be 'on' or 'off', got {env!r}")
            return env in ("on", "1")
        if not isinstance(flag, bool):
            raise ValueError(f"drafter_prefix_reuse must be True, False or None, got {flag!r}")
        return flag

    def kv_settings(self) -> dict:
        """What the caches' contents depend on beyond the model (saved caches must match)."""
        if self.kv_bits is None:
            return {}
        return {"bits": self.kv_bits, "group_size": self.kv_group_size, "start": self.quantized_kv_start}

    def make_cache(self, model=None) -> list:
        """The verifier's per-layer caches for one generation, quantized as the engine says."""
        caches = (model or self.model).make_cache()
        return quantize_caches(caches, self.kv_bits, self.kv_group_size, self.quantized_kv_start)

    def _prompt_cache_limit(self) -> int:
        limit = self.prompt_cache_bytes
        check_limit(limit)
        if limit is not None and limit != MEMORY:
            return int(limit)

        budget = memory.cache_budget(self, memory.free_memory_now() if self.memory_budget is None else None)
        share = PROMPT_CACHE_UNKNOWN_BUDGET if budget == float("inf") else max(int(budget * PROMPT_CACHE_SHARE), 0)
        return share if limit == MEMORY else default_limit(self, share)

    @property
    def batcher(self):
        """The continuous batcher every generation runs in (created at first use)."""
        b = self._batcher
        if b is None:
            self.prefix_cache  # noqa: B018 - made first (it takes the lock too): the batch shrinks it
            with self._lock:
                b = self._batcher
                if b is None:
                    b = self._batcher = Batcher(self, self.max_batch)
        return b

    def submit(self, ids, options, mode_name, emit, cancel=None, stats=None, ready=None):
        """Queue one generation in the batch; `emit(kind, payload)` receives its events
        (see edgespec.batch.Request) on the worker thread. Returns the Request (cancel())."""
        if not callable(emit):
            raise ValueError(f"emit must be a callable emit(kind, payload), got {type(emit).__name__}")
        if ready is not None and not callable(ready):
            raise ValueError(f"ready must be a callable returning a bool, got {type(ready).__name__}")
        self.check_options(options)
        stats = stats if stats is not None else GenerationStats()
        stats.mode, stats.prompt_tokens = mode_name, len(ids)
        req = Request(list(ids), options, mode_name, emit, stats, cancel, ready)
        self.batcher.submit(req)
        return req

    def _stream(self, ids, options, mode_name, cancel, stats=None) -> Iterator[Chunk]:
        # Joins the running batch: other threads' generations advance in the same passes.
        events: queue.SimpleQueue = queue.SimpleQueue()
        untaken = [0]  # chunks emitted and not yet handed to our reader (flow control)

        def emit(kind, payload):
            if kind == "chunk":
                untaken[0] += 1
            events.put((kind, payload))

        batcher = self.batcher
        req = self.submit(ids, options, mode_name, emit, cancel, stats, ready=lambda: untaken[0] == 0)
        finished = False
        try:
            while True:
                kind, payload = events.get()
                if kind == "chunk":
                    untaken[0] -= 1
                    batcher.wake()
                    yield payload
                elif kind in ("done", "error"):
                    finished = True
                    if kind == "error":
                        raise payload
                    return
        finally:
            if not finished:
                # The caller stopped reading: free the row now, and return once the worker has
                # let go of this generation (its stats are final, its caches released).
                req.cancel()
                batcher.wake()
                # Not where the batch may be waiting on this very thread: the drafter's worker
                # (the garbage collector can finalise an abandoned stream there): the row is
                # freed all the same, without waiting for it.
                if not on_worker():
                    while events.get()[0] not in ("done", "error"):
                        pass

    def generate_many(self, prompts: list, *, options=None, **kwargs) -> list[GenerationResult]:
        """Generate a reply to every prompt (text, token ids or a messages list) in one batch;
        results in the order given."""
        options = resolve_options(options, kwargs)
        items = []
        for p in prompts:
            ids = self.encode_prompt(messages=p) if isinstance(p, list) and p and isinstance(p[0], dict) \
                else self.encode_prompt(p)
            items.append(ids)
        self.check_options(options)
        mode_name = self.resolve_mode(options)
        results: list = [None] * len(items)
        done = threading.Semaphore(0)
        reqs = []

        def collector(i):
            parts: dict = {"text": [], "tokens": [], "finish": "length", "error": None,
                           "logprobs": [] if options.logprobs is not None else None}

            def emit(kind, payload):
                if kind == "chunk":
                    parts["text"].append(payload.text)
                    parts["tokens"].extend(payload.tokens)
                    if payload.logprobs is not None:
                        parts["logprobs"] = (parts["logprobs"] or []) + list(payload.logprobs)
                    if payload.finish_reason:
                        parts["finish"] = payload.finish_reason
                elif kind in ("done", "error"):
                    if kind == "error":
                        parts["error"] = payload
                    results[i] = parts
                    done.release()

            return emit

        try:
            for i, ids in enumerate(items):
                reqs.append(self.submit(ids, options, mode_name, collector(i)))
            for _ in reqs:
                done.acquire()
        finally:
            for r in reqs:
                r.cancel()
        out = []
        for ids, parts, req in zip(items, results, reqs, strict=True):
            if parts["error"] is not None:
                raise parts["error"]
            out.append(GenerationResult("".join(parts["text"]), parts["tokens"], parts["finish"], req.stats,
                                        len(ids), parts["logprobs"]))
        return out

    def generate(self, prompt=None, *, messages=None, options=None, cancel=None, context_overflow: str = "error",
                 tools=None, **kwargs) -> GenerationResult:
        options = resolve_options(options, kwargs)
        cancel = cancel_callable(cancel)
        ids = self.prompt_ids(prompt, messages, options, context_overflow, tools)
        self.check_options(options)
        text, tokens, finish = [], [], "length"
        lps = [] if options.logprobs is not None else None  # a list when asked for, even if empty
        stats = GenerationStats()  # ours alone: last_stats may already be another thread's
        for chunk in self._stream(ids, options, self.resolve_mode(options), cancel, stats):
            text.append(chunk.text)
            tokens.extend(chunk.tokens)
            if chunk.logprobs is not None:
                lps = (lps or []) + list(chunk.logprobs)
            if chunk.finish_reason:
                finish = chunk.finish_reason
        return GenerationResult("".join(text), tokens, finish, stats, len(ids), lps)

    def chat(self, messages: list[dict], *, tools: list[dict] | None = None, tool_choice=None,
             parallel_tool_calls: bool | None = None, **kwargs) -> GenerationResult:
        """A reply to `messages`. With `tools` (OpenAI's list of functions), the model's
        calls come back parsed in `result.tool_calls` (edgespec.logits.tools.ToolCall: name,
        arguments as a dict, id) and `text` holds the rest of the reply. `tool_choice`:
        "auto" (default with tools), "none", "required" or {"type": "function", "function":
        {"name": ...}}; the last two constrain the reply to the functions' parameter
        schemas (through response_format)."""
        if not tools and tool_choice is None:
            return self.generate(messages=messages, **kwargs)
        plan = self._tool_plan(tools, tool_choice, parallel_tool_calls, kwargs, kwargs.get("options"))
        result = self.generate(messages=messages, tools=plan.render_tools, **kwargs)
        if plan.parses:
            result.text, result.tool_calls = plan.parse(result.text)
            if result.tool_calls and result.finish_reason == "stop":
                result.finish_reason = "tool_calls"
        return result


def _tool_chunks(chunks, plan) -> Iterator[Chunk]:
    """`chunks` with the model's tool calls read out of their text (edgespec.logits.tools): text
    is content only, calls come in `tool_calls`, finish_reason "tool_calls" when any."""
    reader = plan.stream()
    try:
        for chunk in chunks:
            events = reader.feed(chunk.text)
            if chunk.finish_reason:
                events += reader.finish()
            calls = [e for kind, e in events if kind == "call"]
            finish = chunk.finish_reason
            if finish == "stop" and reader.calls:
                finish = "tool_calls"
            yield Chunk("".join(e for kind, e in events if kind == "content"), chunk.tokens, finish,
                        chunk.logprobs, calls or None)
    finally:
        chunks.close()  # the caller stopped reading: free the row now


def cancel_callable(cancel):
    """`cancel` checked at the API boundary (see edgespec.batch.batcher.cancel_callable)."""
    return check(cancel)


_SAMPLING = ("temperature", "top_k", "top_p", "min_p", "seed")


def resolve_options(options, keywords: dict) -> GenerateOptions:
    """A request's options from `options=` (GenerateOptions or a dict of make_options'
    keywords) and keyword settings: keywords override what `options` says; both are checked."""
    if options is None:
        return make_options(**keywords)
    if isinstance(options, dict):
        bad = [k for k in options if not isinstance(k, str)]
        if bad:
            raise ValueError(f"options keys must be strings, got {bad[:3]!r}")
        return make_options(**{**options, **keywords})
    if not isinstance(options, GenerateOptions):
        raise ValueError(
            f"options must be a GenerateOptions (edgespec.make_options(...)) or a dict of its keywords "
            f"(e.g. {{'max_tokens': 64}}), got {type(options).__name__}"
        )
    if not keywords:
        return options
    base = {"max_tokens": options.max_tokens, "stop": list(options.stop), "mode": options.mode,
            "draft_tokens": options.draft_tokens, "response_format": options.response_format,
            "logprobs": options.logprobs, "presence_penalty": options.penalties.presence,
            "frequency_penalty": options.penalties.frequency,
            "repetition_penalty": options.penalties.repetition, **options.mode_options}
    base.update({k: getattr(options.sampling, k) for k in _SAMPLING})
    return make_options(**{**base, **keywords})


def make_options(
    max_tokens: int = 256,
    stop: list[str] | str | None = None,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    seed: int | None = None,
    mode: str = "auto",
    draft_tokens: int | str = "auto",
    response_format=None,
    logprobs: int | None = None,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    repetition_penalty: float = 1.0,
    **mode_options,
) -> GenerateOptions:
    """A request's options, checked. `response_format`: None, {"type": "json_object"},
    {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}, {"type": "regex",
    "pattern"}, {"type": "grammar", "grammar", "syntax": "lark"|"gbnf"}, a JSON-schema dict or
    a Pydantic model class (edgespec.logits.structured). `logprobs`: k -> every streamed Chunk carries
    each token's logprob and its k most likely alternatives under the processed verifier
    distribution. Penalties: OpenAI presence/frequency over the reply, the CTRL/HF repetition
    penalty over prompt and reply; every mode applies them identically at every position."""
    sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed)
    penalties = Penalties(presence_penalty, frequency_penalty, repetition_penalty)
    try:
        return GenerateOptions(
            max_tokens=max_tokens,
            stop=list(stop) if isinstance(stop, (list, tuple)) else ([stop] if stop else []),
            sampling=sampling,
            mode=mode,
            draft_tokens=draft_tokens,
            mode_options=mode_options,
            response_format=response_format,
            logprobs=logprobs,
            penalties=penalties,
        )
    except UnknownOptionError as e:
        keywords = ", ".join(inspect.signature(make_options).parameters)
        raise UnknownOptionError(f"{e} (other keywords: {keywords.replace(', mode_options', '')})") from None
