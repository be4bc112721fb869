"""Request bodies of the OpenAI-compatible endpoints (pydantic, strict).

`extra="forbid"`: an unknown field is an error naming it, never silently
ignored. `strict=True`: "5" is not an integer and true is not a number.
Fields beyond OpenAI's (`top_k`, `min_p`, `mode`, `draft_tokens`, `mode_options`) are
edgespec extensions; with the openai client pass them in `extra_body`.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_STOP = 4  # as OpenAI
MAX_STOP_CHARS = 256


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

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
    seed: Annotated[int, Field(ge=0, lt=2**64)] | None = None  # what the sampler's RNG takes
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
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None

    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_Sampling):
    # One prompt: text or token ids. (OpenAI also takes a list of prompts; n=1 here.)
    prompt: str | list[Annotated[int, Field(ge=0)]]
    echo: Literal[False] = False

    def token_limit(self) -> int | None:
        return self.max_tokens
