"""The FastAPI application: OpenAI-compatible routes over one Engine and a FIFO Scheduler.

    GET  /health                 liveness + queue figures (no token needed)
    GET  /v1/models              the served model: its bundle name and "default"
    POST /v1/chat/completions    messages -> reply (JSON, or SSE with "stream": true)
    POST /v1/completions         raw text continuation (JSON or SSE)

Each response carries an `edgespec` object with the decoding stats
(mode, acceptance_rate, tokens_per_pass, tokens_per_s, ...).

About 630 lines: the routes share the request parsing, the scheduler and the SSE writer
below; each route is short. Request schemas live in schemas.py, the scheduler in
scheduler.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import hmac
import json
import sys
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from edgespec.apps.server.errors import APIError, error_body, error_response, install_error_handlers
from edgespec.apps.server.scheduler import Job, QueueFull, Scheduler
from edgespec.apps.server.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    engine_response_format,
)
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from edgespec.engine import make_options
from edgespec.errors import ContextLengthError, DrafterRequiredError, EdgespecError
from edgespec.modes import available_modes

KEEPALIVE_S = 1.0  # seconds without an event before an SSE keep-alive comment (see _sse)
FINISH = {"stop": "stop", "length": "length", "context": "length", "cancelled": "stop"}
SEED_LIMIT = 2**63


@dataclass
class ServerSettings:
    model_id: str
    api_key: str | None = None
    max_waiting: int = 16
    max_body_bytes: int = 4 << 20
    max_tokens_limit: int = 8192  # the most tokens one request may ask for
    # Server-side defaults for fields a request leaves out (make_options keywords).
    defaults: dict[str, Any] = field(default_factory=dict)


class BodyLimit:
    """ASGI wrapper: a request body past `limit` bytes gets 413 however it is sent.

    The Content-Length check in the app refuses a declared oversize body before it is
    read; this counts the bytes as they arrive, so a chunked upload (no Content-Length)
    is cut off at the limit too, and never read whole into memory.
    """

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        seen = 0
        refused = False
        started = False

        async def counted():
            nonlocal seen, refused
            if refused:
                return {"type": "http.disconnect"}
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.limit:
                    refused = True
                    if not started:
                        body = json.dumps(error_body(413, f"request body over {self.limit} bytes",
                                                     code="body_too_large")).encode()
                        await send({"type": "http.response.start", "status": 413,
                                    "headers": [(b"content-type", b"application/json"),
                                                (b"content-length", str(len(body)).encode()),
                                                (b"connection", b"close")]})
                        await send({"type": "http.response.body", "body": body})
                    return {"type": "http.disconnect"}  # the app stops reading; its answer is dropped
            return msg

        async def guarded_send(msg):
            nonlocal started
            if refused:
                return
            if msg["type"] == "http.response.start":
                started = True
            await send(msg)

        try:
            await self.app(scope, counted, guarded_send)
        except Exception:
            if not refused:
                raise


def create_app(engine, settings: ServerSettings, scheduler: Scheduler | None = None) -> FastAPI:
    scheduler = scheduler or Scheduler(engine, settings.max_waiting, clear_cache=_clear_mlx_cache)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        scheduler.close()  # cancel what runs, stop the worker

    app = FastAPI(title="edgespec", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.add_middleware(BodyLimit, limit=settings.max_body_bytes)  # chunked bodies too
    app.state.engine, app.state.scheduler, app.state.settings = engine, scheduler, settings
    engine.tokenizer.max_token_bytes  # noqa: B018 -- computed once now, not by the first request
    install_error_handlers(app)
    created = int(time.time())
    model_ids = (settings.model_id, "default")

    @app.middleware("http")
    async def _gate(request: Request, call_next):
        # Runs before routing and body parsing: without the token nothing else is revealed
        # (not even whether the body would have been valid).
        if settings.api_key is not None and request.url.path.startswith("/v1"):
            scheme, _, token = request.headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(),
                                                                     settings.api_key.encode()):
                return error_response(401, "missing or wrong API key: send 'Authorization: Bearer <key>' "
                                      "with the key given to `edgespec serve --api-key`",
                                      code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > settings.max_body_bytes:
            return error_response(413, f"request body over {settings.max_body_bytes} bytes", code="body_too_large")
        return await call_next(request)

    @app.get("/health")
    async def health():
        h = engine.history
        history = {"mode": "off"} if h is None else {
            "mode": "disk" if h.path is not None else "memory", "documents": h.documents,
            "bytes": h.nbytes, "max_bytes": h.max_bytes}
        return {"status": "ok", "model": settings.model_id, "modes": ["auto", *engine.modes],
                "queue": scheduler.snapshot(), "history": history,
                "prompt_cache": _prompt_cache_health(engine)}

    def model_card(mid: str) -> dict:
        return {"id": mid, "object": "model", "created": created, "owned_by": "edgespec"}

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [model_card(m) for m in model_ids]}

    @app.get("/v1/models/{model}")
    async def get_model(model: str):
        _check_model(model, model_ids)
        return model_card(model)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        plan = await run_in_threadpool(_tool_plan, body, engine)  # checks every tool's schema
        jobs = await _submit(body, messages=body.messages, plan=plan)
        return await _respond(request, body, jobs, _Shape(True, engine.tokenizer, body.logprobs_k(), plan))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        jobs = await _submit(body, prompt=body.prompt)
        return await _respond(request, body, jobs, _Shape(False, engine.tokenizer, body.logprobs_k()))

    async def _submit(body, prompt=None, messages=None, plan=None) -> list[Job]:
        _check_model(body.model, model_ids)
        # Off the event loop: a new response format is bounded, then compiled in a worker
        # process (edgespec.logits.structured), which takes milliseconds to seconds.
        options = await run_in_threadpool(_options, body, settings.defaults, settings.max_tokens_limit, plan)
        param = "messages" if messages is not None else "prompt"
        tools = plan.render_tools if plan is not None else None
        try:
            if isinstance(prompt, str):
                # A text too long for the context by its size alone is refused at once,
                # without tokenizing it (O(1) far from the bound: fine on the event loop).
                engine.tokenizer.check_length(prompt, engine.context_length)
            # Everything proportional to the input runs off the event loop: the messages'
            # text, the chat template, tokenizing (which releases the GIL on long texts).
            ids = await run_in_threadpool(_encode_prompt, engine, prompt, messages, options,
                                          getattr(body, "context_overflow", "error"), tools)
        except ContextLengthError as e:
            raise APIError(400, str(e), param, "context_length_exceeded") from None
        except ValueError as e:
            raise APIError(400, str(e), param, "invalid_prompt") from None
        try:
            # The response format compiled for this tokenizer (cached; the first use of a
            # schema takes milliseconds, so off the event loop).
            await run_in_threadpool(engine.check_options, options)
        except (ValueError, EdgespecError) as e:
            param = "response_format" if body.response_format is not None or plan is None else "tools"
            raise APIError(400, str(e), param, "invalid_value") from None
        loop = asyncio.get_running_loop()
        # n choices: n rows of the batch. With a seed, choice i samples with seed + i (the
        # same seed would make every sampled choice the same).
        jobs = [Job(ids, options if i == 0 else _reseeded(options, i), loop) for i in range(body.n)]
        try:
            for job in jobs:
                scheduler.submit(job)
        except QueueFull as e:
            for job in jobs:
                job.cancel()
            raise APIError(503, str(e), None, "queue_full", headers={"Retry-After": "1"}) from None
        return jobs

    async def _respond(request: Request, body, jobs: list[Job], shape: _Shape):
        rid = ("chatcmpl-" if shape.chat else "cmpl-") + uuid.uuid4().hex[:24]
        base = {"id": rid, "object": "chat.completion.chunk" if shape.chat else "text_completion",
                "created": int(time.time()), "model": settings.model_id}
        # Wait for each job's first event before choosing the status, so a request the
        # engine rejects (e.g. a mode that needs a drafter) still gets a 4xx; meanwhile a
        # client that gives up while queued cancels its jobs.
        watcher = asyncio.create_task(_watch_disconnect(request, jobs))
        streaming = False
        try:
            firsts = []
            for job in jobs:
                first = await job.out.get()
                _raise_if_error(first, engine)
                firsts.append(first)
            if not body.stream:
                return await _collect(jobs, firsts, base, shape)
            streaming = True
        finally:
            watcher.cancel()
            if not streaming:
                for job in jobs:
                    job.cancel()  # no-op when done
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(
            _sse(jobs, firsts, base, shape, include_usage),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    return app


# ---------------------------------------------------------------------- helpers
def _encode_prompt(engine, prompt, messages, options, overflow: str = "error", tools=None) -> list[int]:
    """The prompt's token ids (runs in a worker thread)."""
    if messages is not None:
        messages = [m.as_dict() for m in messages]
    return engine.prompt_ids(prompt, messages, options, overflow, tools)


