"""Structured output and tool calls through the client libraries apps use, against a real
`edgespec serve` on the default model: the openai SDK (parse with a Pydantic model,
json_object, tools with tool_choice "required", a tool-result round trip, streamed tool
calls, logprobs, n > 1, penalties), langchain-openai (with_structured_output, bind_tools)
and instructor (JSON-schema mode). Greedy replies equal the Python API's."""

from __future__ import annotations

import json
import math
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field
from server_support import ServerProcess

pytestmark = pytest.mark.real_model


class City(BaseModel):
    name: str = Field(max_length=40)
    country: str = Field(max_length=40)
    population: int


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 40}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Get the local time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 40}}, "required": ["zone"]}}}
TOOLS = [WEATHER, TIME]
ASK_WEATHER = [{"role": "user", "content": "What is the weather like in Paris today?"}]
# Extraction, what structured output is for (asked for a population from memory, the default
# model writes digits until max_tokens).
CITY_TEXT = "Paris is a city in France with 2100000 inhabitants. Give its name, country and population as JSON."
ASK_CITY = [{"role": "user", "content": CITY_TEXT}]
# City's schema as the openai SDK sends it (strict: no properties beyond those declared).
CITY_FORMAT = {"type": "json_schema", "json_schema": {
    "name": "City", "schema": {**City.model_json_schema(), "additionalProperties": False}, "strict": True}}
N = 80


@pytest.fixture(scope="module")
def real_server(real_bundle):
    s = ServerProcess(real_bundle, "--drafter", "none", timeout=300)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(real_server):
    return openai.OpenAI(base_url=real_server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def _schema(tool):
    return tool["function"]["parameters"]


def test_openai_parse_with_a_pydantic_model(client, real_engine):
    r = client.chat.completions.parse(model="default", messages=ASK_CITY, response_format=City, max_tokens=N,
                                      temperature=0)
    msg = r.choices[0].message
    assert isinstance(msg.parsed, City)
    jsonschema.validate(json.loads(msg.content), City.model_json_schema())
    # The Python API with the same schema gives the same reply.
    ref = real_engine.chat(ASK_CITY, response_format=CITY_FORMAT, max_tokens=N)
    assert msg.content == ref.text
    assert r.usage.completion_tokens == len(ref.tokens)


def test_openai_json_object_on_both_endpoints(client, real_engine):
    r = client.chat.completions.create(model="default", messages=ASK_CITY, max_tokens=N, temperature=0,
                                       response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    prompt = "A JSON object with the keys city and country for Paris:"
    c = client.completions.create(model="default", prompt=prompt, max_tokens=N, temperature=0,
                                  extra_body={"response_format": {"type": "json_object"}})
    assert isinstance(json.loads(c.choices[0].text), dict)
    assert c.choices[0].text == real_engine.generate(prompt, max_tokens=N, response_format={"type": "json_object"}).text


def test_regex_response_format_extension(client):
    r = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "Give me a phone number."}], max_tokens=20,
        temperature=0, extra_body={"response_format": {"type": "regex", "pattern": r"\+33 [0-9]{3} [0-9]{3} [0-9]{3}"}})
    import re

    assert re.fullmatch(r"\+33 [0-9]{3} [0-9]{3} [0-9]{3}", r.choices[0].message.content)


