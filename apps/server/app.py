"""The FastAPI application: OpenAI-compatible routes over one Engine and a FIFO Scheduler.

    GET  /health                 liveness + queue figures (no token needed)
    GET  /v1/models              the served model: its bundle name and "default"
    POST /v1/chat/completions    messages -> reply (JSON, or SSE with "stream": true)
    POST /v1/completions         raw text continuation (JSON or SSE)

Each response carries an `edgespec` object with the decoding stats
(mode, acceptance_rate, tokens_per_pass, tokens_per_s, ...).
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
from edgespec.apps.server.schemas import ChatCompletionRequest, CompletionRequest
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from edgespec.engine import make_options
from edgespec.errors import ContextLengthError, DrafterRequiredError, EdgespecError
from edgespec.modes import available_modes

KEEPALIVE_S = 1.0  # seconds without an event before an SSE keep-alive comment (see _sse)
FINISH = {"stop": "stop", "length": "length", "context": "length", "cancelled": "stop"}


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
                "prompt_cache": engine.prefix_cache.stats().as_dict()}

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
        job = await _submit(body, messages=body.messages)
        return await _respond(request, body, job, chat=True)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        job = await _submit(body, prompt=body.prompt)
        return await _respond(request, body, job, chat=False)

    async def _submit(body, prompt=None, messages=None) -> Job:
        _check_model(body.model, model_ids)
        options = _options(body, settings.defaults, settings.max_tokens_limit)
        param = "messages" if messages is not None else "prompt"
        try:
            if isinstance(prompt, str):
                # A text too long for the context by its size alone is refused at once,
                # without tokenizing it (O(1) far from the bound: fine on the event loop).
                engine.tokenizer.check_length(prompt, engine.context_length)
            # Everything proportional to the input runs off the event loop: the messages'
            # text, the chat template, tokenizing (which releases the GIL on long texts).
            ids = await run_in_threadpool(_encode_prompt, engine, prompt, messages, options,
                                          getattr(body, "context_overflow", "error"))
        except ContextLengthError as e:
            raise APIError(400, str(e), param, "context_length_exceeded") from None
        except ValueError as e:
            raise APIError(400, str(e), param, "invalid_prompt") from None
        job = Job(ids, options, asyncio.get_running_loop())
        try:
            scheduler.submit(job)
        except QueueFull as e:
            raise APIError(503, str(e), None, "queue_full", headers={"Retry-After": "1"}) from None
        return job

    async def _respond(request: Request, body, job: Job, chat: bool):
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        base = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()), "model": settings.model_id}
        # Wait for the job's first event before choosing the status, so a request the
        # engine rejects (e.g. a mode that needs a drafter) still gets a 4xx; meanwhile a
        # client that gives up while queued cancels its job.
        watcher = asyncio.create_task(_watch_disconnect(request, job))
        try:
            first = await job.out.get()
            _raise_if_error(first, engine)
            if not body.stream:
                return await _collect(job, first, base, chat)
        finally:
            watcher.cancel()
            if not body.stream:
                job.cancel()  # no-op when done
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(
            _sse(job, first, base, chat, include_usage),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    return app


# ---------------------------------------------------------------------- helpers
def _encode_prompt(engine, prompt, messages, options, overflow: str = "error") -> list[int]:
    """The prompt's token ids (runs in a worker thread)."""
    if messages is not None:
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in messages]
    return engine.prompt_ids(prompt, messages, options, overflow)


def _check_model(model: str, model_ids) -> None:
    if model not in model_ids:
        raise APIError(404, f"model {model!r} is not served here; use one of: {', '.join(model_ids)}",
                       "model", "model_not_found")