def _tool_plan(body: ChatCompletionRequest, engine):
    """The request's tools and tool_choice checked (400 naming the field) -> a ToolPlan, or
    None when the request has neither."""
    if body.tools is None and body.tool_choice is None:
        return None  # parallel_tool_calls alone (some clients send it always) changes nothing
    from edgespec.logits.tools import plan_tools  # deferred: CLI start-up

    tools = [t.model_dump(exclude_none=True) for t in body.tools or []]
    choice = body.tool_choice.model_dump() if hasattr(body.tool_choice, "model_dump") else body.tool_choice
    try:
        plan = plan_tools(tools, choice, body.parallel_tool_calls, engine.tokenizer.chat_template)
    except ValueError as e:
        param = "tool_choice" if str(e).startswith("tool_choice") else "tools"
        raise APIError(400, str(e), param, "invalid_value") from None
    if plan.response_format is not None and engine_response_format(body.response_format) is not None:
        raise APIError(400, f"tool_choice {plan.choice!r} constrains the reply to a tool call; it cannot be "
                       "combined with a response_format (use tool_choice 'auto' or drop response_format)",
                       "response_format", "invalid_value")
    return plan


def _reseeded(options, i: int):
    """`options` for choice i of n: seed + i when a seed is set."""
    import dataclasses  # deferred: CLI start-up

    seed = options.sampling.seed
    if seed is None:
        return options
    return dataclasses.replace(options, sampling=dataclasses.replace(options.sampling, seed=(seed + i) % SEED_LIMIT))