def test_openai_tools_required_then_a_tool_result_round_trip(client, real_engine):
    # One call: with parallel calls allowed, the 135M default model repeats its call until max_tokens.
    r = client.chat.completions.create(model="default", messages=ASK_WEATHER, tools=TOOLS, tool_choice="required",
                                       parallel_tool_calls=False, max_tokens=N, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls
    assert len(calls) == 1 and all(c.type == "function" and c.id for c in calls)
    by_name = {t["function"]["name"]: t for t in TOOLS}
    for c in calls:
        jsonschema.validate(json.loads(c.function.arguments), _schema(by_name[c.function.name]))
    ref = real_engine.chat(ASK_WEATHER, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=N)
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == \
        [(c.name, c.arguments) for c in ref.tool_calls]

    # The call and its result go back in; the model answers in words.
    history = [*ASK_WEATHER, choice.message.model_dump(exclude_none=True)]
    history += [{"role": "tool", "tool_call_id": c.id, "content": json.dumps({"temperature": 21, "sky": "clear"})}
                for c in calls]
    r2 = client.chat.completions.create(model="default", messages=history, tools=TOOLS, max_tokens=24, temperature=0)
    ref2 = real_engine.chat(history, tools=TOOLS, max_tokens=24)
    assert r2.usage.prompt_tokens == ref2.prompt_tokens > r.usage.prompt_tokens
    assert r2.choices[0].message.content == ref2.text
    assert r2.choices[0].finish_reason in ("stop", "length")


class GetWeather(BaseModel):
    """Get the current weather in a city"""

    city: str = Field(max_length=40)
    unit: Literal["celsius", "fahrenheit"]


def test_openai_parse_with_a_pydantic_function_tool(client):
    # The SDK sends a strict function tool and parses the call's arguments into the model.
    r = client.chat.completions.parse(model="default", messages=ASK_WEATHER, max_tokens=N, temperature=0,
                                      tools=[openai.pydantic_function_tool(GetWeather)], tool_choice="required",
                                      parallel_tool_calls=False)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "GetWeather"
    assert isinstance(call.function.parsed_arguments, GetWeather)
    assert r.choices[0].finish_reason == "tool_calls"


def test_openai_named_tool_choice_streamed(client, real_engine):
    named = {"type": "function", "function": {"name": "get_weather"}}
    stream = client.chat.completions.create(model="default", messages=ASK_WEATHER, tools=TOOLS, tool_choice=named,
                                            max_tokens=N, temperature=0, stream=True)
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        for ch in chunk.choices:
            for d in ch.delta.tool_calls or []:
                slot = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                slot["id"] = d.id or slot["id"]
                if d.function and d.function.name:
                    slot["name"] += d.function.name
                if d.function and d.function.arguments:
                    slot["arguments"] += d.function.arguments
            finish = ch.finish_reason or finish
    assert finish == "tool_calls"
    assert list(calls) == [0] and calls[0]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    args = json.loads(calls[0]["arguments"])
    jsonschema.validate(args, _schema(WEATHER))
    ref = real_engine.chat(ASK_WEATHER, tools=TOOLS, tool_choice=named, max_tokens=N)
    assert args == ref.tool_calls[0].arguments


def test_openai_logprobs_chat_and_completions(client, real_engine):
    r = client.chat.completions.create(model="default", messages=ASK_CITY, max_tokens=12, temperature=0,
                                       logprobs=True, top_logprobs=3)
    entries = r.choices[0].logprobs.content
    assert len(entries) == r.usage.completion_tokens
    assert b"".join(bytes(e.bytes) for e in entries).decode() == r.choices[0].message.content
    for e in entries:
        assert e.logprob <= 0 and len(e.top_logprobs) == 3
        tops = [t.logprob for t in e.top_logprobs]
        assert tops == sorted(tops, reverse=True)
        assert math.isclose(e.logprob, tops[0], abs_tol=1e-5)  # greedy: the chosen token is the most likely
    ref = real_engine.chat(ASK_CITY, max_tokens=12, logprobs=3)
    assert [e.logprob for e in entries] == pytest.approx([lp.logprob for lp in ref.logprobs], abs=1e-4)

    c = client.completions.create(model="default", prompt="The capital of France is", max_tokens=6, temperature=0,
                                  logprobs=2)
    lp = c.choices[0].logprobs
    assert "".join(lp.tokens) == c.choices[0].text
    assert len(lp.token_logprobs) == len(lp.top_logprobs) == 6 and all(len(t) == 2 for t in lp.top_logprobs)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]

    # Streamed: each chunk carries the logprobs of its own tokens.
    stream = client.chat.completions.create(model="default", messages=ASK_CITY, max_tokens=12, temperature=0,
                                            logprobs=True, top_logprobs=1, stream=True)
    streamed = [e.logprob for chunk in stream for ch in chunk.choices if ch.logprobs for e in ch.logprobs.content]
    assert streamed == pytest.approx([e.logprob for e in entries], abs=1e-4)