def _options(body, defaults: dict[str, Any], max_tokens_limit: int | None = None):
    """Request fields over server defaults -> GenerateOptions (ValueError -> 400 naming the field)."""
    asked = body.token_limit()
    if max_tokens_limit is not None and asked is not None and asked > max_tokens_limit:
        raise APIError(400, f"max_tokens {asked} is over this server's limit of {max_tokens_limit} "
                       "(edgespec serve --max-tokens-limit)", "max_tokens", "invalid_value")
    req = {
        "max_tokens": body.token_limit(), "stop": body.stop_list(), "temperature": body.temperature,
        "top_k": body.top_k, "top_p": body.top_p, "min_p": body.min_p, "seed": body.seed,
        "mode": body.mode, "draft_tokens": body.draft_tokens,
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


def _stats(job: Job) -> dict[str, Any]:
    s = job.stats
    return {
        "mode": s.mode, "acceptance_rate": s.acceptance_rate, "tokens_per_pass": s.tokens_per_pass,
        "tokens_per_s": s.tokens_per_s, "verifier_passes": s.verifier_passes, "drafted": s.drafted,
        "accepted": s.accepted, "draft_tokens": s.draft_tokens, "prefill_s": s.prefill_s,
        "decode_s": s.decode_s, "queue_s": job.queue_s, "notes": list(s.notes),
    }


def _usage(job: Job) -> dict[str, int]:
    n = job.stats.generated_tokens
    return {"prompt_tokens": len(job.ids), "completion_tokens": n, "total_tokens": len(job.ids) + n,
            "prompt_tokens_details": {"cached_tokens": job.stats.cached_tokens}}


def _choice(chat: bool, text: str | None, finish: str | None, first: bool = False, final: bool = False) -> dict:
    if not chat:
        return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
    if final:
        return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                "finish_reason": finish}
    delta = {"role": "assistant", "content": text or ""} if first else ({"content": text} if text else {})
    return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}


def _event(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _next(job: Job, first: list) -> tuple[str, object]:
    return first.pop() if first else await job.out.get()


async def _sse(job: Job, first_event, base: dict, chat: bool, include_usage: bool) -> AsyncIterator[str]:
    """Server-sent events. Leaving this generator early (the client went away: Starlette
    cancels it) cancels the job, which frees the engine at its next token."""
    finish, first = "length", [first_event]
    try:
        if chat:
            yield _event({**base, "choices": [_choice(True, "", None, first=True)]})
        while True:
            try:
                kind, payload = await asyncio.wait_for(_next(job, first), KEEPALIVE_S)
            except asyncio.TimeoutError:
                # An SSE comment (clients ignore it); under ASGI servers that do not report
                # disconnects, this write is what notices a vanished client.
                yield ": keep-alive\n\n"
                continue
            if kind == "chunk":
                if payload.text:
                    yield _event({**base, "choices": [_choice(chat, payload.text, None)]})
                if payload.finish_reason:
                    finish = FINISH.get(payload.finish_reason, "stop")
            elif kind == "done":
                yield _event({**base, "choices": [_choice(chat, "", finish)], "edgespec": _stats(job)})
                if include_usage:
                    yield _event({**base, "choices": [], "usage": _usage(job)})
                yield "data: [DONE]\n\n"
                return
            else:  # failed mid-stream: the status is sent already, so report in-band
                yield _event(error_body(500, f"generation failed: {payload}", None, "generation_failed"))
                yield "data: [DONE]\n\n"
                return
    finally:
        job.cancel()  # no-op once done; otherwise stops a waiting or running job


def _raise_if_error(event, engine=None) -> None:
    kind, payload = event
    if kind != "error":
        return
    if isinstance(payload, DrafterRequiredError):
        # The engine's message speaks of load(drafter=...); a server is started with one.
        have = "no drafter" if getattr(engine, "drafter", None) is None else "a drafter this mode cannot use"
        raise APIError(400, f"{payload}. This server has {have}: start it with --drafter (self, prompt_lookup "
                       "or a drafter's path), or ask for one of the modes GET /health lists", "mode",
                       "invalid_request")
    if isinstance(payload, (ValueError, EdgespecError)):  # e.g. the mode's own options
        raise APIError(400, str(payload), None, "invalid_request")
    raise APIError(500, f"generation failed: {type(payload).__name__}: {payload}", None, "generation_failed")


async def _watch_disconnect(request: Request, job: Job) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            job.cancel()
            return


async def _collect(job: Job, first_event, base: dict, chat: bool) -> dict:
    text, finish, first = [], "length", [first_event]
    while True:
        event = await _next(job, first)
        _raise_if_error(event)
        kind, payload = event
        if kind == "done":
            break
        text.append(payload.text)
        if payload.finish_reason:
            finish = FINISH.get(payload.finish_reason, "stop")
    obj = "chat.completion" if chat else "text_completion"
    return {**base, "object": obj, "choices": [_choice(chat, "".join(text), finish, final=True)],
            "usage": _usage(job), "edgespec": _stats(job)}


def _clear_mlx_cache() -> None:
    """Give memory back when the queue drains: MLX's buffer cache, then (glibc) the malloc
    arenas the request threads grew, so RSS returns to its baseline between bursts."""
    import mlx.core as mx

    clear = getattr(mx, "clear_cache", None) or getattr(getattr(mx, "metal", None), "clear_cache", None)
    if clear is not None:
        clear()
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):  # not glibc
            pass