def _check_model(model: str, model_ids) -> None:
    if model not in model_ids:
        raise APIError(404, f"model {model!r} is not served here; use one of: {', '.join(model_ids)}",
                       "model", "model_not_found")


def _options(body, defaults: dict[str, Any], max_tokens_limit: int | None = None, plan=None):
    """Request fields over server defaults -> GenerateOptions (ValueError -> 400 naming the field)."""
    asked = body.token_limit()
    if max_tokens_limit is not None and asked is not None and asked > max_tokens_limit:
        raise APIError(400, f"max_tokens {asked} is over this server's limit of {max_tokens_limit} "
                       "(edgespec serve --max-tokens-limit)", "max_tokens", "invalid_value")
    req = {
        "max_tokens": body.token_limit(), "stop": body.stop_list(), "temperature": body.temperature,
        "top_k": body.top_k, "top_p": body.top_p, "min_p": body.min_p, "seed": body.seed,
        "mode": body.mode, "draft_tokens": body.draft_tokens,
        # Sent to the engine only when set: neutral values change nothing.
        "response_format": engine_response_format(body.response_format)
        or (plan.response_format if plan is not None else None),
        "logprobs": body.logprobs_k(),
        "presence_penalty": body.presence_penalty or None, "frequency_penalty": body.frequency_penalty or None,
        "repetition_penalty": body.repetition_penalty if body.repetition_penalty != 1 else None,
    }
    kw = {**defaults, **{k: v for k, v in req.items() if v is not None}, **(body.mode_options or {})}
    mode = kw.get("mode", "auto")
    valid = ["auto", *available_modes()]
    if mode not in valid:
        raise APIError(400, f"unknown decoding mode {mode!r}; choose one of: {', '.join(valid)}", "mode",
                       "invalid_value")
    try:
        return make_options(**kw)
    except ValueError as e:
        param = next((k for k in req if str(e).startswith(k)), None)
        raise APIError(400, str(e), param, "invalid_value") from None


