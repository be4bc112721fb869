"""OpenAI-style error bodies for every failure: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("edgespec.server")

_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
          405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
          503: "server_error", 500: "server_error"}


_FIELD = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_TYPE_NAMES = {"str", "int", "float", "bool", "list", "dict", "none"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}


def error_response(status: int, message: str, param=None, code=None, headers=None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


def _describe_validation(exc: RequestValidationError) -> tuple[str, str | None, str]:
    """First pydantic error -> (message, param, code)."""
    errors = exc.errors()
    if not errors:
        return "invalid request body", None, "invalid_request"
    e = errors[0]
    # Union members add their type to loc ("str", "constrained-int", "list[TextPart]"): keep
    # field names and list indices only.
    loc = [str(x) for x in e.get("loc", ())
           if x != "body" and (isinstance(x, int) or (_FIELD.match(str(x)) and str(x) not in _TYPE_NAMES))]
    param = ".".join(loc) or None
    kind = e.get("type", "")
    if kind == "json_invalid":
        return f"malformed JSON body: {e.get('ctx', {}).get('error', e.get('msg'))}", None, "invalid_json"
    if kind == "extra_forbidden":
        return f"unknown field {param!r}", param, "unknown_field"
    if kind == "missing":
        if not loc:
            return "the request body must be a JSON object", None, "invalid_request"
        return f"missing required field {param!r}", param, "missing_field"
    if not loc and kind.endswith("_type"):
        return "the request body must be a JSON object", None, "invalid_request"
    msg = e.get("msg", "invalid value")
    more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
    return f"{param}: {msg}{more}" if param else msg + more, param, "invalid_value"


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error_response(exc.status, exc.message, exc.param, exc.code, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        message, param, code = _describe_validation(exc)
        return error_response(400, message, param, code)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        messages = {404: f"no such endpoint: {request.method} {request.url.path}",
                    405: f"method {request.method} is not allowed on {request.url.path}"}
        message = messages.get(exc.status_code, str(exc.detail))
        code = None
        if exc.status_code == 400:
            # FastAPI's own body parsing failed (e.g. JSON nested past Python's recursion limit):
            # the documented code for a body that is not usable JSON.
            message, code = f"malformed JSON body: {exc.detail} (not parseable, or nested too deeply)", "invalid_json"
        return error_response(exc.status_code, message, None, code, getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("unexpected error on %s %s", request.method, request.url.path)
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}", None, "internal_error")
