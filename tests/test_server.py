"""`edgespec serve` as a real process on a free loopback port, with a tiny random bundle:
OpenAI client and plain HTTP, streaming and not, stops, limits, bad input, bearer token."""

from __future__ import annotations

import json
import time

import httpx
import openai
import psutil
import pytest
from server_support import ServerProcess, write_tiny_bundle

import edgespec

KEY = "sk-test-edgespec"
AUTH = {"Authorization": f"Bearer {KEY}"}
MSGS = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    return write_tiny_bundle(tmp_path_factory.mktemp("srv") / "tiny-test")


@pytest.fixture(scope="module")
def server(bundle):
    s = ServerProcess(bundle, "--api-key", KEY)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def engine(bundle):
    return edgespec.load(bundle, drafter="none", progress=False)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def post(server, path, body, headers=AUTH, raw: str | None = None) -> httpx.Response:
    if raw is not None:
        return httpx.post(server.url + path, content=raw, timeout=60,
                          headers={**headers, "Content-Type": "application/json"})
    return httpx.post(server.url + path, json=body, headers=headers, timeout=60)


def sse_events(server, path, body) -> list:
    """Raw SSE stream -> list of decoded JSON events (comments skipped), '[DONE]' last."""
    events = []
    with httpx.stream("POST", server.url + path, json=body, headers=AUTH, timeout=60) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                data = line[len("data: "):]
                events.append(data if data == "[DONE]" else json.loads(data))
    return events


# ------------------------------------------------------------------ basics
def test_models_and_health(server, client, bundle):
    ids = [m.id for m in client.models.list()]
    assert ids == [bundle.name, "default"]
    assert client.models.retrieve("default").id == "default"
    health = httpx.get(server.url + "/health").json()  # no token needed for liveness
    assert health["status"] == "ok" and health["model"] == bundle.name
    assert "plain" in health["modes"]


def test_binds_loopback_only_by_default(server):
    listening = [c for c in psutil.Process(server.proc.pid).net_connections("inet")
                 if c.status == psutil.CONN_LISTEN]
    assert listening, "the server listens on no socket"
    assert {c.laddr.ip for c in listening} == {"127.0.0.1"}
    assert {c.laddr.port for c in listening} == {server.port}