def _prompt_cache_health(engine) -> dict[str, Any]:
    """The prefix cache's stats, with the drafter's store joined to it (its bytes count
    against the same max_bytes)."""
    out = engine.prefix_cache.stats().as_dict()
    d = engine.drafter_prefix_cache
    ds = d.stats() if d is not None else None
    out["drafter_bytes"], out["drafter_blocks"] = (ds.bytes, ds.blocks) if ds is not None else (0, 0)
    return out


def _stats(job: Job) -> dict[str, Any]:
    s = job.stats
    return {
        "mode": s.mode, "acceptance_rate": s.acceptance_rate, "tokens_per_pass": s.tokens_per_pass,
        "tokens_per_s": s.tokens_per_s, "verifier_passes": s.verifier_passes, "drafted": s.drafted,
        "accepted": s.accepted, "draft_tokens": s.draft_tokens, "prefill_s": s.prefill_s,
        "decode_s": s.decode_s, "queue_s": job.queue_s, "notes": list(s.notes),
        "cached_tokens": s.cached_tokens, "drafter_cached_tokens": s.drafter_cached_tokens,
    }


def _usage(jobs: list[Job]) -> dict[str, int]:
    n = sum(j.stats.generated_tokens for j in jobs)
    p = len(jobs[0].ids)  # the prompt is counted once, however many choices (as OpenAI)
    return {"prompt_tokens": p, "completion_tokens": n, "total_tokens": p + n,
            "prompt_tokens_details": {"cached_tokens": jobs[0].stats.cached_tokens}}


def _edgespec(jobs: list[Job]) -> dict[str, Any]:
    """The decoding stats: choice 0's, and with n > 1 every choice's under "choices"."""
    out = _stats(jobs[0])
    if len(jobs) > 1:
        out["choices"] = [_stats(j) for j in jobs]
    return out


@dataclass
class _Shape:
    """What a response looks like: chat or completions, logprobs (alternatives per token,
    None: none), and the tool plan whose calls are read from the reply."""

    chat: bool
    tokenizer: Any
    logprobs: int | None = None
    plan: Any = None


def _chunk_logprobs(chunk) -> list[tuple[int, float, list[tuple[int, float]]]]:
    """(token, logprob, [(alternative, logprob), ...]) per token of an engine Chunk (its
    edgespec.logits.processors.TokenLogprob entries)."""
    return [(int(e.token), float(e.logprob), [(int(t), float(lp)) for t, lp in e.top])
            for e in chunk.logprobs or []]