def test_n_choices_and_penalties(client, real_engine):
    r = client.chat.completions.create(model="default", messages=ASK_CITY, max_tokens=16, temperature=0, n=3)
    assert [c.index for c in r.choices] == [0, 1, 2]
    ref = real_engine.chat(ASK_CITY, max_tokens=16)
    assert all(c.message.content == ref.text for c in r.choices)  # greedy: every row the same
    assert r.usage.completion_tokens == 3 * len(ref.tokens) and r.usage.prompt_tokens == ref.prompt_tokens

    sampled = client.chat.completions.create(model="default", messages=ASK_CITY, max_tokens=16, temperature=1.0,
                                             seed=7, n=2)
    again = client.chat.completions.create(model="default", messages=ASK_CITY, max_tokens=16, temperature=1.0,
                                           seed=7, n=2)
    assert [c.message.content for c in sampled.choices] == [c.message.content for c in again.choices]
    assert sampled.choices[1].message.content == real_engine.chat(ASK_CITY, max_tokens=16, temperature=1.0,
                                                                  seed=8).text  # choice i: seed + i

    # Each row has its own matcher: sampled rows under one schema (every value bounded, so
    # every row ends) all validate.
    bounded = {"type": "object", "properties": {
        "city": {"enum": ["Paris", "Lyon", "Nice"]}, "country": {"enum": ["France", "Italy"]},
        "large": {"type": "boolean"}}, "required": ["city", "country", "large"], "additionalProperties": False}
    rows = client.chat.completions.create(model="default", messages=ASK_CITY, max_tokens=N, temperature=1.0, seed=3,
                                          n=3, response_format={"type": "json_schema", "json_schema": {
                                              "name": "Place", "schema": bounded}})
    for c in rows.choices:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.message.content), bounded)

    kw = {"presence_penalty": 1.5, "frequency_penalty": 0.5}
    p = client.chat.completions.create(model="default", messages=ASK_CITY, max_tokens=24, temperature=0,
                                       extra_body={"repetition_penalty": 1.3}, **kw)
    assert p.choices[0].message.content == real_engine.chat(ASK_CITY, max_tokens=24, repetition_penalty=1.3,
                                                            **kw).text


def test_streamed_n_over_plain_http(real_server):
    body = {"model": "default", "messages": ASK_CITY, "max_tokens": 8, "n": 2, "stream": True,
            "stream_options": {"include_usage": True}}
    texts, finishes, usage = {0: "", 1: ""}, {}, None
    with httpx.stream("POST", real_server.url + "/v1/chat/completions", json=body, timeout=300) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                obj = json.loads(line[6:])
                usage = obj.get("usage") or usage
                for ch in obj["choices"]:
                    texts[ch["index"]] += ch["delta"].get("content") or ""
                    if ch["finish_reason"]:
                        finishes[ch["index"]] = ch["finish_reason"]
    assert texts[0] == texts[1] and texts[0]
    assert finishes == {0: "length", 1: "length"} and usage["completion_tokens"] == 16


def test_langchain_structured_output_and_bind_tools(real_server, real_engine):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=real_server.url + "/v1", api_key="unused", model="default", temperature=0,
                     max_tokens=N, max_retries=0, timeout=300)
    city = llm.with_structured_output(City).invoke(CITY_TEXT)
    assert isinstance(city, City)
    assert city == City.model_validate_json(real_engine.chat(ASK_CITY, response_format=CITY_FORMAT,
                                                             max_tokens=N).text)

    msg = llm.bind_tools(TOOLS, tool_choice="required", parallel_tool_calls=False).invoke(ASK_WEATHER[0]["content"])
    assert len(msg.tool_calls) == 1, msg
    by_name = {t["function"]["name"]: t for t in TOOLS}
    for call in msg.tool_calls:
        jsonschema.validate(call["args"], _schema(by_name[call["name"]]))


def test_instructor_json_schema_mode(real_server):
    import instructor

    raw = openai.OpenAI(base_url=real_server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    client = instructor.from_openai(raw, mode=instructor.Mode.JSON_SCHEMA)
    city = client.chat.completions.create(model="default", response_model=City, messages=ASK_CITY, max_tokens=N,
                                          temperature=0, max_retries=0)
    assert isinstance(city, City) and city.name


def test_unsupported_and_bad_structured_requests_are_400s(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="default", messages=ASK_CITY, max_tokens=4, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}})
    assert e.value.body["param"] == "response_format"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="default", messages=ASK_CITY, max_tokens=4, tools=TOOLS,
                                       tool_choice={"type": "function", "function": {"name": "get_news"}})
    assert e.value.body["param"] == "tool_choice"
