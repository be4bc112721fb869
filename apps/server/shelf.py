"""Models stored by hub name, served beside the one `edgespec serve` started with.

An ASGI layer in front of the served model's app (create_app): `GET /v1/models` also lists the
models stored by name (`edgespec pull`), and a completion whose `model` names one of them is
answered by that model, loaded on first use (one at a time beside the served one; loading another
closes the previous). A name not stored gets a 404 saying how to fetch it, unless the server was
started with --allow-pull (then it is fetched before it is loaded). Everything else, and every
request without the API key, goes to the served model's app unchanged, which answers it as before.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import unquote

from edgespec.apps.server.errors import error_body

COMPLETIONS = ("/v1/chat/completions", "/v1/completions")


def stored_names() -> list[str]:
    """The names `edgespec list` shows whose files are all on disk."""
    from edgespec.hub.manage import stored_models  # deferred: CLI start-up

    return [s.name for s in stored_models() if s.complete]


class ModelShelf:
    """`primary`: the served model's ASGI app; `served`: the ids it answers to; `make_app(name)`:
    loads the stored model `name` and returns its app (called in a worker thread)."""

    def __init__(self, primary, served: tuple[str, ...], make_app: Callable[[str], Any], api_key: str | None,
                 max_body_bytes: int, allow_pull: bool = False):
        self.primary, self.served, self.make_app = primary, tuple(served), make_app
        self.api_key, self.max_body_bytes, self.allow_pull = api_key, max_body_bytes, allow_pull
        self.extra: tuple[str, Any] | None = None  # (name, app) of the stored model loaded now
        self._lock = asyncio.Lock()
        self.created = int(time.time())

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            return await self.primary(scope, self._closing(receive), send)
        if scope["type"] != "http" or not self._authorized(scope):
            return await self.primary(scope, receive, send)  # it answers 401 without the key
        path, method = scope["path"], scope["method"]
        if method == "GET" and path == "/v1/models":
            return await self._list(scope, receive, send)
        if method == "GET" and path.startswith("/v1/models/"):
            name = unquote(path[len("/v1/models/"):])
            if name not in self.served and name in stored_names():
                return await _json(send, 200, self._card(name))
        if method == "POST" and path in COMPLETIONS:
            return await self._completion(scope, receive, send)
        return await self.primary(scope, receive, send)

    def _authorized(self, scope) -> bool:
        if self.api_key is None:
            return True
        header = dict(scope.get("headers") or []).get(b"authorization", b"").decode("latin-1")
        scheme, _, token = header.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.api_key.encode())

    def _card(self, name: str) -> dict:
        return {"id": name, "object": "model", "created": self.created, "owned_by": "edgespec", "stored": True}

    async def _list(self, scope, receive, send):
        status, headers, body = await _capture(self.primary, scope, receive)
        if status == 200:
            data = json.loads(body)
            have = {m["id"] for m in data.get("data", [])}
            data["data"] += [self._card(n) for n in stored_names() if n not in have]
            return await _json(send, 200, data)
        await _replay_response(send, status, headers, body)

    async def _completion(self, scope, receive, send):
        body, more = b"", True
        while more and len(body) <= self.max_body_bytes:
            msg = await receive()
            if msg["type"] != "http.request":
                return
            body += msg.get("body", b"")
            more = msg.get("more_body", False)
        replay = _replayed(body, more, receive)
        model = None
        if not more:
            try:
                parsed = json.loads(body)
                model = parsed.get("model") if isinstance(parsed, dict) else None
            except (ValueError, RecursionError):
                pass  # the served model's app answers malformed or too deeply nested JSON
        if not isinstance(model, str) or model in self.served:
            return await self.primary(scope, replay, send)
        from edgespec.hub import names  # deferred: CLI start-up

        try:
            names.check_spec(model)  # a name no file system could hold: refused before it reaches one
        except names.BadNameError as e:
            return await _json(send, 400, error_body(400, str(e), "model", "invalid_model"))
        if model not in stored_names():
            if names.as_hub_name(model) is None:
                return await self.primary(scope, replay, send)  # not a hub name: refused as before
            if not self.allow_pull:
                hint = f"`edgespec pull {model}` fetches it (or start the server with --allow-pull)"
                return await _json(send, 404, error_body(404, f"model {model!r} is not stored here; {hint}", "model",
                                                         "model_not_found"))
        try:
            app = await self._app_for(model)
        except Exception as e:  # noqa: BLE001 - a model that cannot be loaded is this request's error
            return await _json(send, 404, error_body(404, f"model {model!r} could not be loaded: {e}", "model",
                                                     "model_not_found"))
        return await app(scope, replay, send)

    async def _app_for(self, name: str):
        async with self._lock:
            if self.extra is not None and self.extra[0] == name:
                return self.extra[1]
            old, self.extra = self.extra, None
            if old is not None:
                old[1].state.scheduler.close()  # its memory goes before the next model loads
            app = await asyncio.to_thread(self.make_app, name)
            self.extra = (name, app)
            return app

    def _closing(self, receive):
        async def wrapped():
            msg = await receive()
            if msg["type"] == "lifespan.shutdown" and self.extra is not None:
                self.extra[1].state.scheduler.close()
            return msg

        return wrapped


def _replayed(body: bytes, more: bool, receive):
    """A receive() that gives `body` first (with the rest of a long body still to come) and then
    what the client sends next (the disconnect the apps watch for)."""
    first = [True]

    async def replay():
        if first[0]:
            first[0] = False
            return {"type": "http.request", "body": body, "more_body": more}
        return await receive()

    return replay


async def _json(send, status: int, obj) -> None:
    body = json.dumps(obj).encode()
    await _replay_response(send, status, [(b"content-type", b"application/json")], body)


async def _replay_response(send, status: int, headers, body: bytes) -> None:
    headers = [(k, v) for k, v in headers if k.lower() != b"content-length"]
    headers.append((b"content-length", str(len(body)).encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _capture(app, scope, receive) -> tuple[int, list, bytes]:
    """Run `app` for one request and keep its response (a small JSON one) instead of sending it."""
    out: dict[str, Any] = {"status": 500, "headers": [], "body": b""}

    async def send(msg):
        if msg["type"] == "http.response.start":
            out["status"], out["headers"] = msg["status"], list(msg.get("headers") or [])
        elif msg["type"] == "http.response.body":
            out["body"] += msg.get("body", b"")

    await app(scope, receive, send)
    return out["status"], out["headers"], out["body"]