class _Reply:
    """One choice, built from its job's chunks: content, tool calls, logprobs, finish."""

    def __init__(self, index: int, job: Job, shape: _Shape):
        self.index, self.job, self.shape = index, job, shape
        plan = shape.plan
        self.tools = plan.stream() if plan is not None and plan.parses else None
        self.content: list[str] = []
        self.calls: list = []
        self.finish = "length"
        self.finished = False
        self.lp_chat: list[dict] = []
        self.lp_tokens: list[str] = []
        self.lp_values: list[float] = []
        self.lp_top: list[dict] = []
        self.lp_offsets: list[int] = []
        self.offset = 0

    def _token(self, tid: int) -> tuple[str, list[int]]:
        b = self.shape.tokenizer.token_bytes(tid)
        return b.decode("utf-8", errors="replace"), list(b)

    def _logprobs(self, chunk) -> Any:
        """This chunk's logprobs in the endpoint's shape (None when not asked)."""
        if self.shape.logprobs is None:
            return None
        k = self.shape.logprobs
        entries = _chunk_logprobs(chunk)
        if self.shape.chat:
            part = []
            for tid, lp, alts in entries:
                text, raw = self._token(tid)
                tops = []
                for aid, alp in alts[:k]:
                    atext, araw = self._token(aid)
                    tops.append({"token": atext, "logprob": alp, "bytes": araw})
                part.append({"token": text, "logprob": lp, "bytes": raw, "top_logprobs": tops})
            self.lp_chat += part
            return {"content": part}
        part = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for tid, lp, alts in entries:
            text, _ = self._token(tid)
            part["tokens"].append(text)
            part["token_logprobs"].append(lp)
            part["top_logprobs"].append({self._token(a)[0]: alp for a, alp in alts[:k]})
            part["text_offset"].append(self.offset)
            self.offset += len(text)
        self.lp_tokens += part["tokens"]
        self.lp_values += part["token_logprobs"]
        self.lp_top += part["top_logprobs"]
        self.lp_offsets += part["text_offset"]
        return part

    def add(self, chunk) -> tuple[str, list[dict], Any]:
        """A chunk in -> (new content, new tool_call deltas, its logprobs)."""
        if self.tools is None:
            events = [("content", chunk.text)] if chunk.text else []
        else:
            events = self.tools.feed(chunk.text)
        if chunk.finish_reason:
            self.finish = FINISH.get(chunk.finish_reason, "stop")
            events += self._end()
        return self._take(events) + (self._logprobs(chunk),)

    def _end(self) -> list:
        if self.finished or self.tools is None:
            return []
        self.finished = True
        return self.tools.finish()

    def end(self) -> tuple[str, list[dict]]:
        """The job is done: what the tool reader still held."""
        return self._take(self._end())

    def _take(self, events) -> tuple[str, list[dict]]:
        from edgespec.logits.tools import openai_tool_call_deltas  # deferred: CLI start-up

        text = "".join(e for kind, e in events if kind == "content")
        calls = [e for kind, e in events if kind == "call"]
        deltas = openai_tool_call_deltas(calls, len(self.calls))
        self.content.append(text)
        self.calls += calls
        return text, deltas

    @property
    def finish_reason(self) -> str:
        return "tool_calls" if self.calls else self.finish

    def final(self) -> dict:
        """The whole choice (non-streamed response)."""
        text = "".join(self.content)
        if not self.shape.chat:
            lp = None if self.shape.logprobs is None else {
                "tokens": self.lp_tokens, "token_logprobs": self.lp_values, "top_logprobs": self.lp_top,
                "text_offset": self.lp_offsets}
            return {"index": self.index, "text": text, "logprobs": lp, "finish_reason": self.finish_reason}
        message: dict[str, Any] = {"role": "assistant", "content": text if text or not self.calls else None}
        if self.calls:
            message["tool_calls"] = [c.to_openai() for c in self.calls]
        lp = None if self.shape.logprobs is None else {"content": self.lp_chat}
        return {"index": self.index, "message": message, "logprobs": lp, "finish_reason": self.finish_reason}

    def delta(self, text: str | None, deltas: list[dict] | None = None, logprobs=None,
              finish: str | None = None, first: bool = False) -> dict:
        """One streamed choice."""
        if not self.shape.chat:
            return {"index": self.index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
        d: dict[str, Any] = {"role": "assistant", "content": text or ""} if first else (
            {"content": text} if text else {})
        if deltas:
            d["tool_calls"] = deltas
        return {"index": self.index, "delta": d, "logprobs": logprobs, "finish_reason": finish}


def _event(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _merge(jobs: list[Job], firsts: list, into: asyncio.Queue) -> None:
    """Every job's events, tagged with its choice index, onto one queue."""

    async def pump(i: int, job: Job):
        event = firsts[i]
        while True:
            await into.put((i, event))
            if event[0] in ("done", "error"):
                return
            event = await job.out.get()

    await asyncio.gather(*(pump(i, j) for i, j in enumerate(jobs)))


async def _sse(jobs: list[Job], firsts: list, base: dict, shape: _Shape, include_usage: bool) -> AsyncIterator[str]:
    """Server-sent events. Leaving this generator early (the client went away: Starlette
    cancels it) cancels the jobs, which frees the engine at their next token."""
    replies = [_Reply(i, j, shape) for i, j in enumerate(jobs)]
    events: asyncio.Queue = asyncio.Queue()
    pump = asyncio.create_task(_merge(jobs, firsts, events))
    open_ = len(jobs)
    try:
        if shape.chat:
            for r in replies:
                yield _event({**base, "choices": [r.delta("", first=True)]})
        while open_:
            try:
                i, (kind, payload) = await asyncio.wait_for(events.get(), KEEPALIVE_S)
            except asyncio.TimeoutError:
                # An SSE comment (clients ignore it); under ASGI servers that do not report
                # disconnects, this write is what notices a vanished client.
                yield ": keep-alive\n\n"
                continue
            r = replies[i]
            if kind == "chunk":
                text, deltas, lp = r.add(payload)
                if text or deltas or (lp and (lp.get("content") or lp.get("tokens"))):
                    yield _event({**base, "choices": [r.delta(text, deltas, lp)]})
            elif kind == "done":
                text, deltas = r.end()
                if text or deltas:
                    yield _event({**base, "choices": [r.delta(text, deltas)]})
                last = {**base, "choices": [r.delta("", finish=r.finish_reason)]}
                open_ -= 1
                if not open_:
                    last["edgespec"] = _edgespec(jobs)
                yield _event(last)
            else:  # failed mid-stream: the status is sent already, so report in-band
                yield _event(_error_event(payload))
                yield "data: [DONE]\n\n"
                return
        if include_usage:
            yield _event({**base, "choices": [], "usage": _usage(jobs)})
        yield "data: [DONE]\n\n"
    finally:
        pump.cancel()
        for job in jobs:
            job.cancel()  # no-op once done; otherwise stops a waiting or running job


def _error_event(payload) -> dict:
    """The in-band error of a stream that failed after its 200: a grammar the matcher gave
    up on (the request's own grammar: 400, short, no matcher state) or a server failure."""
    from edgespec.logits.structured import GrammarError  # deferred: CLI start-up

    if isinstance(payload, (GrammarError, ValueError, EdgespecError)):
        return error_body(400, _grammar_message(payload), "response_format" if isinstance(payload, GrammarError)
                          else None, "grammar_error" if isinstance(payload, GrammarError) else "invalid_request")
    return error_body(500, f"generation failed: {payload}", None, "generation_failed")


def _grammar_message(e) -> str:
    from edgespec.logits.structured import GrammarError  # deferred: CLI start-up
    from edgespec.logits.structured._worker import short  # deferred: CLI start-up

    if isinstance(e, GrammarError):
        return f"response_format: the grammar could not be followed further: {short(e)}"
    return str(e)


def _raise_if_error(event, engine=None) -> None:
    from edgespec.logits.structured import GrammarError  # deferred: CLI start-up

    kind, payload = event
    if kind != "error":
        return
    if isinstance(payload, GrammarError):
        raise APIError(400, _grammar_message(payload), "response_format", "grammar_error")
    if isinstance(payload, DrafterRequiredError):
        # The engine's message speaks of load(drafter=...); a server is started with one.
        have = "no drafter" if getattr(engine, "drafter", None) is None else "a drafter this mode cannot use"
        raise APIError(400, f"{payload}. This server has {have}: start it with --drafter (self, prompt_lookup "
                       "or a drafter's path), or ask for one of the modes GET /health lists", "mode",
                       "invalid_request")
    if isinstance(payload, (ValueError, EdgespecError)):  # e.g. the mode's own options
        raise APIError(400, str(payload), None, "invalid_request")
    raise APIError(500, f"generation failed: {type(payload).__name__}: {payload}", None, "generation_failed")


async def _watch_disconnect(request: Request, jobs: list[Job]) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            for job in jobs:
                job.cancel()
            return


async def _collect(jobs: list[Job], firsts: list, base: dict, shape: _Shape) -> dict:
    replies = []
    for i, job in enumerate(jobs):
        r, event = _Reply(i, job, shape), firsts[i]
        while True:
            _raise_if_error(event)
            kind, payload = event
            if kind == "done":
                r.end()
                break
            r.add(payload)
            event = await job.out.get()
        replies.append(r)
    obj = "chat.completion" if shape.chat else "text_completion"
    return {**base, "object": obj, "choices": [r.final() for r in replies],
            "usage": _usage(jobs), "edgespec": _edgespec(jobs)}


def _clear_mlx_cache() -> None:
    """Give memory back when the queue drains: MLX's buffer cache, then (glibc) the malloc
    arenas the request threads grew, so RSS returns to its baseline between bursts."""
    import mlx.core as mx  # deferred: CLI start-up

    clear = getattr(mx, "clear_cache", None) or getattr(getattr(mx, "metal", None), "clear_cache", None)
    if clear is not None:
        clear()
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):  # not glibc
            pass