def test_bearer_token_required(server):
    body = {"model": "default", "prompt": "abc", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = post(server, "/v1/completions", body, headers=headers)
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "invalid_api_key"
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert httpx.get(server.url + "/v1/models").status_code == 401
    # Checked before anything else: an unauthenticated bad body learns nothing about the body.
    assert post(server, "/v1/chat/completions", None, headers={}, raw="{oops").status_code == 401
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    assert post(server, "/v1/completions", body).status_code == 200


# ------------------------------------------------------------------ generation
def test_chat_matches_python_api(client, engine):
    ref = engine.chat(MSGS, max_tokens=24)
    r = client.chat.completions.create(model="default", messages=MSGS, max_tokens=24, temperature=0)
    assert r.choices[0].message.content == ref.text
    assert r.choices[0].message.role == "assistant"
    assert r.model == "tiny-test"  # the served model's id, whatever alias was asked for
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(engine.encode_prompt(messages=MSGS))
    assert r.usage.completion_tokens == 24 == len(ref.tokens)
    assert r.usage.total_tokens == r.usage.prompt_tokens + 24
    ext = r.model_extra["edgespec"]
    assert ext["mode"] == ref.stats.mode and ext["verifier_passes"] >= 1 and ext["tokens_per_pass"] > 0


def test_chat_stream_matches_python_api(client, engine):
    ref = engine.chat(MSGS, max_tokens=30)
    stream = client.chat.completions.create(model="default", messages=MSGS, max_tokens=30, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref.text
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == "length"
    assert finals[0].model_extra["edgespec"]["mode"] == ref.stats.mode
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 30


def test_completions_plain_http(server, engine):
    ref = engine.generate("hello world", max_tokens=20)
    r = post(server, "/v1/completions", {"model": "tiny-test", "prompt": "hello world", "max_tokens": 20})
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "text_completion" and body["choices"][0]["text"] == ref.text
    assert body["usage"] == {"prompt_tokens": 11, "completion_tokens": 20, "total_tokens": 31,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    events = sse_events(server, "/v1/completions",
                        {"model": "default", "prompt": "hello world", "max_tokens": 20, "stream": True})
    assert events[-1] == "[DONE]"
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == ref.text
    assert events[-2]["choices"][0]["finish_reason"] == "length" and "edgespec" in events[-2]
    ids = engine.tokenizer.encode("hello world")  # token-id prompts are accepted too
    r = post(server, "/v1/completions", {"model": "default", "prompt": ids, "max_tokens": 20})
    assert r.json()["choices"][0]["text"] == ref.text


@pytest.mark.parametrize("stream", [False, True])
def test_stop_sequence(client, engine, stream):
    full = engine.chat(MSGS, max_tokens=40).text
    stop = full[12:14]
    expected = full[: full.index(stop)]
    r = client.chat.completions.create(model="default", messages=MSGS, max_tokens=40, stop=[stop, "@@"],
                                       stream=stream)
    if stream:
        chunks = list(r)
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
        finish = chunks[-1].choices[0].finish_reason
    else:
        text, finish = r.choices[0].message.content, r.choices[0].finish_reason
    assert text == expected and stop not in text
    assert finish == "stop"


@pytest.mark.parametrize("n", [1, 7])
def test_max_tokens(client, n):
    r = client.completions.create(model="default", prompt="hello world", max_tokens=n)
    assert r.usage.completion_tokens == n
    assert r.choices[0].finish_reason == "length"


def test_seeded_sampling_matches_python_api(client, engine):
    kw = dict(max_tokens=24, temperature=0.9, top_p=0.95, seed=1234)
    ref = engine.chat(MSGS, **kw).text
    texts = [client.chat.completions.create(model="default", messages=MSGS, **kw).choices[0].message.content
             for _ in range(2)]
    assert texts == [ref, ref]


def test_extension_fields(client, engine):
    kw = dict(max_tokens=10, extra_body={"mode": "plain", "top_k": 5, "min_p": 0.05, "draft_tokens": 4})
    r = client.chat.completions.create(model="default", messages=MSGS, **kw)
    assert r.model_extra["edgespec"]["mode"] == "plain"
    assert r.choices[0].message.content == engine.chat(MSGS, max_tokens=10, mode="plain").text


# ------------------------------------------------------------------ bad input
CHAT, COMP = "/v1/chat/completions", "/v1/completions"
OK_CHAT = {"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
OK_COMP = {"model": "default", "prompt": "abc", "max_tokens": 2}

BAD = [
    # (id, path, body or raw text, status, param)
    ("malformed-json", CHAT, '{"model": "default", "messages": [', 400, None),
    ("not-an-object", CHAT, "[1, 2]", 400, None),
    ("empty-body", COMP, "", 400, None),
    ("unknown-field", CHAT, {**OK_CHAT, "temprature": 0.5}, 400, "temprature"),
    ("unknown-message-field", CHAT, {**OK_CHAT, "messages": [{"role": "user", "content": "hi", "x": 1}]},
     400, "messages.0.x"),
    ("missing-messages", CHAT, {"model": "default"}, 400, "messages"),
    ("empty-messages", CHAT, {**OK_CHAT, "messages": []}, 400, "messages"),
    ("bad-role", CHAT, {**OK_CHAT, "messages": [{"role": "robot", "content": "hi"}]}, 400, "messages.0.role"),
    ("max-tokens-string", CHAT, {**OK_CHAT, "max_tokens": "5"}, 400, "max_tokens"),
    ("max-tokens-zero", COMP, {**OK_COMP, "max_tokens": 0}, 400, "max_tokens"),
    ("temperature-bool", COMP, {**OK_COMP, "temperature": True}, 400, "temperature"),
    ("stream-string", COMP, {**OK_COMP, "stream": "yes"}, 400, "stream"),
    ("prompt-number", COMP, {**OK_COMP, "prompt": 42}, 400, "prompt"),
    ("empty-prompt", COMP, {**OK_COMP, "prompt": ""}, 400, "prompt"),
    ("token-out-of-vocab", COMP, {**OK_COMP, "prompt": [1, 2, 999]}, 400, "prompt"),
    ("over-long-prompt", COMP, {**OK_COMP, "prompt": "ab" * 400}, 400, "prompt"),
    ("over-long-chat", CHAT, {**OK_CHAT, "messages": [{"role": "user", "content": "x" * 600}]}, 400, "messages"),
    ("negative-temperature", CHAT, {**OK_CHAT, "temperature": -0.5}, 400, "temperature"),
    ("top-p-zero", CHAT, {**OK_CHAT, "top_p": 0}, 400, "top_p"),
    ("top-p-above-one", COMP, {**OK_COMP, "top_p": 1.5}, 400, "top_p"),
    ("negative-top-k", COMP, {**OK_COMP, "top_k": -1}, 400, "top_k"),
    ("min-p-one", COMP, {**OK_COMP, "min_p": 1.0}, 400, "min_p"),
    ("negative-seed", COMP, {**OK_COMP, "seed": -1}, 400, "seed"),
    ("huge-seed", COMP, {**OK_COMP, "seed": 2**70}, 400, "seed"),
    ("seed-2-to-the-63", COMP, {**OK_COMP, "seed": 2**63}, 400, "seed"),  # the engine takes [0, 2**63)
    ("content-null", CHAT, {**OK_CHAT, "messages": [{"role": "user", "content": None}]}, 400, "messages.0.content"),
    ("content-number", CHAT, {**OK_CHAT, "messages": [{"role": "user", "content": 5}]}, 400, "messages.0.content"),
    ("content-no-parts", CHAT, {**OK_CHAT, "messages": [{"role": "user", "content": []}]}, 400, "messages.0.content"),
    ("content-image-part", CHAT, {**OK_CHAT, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, "messages.0.content"),
    ("content-part-number", CHAT, {**OK_CHAT, "messages": [{"role": "user", "content": [5]}]}, 400,
     "messages.0.content"),
    ("content-part-text-null", CHAT, {**OK_CHAT, "messages": [{"role": "user", "content": [
        {"type": "text", "text": None}]}]}, 400, "messages.0.content"),
    ("too-many-messages", CHAT, {**OK_CHAT, "messages": [{"role": "user", "content": "x"}] * 2049}, 400,
     "messages"),
    ("too-many-parts", CHAT, {**OK_CHAT, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "x"}] * 1025}] * 2}, 400, "messages"),
    ("n-nine", CHAT, {**OK_CHAT, "n": 9}, 400, "n"),
    ("n-zero", COMP, {**OK_COMP, "n": 0}, 400, "n"),
    ("penalty-out-of-range", CHAT, {**OK_CHAT, "presence_penalty": 2.5}, 400, "presence_penalty"),
    ("frequency-penalty-string", COMP, {**OK_COMP, "frequency_penalty": "1"}, 400, "frequency_penalty"),
    ("repetition-penalty-zero", CHAT, {**OK_CHAT, "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("top-logprobs-alone", CHAT, {**OK_CHAT, "top_logprobs": 2}, 400, None),
    ("top-logprobs-21", CHAT, {**OK_CHAT, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ("logprobs-bool-on-completions", COMP, {**OK_COMP, "logprobs": True}, 400, "logprobs"),
    ("response-format-unknown", CHAT, {**OK_CHAT, "response_format": {"type": "xml"}}, 400, "response_format"),
    ("response-format-no-schema-name", CHAT, {**OK_CHAT, "response_format": {
        "type": "json_schema", "json_schema": {"schema": {}}}}, 400, "response_format.json_schema.name"),
    ("response-format-string", COMP, {**OK_COMP, "response_format": "json"}, 400, "response_format"),
    ("tool-no-call-id", CHAT, {**OK_CHAT, "messages": [{"role": "tool", "content": "x"}]}, 400, "messages.0"),
    ("tool-calls-on-user", CHAT, {**OK_CHAT, "messages": [{"role": "user", "content": "x", "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, 400, "messages.0"),
    ("tool-call-args-not-json", CHAT, {**OK_CHAT, "messages": [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]}, 400, "messages"),
    ("tool-bad-name", CHAT, {**OK_CHAT, "tools": [{"type": "function", "function": {"name": "a b"}}]}, 400,
     "tools.0.function.name"),
    ("tool-bad-type", CHAT, {**OK_CHAT, "tools": [{"type": "code_interpreter"}]}, 400, "tools.0.type"),
    ("tool-choice-unknown-function", CHAT, {**OK_CHAT, "tools": [{"type": "function", "function": {"name": "f"}}],
                                            "tool_choice": {"type": "function", "function": {"name": "g"}}},
     400, "tool_choice"),
    ("tool-choice-required-no-tools", CHAT, {**OK_CHAT, "tool_choice": "required"}, 400, "tool_choice"),
    ("tool-choice-word", CHAT, {**OK_CHAT, "tool_choice": "always"}, 400, "tool_choice"),
    ("tool-choice-with-response-format", CHAT, {
        **OK_CHAT, "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required",
        "response_format": {"type": "json_object"}}, 400, "response_format"),
    ("tools-on-completions", COMP, {**OK_COMP, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400,
     "tools"),
    ("too-many-stops", CHAT, {**OK_CHAT, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ("empty-stop", CHAT, {**OK_CHAT, "stop": [""]}, 400, "stop"),
    ("unknown-mode", CHAT, {**OK_CHAT, "mode": "warp"}, 400, "mode"),
    ("draft-tokens-17", CHAT, {**OK_CHAT, "draft_tokens": 17}, 400, "draft_tokens"),
    ("unknown-model", CHAT, {**OK_CHAT, "model": "gpt-4o"}, 404, "model"),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_input_is_a_4xx_with_openai_error(server, case):
    _, path, body, status, param = case
    r = post(server, path, None, raw=body) if isinstance(body, str) else post(server, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"] and err["type"] == "invalid_request_error"
    assert err["param"] == param
    # The server keeps serving.
    assert post(server, COMP, OK_COMP).json()["usage"]["completion_tokens"] == 2


CONTENT_MESSAGES = [
    (None, 'must be a string or a list of text parts ({"type": "text", "text": "..."}), got null'),
    (5, "must be a string or a list of text parts"),
    ([], "is an empty list"),
    ([{"type": "image_url", "image_url": {"url": "x"}}], "part 0 has type 'image_url': only text parts"),
    (["hi"], 'part 0 must be an object {"type": "text", "text": "..."}, got a string'),
    ([{"type": "text"}], "part 0 needs a string 'text', got null"),
]


@pytest.mark.parametrize("content,message", CONTENT_MESSAGES, ids=[repr(c[0])[:20] for c in CONTENT_MESSAGES])
def test_message_content_that_is_not_text_is_a_clear_400(server, content, message):
    """The engine's chat template raised TypeError on content null or 5; the server says what is wrong."""
    r = post(server, CHAT, {**OK_CHAT, "messages": [{"role": "user", "content": "hi"},
                                                    {"role": "assistant", "content": content}]})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "messages.1.content" and err["code"] == "invalid_value"
    assert err["message"].startswith(f"messages.1.content: {message}"), err["message"]


def test_one_seed_range_in_schema_engine_and_server(server, engine):
    """[0, 2**63): what edgespec.logits.sampling takes, what the OpenAPI schema states, what the server accepts."""
    from edgespec.apps.server import ServerSettings, create_app
    from edgespec.apps.server.schemas import SEED_LIMIT

    from edgespec.logits.sampling import SamplingParams

    assert SEED_LIMIT == 2**63
    SamplingParams(seed=SEED_LIMIT - 1)
    with pytest.raises(ValueError, match=r"\[0, 2\*\*63\)"):
        SamplingParams(seed=SEED_LIMIT)
    schema = create_app(engine, ServerSettings(model_id="x")).openapi()["components"]["schemas"]
    for name in ("ChatCompletionRequest", "CompletionRequest"):
        seed = next(s for s in schema[name]["properties"]["seed"]["anyOf"] if s.get("type") == "integer")
        assert seed["minimum"] == 0 and seed["exclusiveMaximum"] == SEED_LIMIT, seed
    body = {**OK_COMP, "temperature": 0.8, "seed": SEED_LIMIT - 1, "max_tokens": 6}
    r = post(server, COMP, body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == engine.generate("abc", max_tokens=6, temperature=0.8,
                                                             seed=SEED_LIMIT - 1).text
    r = post(server, COMP, {**body, "seed": SEED_LIMIT})
    assert r.status_code == 400 and r.json()["error"]["message"] == (
        "seed: must be an integer in [0, 2**63), got 9223372036854775808")


def test_unknown_route_and_method(server):
    r = httpx.get(server.url + "/v1/nothing", headers=AUTH)
    assert r.status_code == 404 and "no such endpoint" in r.json()["error"]["message"]
    r = httpx.get(server.url + CHAT, headers=AUTH)
    assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"


def test_openai_client_sees_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=MSGS)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="default", messages=MSGS, temperature=-1)
    assert e.value.body["param"] == "temperature"


# ------------------------------------------------------------------ cancellation
def test_disconnect_mid_stream_cancels_and_frees_engine(server, engine):
    before = httpx.get(server.url + "/health").json()["queue"]
    body = {"model": "default", "prompt": "hello world", "max_tokens": 480, "stream": True}
    with httpx.stream("POST", server.url + COMP, json=body, headers=AUTH, timeout=60) as r:
        got = 0
        for line in r.iter_lines():
            got += line.startswith("data: ")
            if got == 3:
                break  # leave mid-stream: closing the response drops the connection
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        q = httpx.get(server.url + "/health").json()["queue"]
        if q["running"] == 0 and q["cancelled"] > before["cancelled"]:
            break
        time.sleep(0.05)
    assert q["cancelled"] == before["cancelled"] + 1 and q["running"] == 0
    # The engine is free and still correct.
    r = post(server, COMP, {"model": "default", "prompt": "hello world", "max_tokens": 12})
    assert r.json()["choices"][0]["text"] == engine.generate("hello world", max_tokens=12).text


# ------------------------------------------------------------------ decoding modes
NEEDS_DRAFTER = ("speculative", "cascade", "tree")  # tree: its default source is the drafter


def _modes_without_drafter() -> list[str]:
    from edgespec.modes import available_modes

    return [m for m in available_modes() if m not in NEEDS_DRAFTER]


@pytest.mark.parametrize("mode", _modes_without_drafter())
def test_every_mode_over_http_gives_the_plain_greedy_output(client, engine, mode):
    ref = engine.chat(MSGS, max_tokens=20, mode="plain").text
    r = client.chat.completions.create(model="default", messages=MSGS, max_tokens=20,
                                       extra_body={"mode": mode})
    assert r.choices[0].message.content == ref
    assert r.model_extra["edgespec"]["mode"] == mode


def test_weight_free_tree_over_http_gives_the_plain_greedy_output(client, engine):
    ref = engine.chat(MSGS, max_tokens=20, mode="plain").text
    r = client.chat.completions.create(model="default", messages=MSGS, max_tokens=20, extra_body={
        "mode": "tree", "mode_options": {"sources": "prompt_lookup+pool", "window": 2}})
    assert r.choices[0].message.content == ref and r.model_extra["edgespec"]["mode"] == "tree"


@pytest.mark.parametrize("stream", [False, True])
def test_request_the_engine_rejects_is_a_400(server, stream):
    """A mode the loaded model cannot run (speculative without a drafter) or bad mode options."""
    from edgespec.modes import available_modes

    # Options are checked against the mode's schema while the request is read.
    r = post(server, CHAT, {**OK_CHAT, "mode": "lookahead", "mode_options": {"window": 999}, "stream": stream})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_value", r.text
    assert "lookahead option 'window' must be an integer in 0..32" in r.json()["error"]["message"]
    bodies = [{**OK_CHAT, "mode": m, "stream": stream} for m in NEEDS_DRAFTER if m in available_modes()]
    for body in bodies:
        r = post(server, CHAT, body)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "invalid_request" and err["param"] == "mode"
        assert err["message"].startswith(f"mode '{body['mode']}' ") and "drafter" in err["message"]
        assert "This server has no drafter: start it with --drafter" in err["message"], err["message"]
    r = post(server, CHAT, {**OK_CHAT, "mode_options": {"max_tokens": 3}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "mode_options"
    assert post(server, COMP, OK_COMP).status_code == 200


# ------------------------------------------------------------------ command line
def test_cli_defaults_to_loopback_and_hides_the_key(monkeypatch):
    from edgespec.apps.serve import is_loopback

    from edgespec.cli import build_parser

    monkeypatch.setenv("EDGESPEC_API_KEY", "sk-secret-value")
    parser = build_parser()
    args = parser.parse_args(["serve"])
    assert args.host == "127.0.0.1" and args.api_key is None
    sub = parser._subparsers._group_actions[0].choices["serve"]
    assert "sk-secret-value" not in sub.format_help()
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.168.1.4") and not is_loopback("my.host")


def test_openai_shaped_extras_accepted(server, engine):
    """Content parts, developer role, neutral penalties, max_completion_tokens, user."""
    body = {"model": "default", "max_completion_tokens": 6, "presence_penalty": 0.0, "frequency_penalty": 0,
            "user": "u1", "n": 1,
            "messages": [{"role": "developer", "content": "be brief"},
                         {"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}]}]}
    r = post(server, CHAT, body)
    assert r.status_code == 200, r.text
    ref = engine.chat(MSGS, max_tokens=6).text  # developer == system; parts are concatenated
    assert r.json()["choices"][0]["message"]["content"] == ref


def test_oversized_body_is_refused(server):
    r = post(server, COMP, {**OK_COMP, "prompt": "a" * (5 << 20)})
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
    assert post(server, COMP, OK_COMP).status_code == 200


def test_swift_example_request_shape(server, engine):
    """The body docs/swift.md's ChatRequest encodes (nil optionals omitted), parsed line by
    line as its client does."""
    body = {"model": "default", "messages": MSGS, "stream": True, "max_tokens": 12,
            "stream_options": {"include_usage": True}}
    text, reasons, usage, stats = [], [], None, None
    with httpx.stream("POST", server.url + CHAT, json=body, timeout=60,
                      headers={**AUTH, "Accept": "text/event-stream"}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if line[6:] == "[DONE]":
                break
            chunk = json.loads(line[6:])
            assert "error" not in chunk
            usage = chunk.get("usage") or usage
            for choice in chunk["choices"]:
                text.append(choice["delta"].get("content") or "")
                if choice["finish_reason"]:
                    reasons.append(choice["finish_reason"])
                    stats = chunk["edgespec"]
    assert "".join(text) == engine.chat(MSGS, max_tokens=12).text
    assert reasons == ["length"] and usage["completion_tokens"] == 12
    assert {"mode", "acceptance_rate", "tokens_per_pass", "tokens_per_s", "queue_s"} <= set(stats)


def test_command_line_defaults_become_request_defaults():
    from edgespec.apps.serve import server_defaults

    from edgespec.cli import build_parser

    args = build_parser().parse_args(["serve", "--max-tokens", "9", "--temperature", "0.5", "--seed", "3",
                                      "--mode", "lookahead", "--mode-option", "window=5", "--stop", "##"])
    d = server_defaults(args)
    assert d["max_tokens"] == 9 and d["temperature"] == 0.5 and d["seed"] == 3
    assert d["mode"] == "lookahead" and d["window"] == 5 and d["stop"] == ["##"]
    with pytest.raises(ValueError, match="top_p"):
        server_defaults(build_parser().parse_args(["serve", "--top-p", "0"]))


def test_oversized_chunked_body_is_refused_without_reading_it_whole(server):
    """No Content-Length (Transfer-Encoding: chunked): the limit still applies as the bytes arrive."""
    sent = [0]

    def chunks():
        piece = b'{"model": "default", "prompt": "' + b"a" * (1 << 16)
        yield piece
        sent[0] += len(piece)
        while sent[0] < (64 << 20):  # would be 64 MiB if the server kept reading
            yield b"a" * (1 << 16)
            sent[0] += 1 << 16
        yield b'"}'

    try:
        r = httpx.post(server.url + COMP, content=chunks(), headers={**AUTH, "content-type": "application/json"},
                       timeout=60)
        assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
    except (httpx.RemoteProtocolError, httpx.WriteError, httpx.ReadError):
        pass  # the server answered 413 and closed while the client was still sending
    assert sent[0] < (32 << 20)  # the server stopped reading near the 4 MiB limit
    assert post(server, COMP, OK_COMP).status_code == 200


def test_max_tokens_over_the_server_limit_is_a_400(server):
    r = post(server, COMP, {**OK_COMP, "max_tokens": 10**9})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
    assert "limit of 8192" in r.json()["error"]["message"]
    assert post(server, COMP, {**OK_COMP, "max_tokens": 4}).status_code == 200


def test_non_loopback_host_without_a_key_refuses_to_start(bundle, monkeypatch):
    """Before any model loads: a public bind needs --api-key, or --insecure-no-auth said out loud."""
    import subprocess
    import sys

    monkeypatch.delenv("EDGESPEC_API_KEY", raising=False)
    cmd = [sys.executable, "-m", "edgespec.cli", "serve", "--model", str(bundle), "--host", "0.0.0.0", "--port", "0"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "--api-key" in r.stderr and "--insecure-no-auth" in r.stderr, r.stderr
    assert "edgespec serve:" not in r.stdout  # never started serving


def test_deeply_nested_json_is_invalid_json(server):
    """Nesting past Python's recursion limit fails inside FastAPI's parser: still the documented code."""
    deep = '{"model": "default", "prompt": "a", "x": ' + "[" * 100000 + "]" * 100000 + "}"
    r = post(server, COMP, None, raw=deep)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json", r.text
    assert post(server, COMP, OK_COMP).status_code == 200


def test_a_shared_prefix_is_reused_and_reported(server):
    """usage.prompt_tokens_details.cached_tokens (as OpenAI reports it) and /health's
    prompt_cache; the reply is the same as without reuse."""
    system = {"role": "system", "content": "abcdefghij " * 12}
    body = {"model": "default", "max_tokens": 6, "messages": [system, {"role": "user", "content": "hello"}]}
    first = post(server, "/v1/chat/completions", body).json()
    again = post(server, "/v1/chat/completions", body).json()
    assert again["choices"][0]["message"] == first["choices"][0]["message"]
    cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= again["usage"]["prompt_tokens"] - 32 > 0
    other = post(server, "/v1/chat/completions",
                 {**body, "messages": [system, {"role": "user", "content": "another question"}]}).json()
    assert 0 < other["usage"]["prompt_tokens_details"]["cached_tokens"] < other["usage"]["prompt_tokens"]
    health = httpx.get(server.url + "/health", timeout=30).json()["prompt_cache"]
    assert health["hits"] >= 2 and 0 < health["bytes"] + health["drafter_bytes"] <= health["max_bytes"]


def test_context_overflow_truncate_oldest_on_request(server):
    turns = []
    for i in range(40):
        turns += [{"role": "user", "content": f"question {i} " + "ab " * 20},
                  {"role": "assistant", "content": "cd " * 20}]
    body = {"model": "default", "max_tokens": 4, "messages": [*turns, {"role": "user", "content": "last"}]}
    r = post(server, "/v1/chat/completions", body)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    r = post(server, "/v1/chat/completions", {**body, "context_overflow": "truncate_oldest"})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] <= 512
    r = post(server, "/v1/chat/completions", {**body, "context_overflow": "drop_all"})
    assert r.status_code == 400 and "context_overflow" in r.text
