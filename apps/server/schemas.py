"""Request bodies of the OpenAI-compatible endpoints (pydantic, strict).

`extra="forbid"`: an unknown field is an error naming it, never silently
ignored. `strict=True`: "5" is not an integer and true is not a number.
Fields beyond OpenAI's (`top_k`, `min_p`, `repetition_penalty`, `mode`, `draft_tokens`,
`mode_options`, and the `regex` and `grammar` response formats) are edgespec extensions;
with the openai client pass them in `extra_body`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

MAX_STOP = 4  # as OpenAI
MAX_STOP_CHARS = 256
# Seeds the engine takes: edgespec.logits.sampling.SamplingParams checks 0 <= seed < 2**63.
SEED_LIMIT = 2**63
# As OpenAI's limit on `messages`; content parts are counted over all messages. Both are
# checked before the items are (validating a 4 MiB body of tiny messages item by item
# took 0.7 s on the event loop).
MAX_MESSAGES = 2048
MAX_CONTENT_PARTS = 2048
MAX_N = 8  # choices per request (each a row of the batch)
MAX_TOP_LOGPROBS = 20  # as OpenAI
MAX_TOOLS = 128  # as OpenAI
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


class FunctionCall(_Strict):
    name: str = Field(min_length=1)
    arguments: str  # a JSON object, as text (OpenAI's shape)


class ToolCallIn(_Strict):
    """A call an earlier assistant message made (sent back with the conversation)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Strict):
    # Fields are checked in this order: content's check reads role and tool_calls.
    role: Literal["system", "developer", "user", "assistant", "tool"]
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None  # role "tool": the call this message answers
    # None only on an assistant message that carries tool_calls (OpenAI sends null there).
    content: str | list[TextPart] | None = Field(default=None, validate_default=True)

    @model_validator(mode="after")
    def _check_roles(self):
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError(f"only assistant messages carry tool_calls, not {self.role!r}")
        if self.tool_call_id is not None and self.role != "tool":
            raise ValueError("tool_call_id belongs on a 'tool' message")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a 'tool' message needs the tool_call_id of the call it answers")
        return self

    @field_validator("content", mode="before")
    @classmethod
    def _check_content(cls, v, info: ValidationInfo):
        # One clear message instead of the union's "Input should be a valid string" for
        # null, numbers, objects and parts that are not text.
        if isinstance(v, str):
            return v
        if v is None:
            if info.data.get("role") == "assistant" and info.data.get("tool_calls"):
                return v
            raise _invalid(f"must be a string or a list of text parts ({TEXT_PART}), got null "
                           "(null only on an assistant message with tool_calls)")
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
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(p.text for p in self.content)

    def as_dict(self) -> dict:
        """The message as the engine's chat template takes it (developer -> system)."""
        d: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.name is not None:
            d["name"] = self.name
        if self.tool_calls:
            d["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            d["tool_call_id"] = self.tool_call_id
        return d


class FunctionDef(_Strict):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(_Strict):
    name: str = Field(min_length=1)


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


class FormatText(_Strict):
    type: Literal["text"]


class FormatJSONObject(_Strict):
    type: Literal["json_object"]
    # Extension (as Together and Anyscale take it, and instructor sends it): a schema too.
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")


class JSONSchemaSpec(_Strict):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class FormatJSONSchema(_Strict):
    type: Literal["json_schema"]
    json_schema: JSONSchemaSpec


class FormatRegex(_Strict):  # edgespec extension
    type: Literal["regex"]
    pattern: str = Field(min_length=1)


class FormatGrammar(_Strict):  # edgespec extension
    type: Literal["grammar"]
    grammar: str = Field(min_length=1)
    syntax: Literal["lark", "gbnf"] = "lark"


def _format_type(v):
    return v.get("type") if isinstance(v, dict) else getattr(v, "type", None)


# Chosen by "type". The tags ("=json_schema", ...) are not field names, so an error's
# param names the fields only (response_format.json_schema.name), as apps.server.errors keeps them.
ResponseFormat = Annotated[
    Annotated[FormatText, Tag("=text")] | Annotated[FormatJSONObject, Tag("=json_object")]
    | Annotated[FormatJSONSchema, Tag("=json_schema")] | Annotated[FormatRegex, Tag("=regex")]
    | Annotated[FormatGrammar, Tag("=grammar")],
    Discriminator(lambda v: f"={_format_type(v)}", custom_error_type="invalid_value",
                  custom_error_message="type must be one of text, json_object, json_schema, regex, grammar")]


def engine_response_format(rf) -> dict | None:
    """A request's response_format as the engine's (edgespec.make_options(response_format=))."""
    if rf is None or isinstance(rf, FormatText):
        return None
    if isinstance(rf, FormatJSONObject):
        if rf.schema_ is not None:
            return {"type": "json_schema", "json_schema": {"name": "response", "schema": rf.schema_}}
        return {"type": "json_object"}
    if isinstance(rf, FormatJSONSchema):
        spec = rf.json_schema
        if spec.schema_ is None:
            return {"type": "json_object"}
        return {"type": "json_schema", "json_schema": {"name": spec.name, "schema": spec.schema_,
                                                       "strict": bool(spec.strict)}}
    if isinstance(rf, FormatRegex):
        return {"type": "regex", "pattern": rf.pattern}
    return {"type": "grammar", "grammar": rf.grammar, "syntax": rf.syntax}


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
    n: Annotated[int, Field(ge=1, le=MAX_N, description=f"1..{MAX_N} choices, decoded as rows of one batch")] = 1
    user: str | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2, allow_inf_nan=False)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2, allow_inf_nan=False)] | None = None
    response_format: ResponseFormat | None = None
    # edgespec extensions
    repetition_penalty: Annotated[float, Field(gt=0, le=10, allow_inf_nan=False)] | None = None
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
    tools: list[Tool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None

    @model_validator(mode="after")
    def _check_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    def logprobs_k(self) -> int | None:
        """Alternatives per token to report (None: no logprobs)."""
        return (self.top_logprobs or 0) if self.logprobs else None

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
    # The legacy endpoint's shape: an integer, alternatives per token (OpenAI allows 0..5).
    logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None

    def token_limit(self) -> int | None:
        return self.max_tokens

    def logprobs_k(self) -> int | None:
        return self.logprobs
