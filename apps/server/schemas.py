"""Request bodies of the OpenAI-compatible endpoints (pydantic, strict).

`extra="forbid"`: an unknown field is an error naming it, never silently
ignored. `strict=True`: "5" is not an integer and true is not a number.
Fields beyond OpenAI's (`top_k`, `min_p`, `mode`, `draft_tokens`, `mode_options`) are
edgespec extensions; with the openai client pass them in `extra_body`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError

MAX_STOP = 4  # as OpenAI
MAX_STOP_CHARS = 256
# Seeds the engine takes: edgespec.sampling.SamplingParams checks 0 <= seed < 2**63.
SEED_LIMIT = 2**63
# As OpenAI's limit on `messages`; content parts are counted over all messages. Both are
# checked before the items are (validating a 4 MiB body of tiny messages item by item
# took 0.7 s on the event loop).
MAX_MESSAGES = 2048
MAX_CONTENT_PARTS = 2048
TEXT_PART = '{"type": "text", "text": "..."}'


def _json_type(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, (int, float)):
        return f"a number ({v!r})"
    if isinstance(v, dict):
        return "an object"
    if isinstance(v, list):
        return "an array"
    return "a string" if isinstance(v, str) else type(v).__name__


def _invalid(message: str) -> PydanticCustomError:
    return PydanticCustomError("invalid_value", message)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _check_content(cls, v):
        # One clear message instead of the union's "Input should be a valid string" for
        # null, numbers, objects and parts that are not text.
        if isinstance(v, str):
            return v
        if not isinstance(v, list):
            raise _invalid(f"must be a string or a list of text parts ({TEXT_PART}), got {_json_type(v)}")
        if not v:
            raise _invalid(f"is an empty list: give a string or at least one text part ({TEXT_PART})")
        for i, part in enumerate(v):
            if not isinstance(part, dict):
                raise _invalid(f"part {i} must be an object {TEXT_PART}, got {_json_type(part)}")
            kind = part.get("type")
            if kind != "text":
                raise _invalid(f"part {i} has type {kind!r}: only text parts ({TEXT_PART}) are supported")
            if not isinstance(part.get("text"), str):
                raise _invalid(f"part {i} needs a string 'text', got {_json_type(part.get('text'))}")
        return v

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    """Fields shared by both endpoints. None = the server's default (see `edgespec serve -h`)."""

    model: str = Field(min_length=1)
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2, allow_inf_nan=False)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    min_p: Annotated[float, Field(ge=0, lt=1, allow_inf_nan=False)] | None = None
    seed: Annotated[int, Field(ge=0, lt=SEED_LIMIT, description="0 <= seed < 2**63, as the engine takes")] | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Literal[1] = 1
    user: str | None = None
    # Accepted so common clients work; only the neutral value is supported.
    presence_penalty: Literal[0, 0.0] | None = None
    frequency_penalty: Literal[0, 0.0] | None = None
    # edgespec extensions
    mode: str | None = None
    draft_tokens: Annotated[int, Field(ge=1, le=16)] | Literal["auto"] | None = None
    # Mode-specific settings, e.g. {"window": 5} for lookahead (checked by the mode).
    mode_options: dict[str, int | float | str | bool] | None = None

    @field_validator("mode_options")
    @classmethod
    def _check_mode_options(cls, v):
        taken = set(cls.model_fields) | {"sampling", "options"}
        clash = sorted(k for k in (v or {}) if k in taken)
        if clash:
            raise ValueError(f"mode_options may not set request fields: {', '.join(clash)}")
        return v

    @field_validator("seed", mode="before")
    @classmethod
    def _check_seed(cls, v):
        if isinstance(v, int) and not isinstance(v, bool) and not 0 <= v < SEED_LIMIT:
            raise _invalid(f"must be an integer in [0, 2**63), got {v}")
        return v

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences are allowed, got {len(stops)}")
        for s in stops:
            if not s or len(s) > MAX_STOP_CHARS:
                raise ValueError(f"each stop sequence must have 1..{MAX_STOP_CHARS} characters")
        return v

    def stop_list(self) -> list[str] | None:
        if self.stop is None:
            return None
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class ChatCompletionRequest(_Sampling):
    messages: list[Message] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    # edgespec extension: "truncate_oldest" drops the oldest turns of a conversation longer
    # than the context window (system messages and the last turn stay) instead of a 400.
    context_overflow: Literal["error", "truncate_oldest"] = "error"

    @field_validator("messages", mode="before")
    @classmethod
    def _count_messages(cls, v):
        if isinstance(v, list):
            if len(v) > MAX_MESSAGES:
                raise _invalid(f"at most {MAX_MESSAGES} messages are allowed, got {len(v)}")
            parts = sum(len(m["content"]) for m in v if isinstance(m, dict) and isinstance(m.get("content"), list))
            if parts > MAX_CONTENT_PARTS:
                raise _invalid(f"at most {MAX_CONTENT_PARTS} content parts are allowed over all messages, got {parts}")
        return v

    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_Sampling):
    # One prompt: text or token ids. (OpenAI also takes a list of prompts; n=1 here.)
    prompt: str | list[Annotated[int, Field(ge=0)]]
    echo: Literal[False] = False

    def token_limit(self) -> int | None:
        return self.max_tokens
