"""Fuzzing, bounded in time: the HTTP API against the server's own OpenAPI schema
(schemathesis, valid and invalid requests) and the Python API's keyword surface
(hypothesis). Whatever comes in, the answer is a result or a documented error:
never a 5xx, a traceback or a dead server."""

from __future__ import annotations

import json

import hypothesis.strategies as st
import pytest
import schemathesis
from edgespec.apps.server import ServerSettings, create_app
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from server_support import ServerProcess, write_tiny_bundle

import edgespec

KEY = "sk-fuzz"
AUTH = {"Authorization": f"Bearer {KEY}"}
FUZZ = settings(max_examples=60, deadline=None, database=None, derandomize=True,
                suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    return write_tiny_bundle(tmp_path_factory.mktemp("fuzz") / "tiny-fuzz")


@pytest.fixture(scope="module")
def engine(bundle):
    return edgespec.load(bundle, drafter="none", progress=False, history="off")


@pytest.fixture(scope="module")
def server(bundle):
    # A low ceiling on max_tokens keeps each fuzzed generation short.
    s = ServerProcess(bundle, "--api-key", KEY, "--max-tokens-limit", "8")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def schema(engine):
    """The OpenAPI document FastAPI derives from the server's own routes and models."""
    app = create_app(engine, ServerSettings(model_id="tiny-fuzz", api_key=KEY))
    doc = app.openapi()
    # Requests name a served model; any other name is one refusal (404), already tested.
    for name in ("ChatCompletionRequest", "CompletionRequest"):
        doc["components"]["schemas"][name]["properties"]["model"]["enum"] = ["tiny-fuzz"]
    return schemathesis.openapi.from_dict(doc)


def _operations(schema):
    ops = [r.ok() for r in schema.get_all_operations()]
    assert {op.path for op in ops} >= {"/v1/chat/completions", "/v1/completions", "/v1/models"}
    return ops


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=lambda m: m.value)
def test_http_api_fuzz_never_errors_on_the_server_side(server, schema, mode):
    seen: dict[int, int] = {}
    codes: dict[str, int] = {}
    for op in _operations(schema):
        if mode is GenerationMode.NEGATIVE and not len(op.body):
            continue  # nothing a URL can make invalid: no body, path parameters are any string

        @FUZZ
        @given(case=op.as_strategy(generation_mode=mode))
        def run(case):
            resp = case.call(base_url=server.url, headers=AUTH, timeout=60)
            seen[resp.status_code] = seen.get(resp.status_code, 0) + 1
            assert resp.status_code < 500, (case.method, case.path, case.body, resp.text[:300])
            if resp.status_code >= 400:
                # Every refusal is the documented OpenAI-style error object.
                err = json.loads(resp.text)["error"]
                assert err["message"] and err["type"] and "code" in err, resp.text[:300]
                codes[err["code"]] = codes.get(err["code"], 0) + 1

        run()
        assert server.alive(), server.log.read_text()[-2000:]
    total = sum(seen.values())
    print(f"\n{mode.value}: {total} requests, status counts {dict(sorted(seen.items()))} {codes}")
    assert total >= 100
    if mode is GenerationMode.NEGATIVE:
        assert any(400 <= code < 500 for code in seen)  # the invalid ones were refused, not served
    else:
        assert 200 in seen  # valid requests were served


# ------------------------------------------------------------------ the Python API

_VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**40), 2**40), st.floats(allow_nan=True),
    st.text(max_size=8), st.lists(st.integers(-5, 400), max_size=4), st.binary(max_size=4),
)
_KEYS = st.sampled_from([
    "max_tokens", "stop", "temperature", "top_k", "top_p", "min_p", "seed", "mode",
    "draft_tokens", "window", "ngram", "sources", "guesses", "temprature", "maxtokens", "pipeline",
])
_GOOD_PROMPTS = st.one_of(st.text(min_size=1, max_size=12), st.lists(st.integers(0, 200), min_size=1, max_size=6))
_PROMPTS = st.one_of(
    _GOOD_PROMPTS, _GOOD_PROMPTS, st.text(max_size=12), st.lists(st.integers(-3, 10**6), max_size=6),
    st.binary(max_size=6), st.integers(), st.none(), st.lists(st.text(max_size=2), max_size=3),
)


@settings(FUZZ, max_examples=150)
@given(prompt=_PROMPTS, kwargs=st.dictionaries(_KEYS, _VALUES, max_size=3))
def _python_api_case(engine, outcomes, prompt, kwargs):
    kwargs = dict(kwargs)
    if isinstance(kwargs.get("max_tokens"), int) and not isinstance(kwargs["max_tokens"], bool):
        kwargs["max_tokens"] = min(kwargs["max_tokens"], 4)  # keep valid generations short
    else:
        kwargs.setdefault("max_tokens", 4)
    try:
        result = engine.generate(prompt, **kwargs)
    except (TypeError, ValueError, edgespec.EdgespecError) as e:
        assert str(e), "an error must say what was wrong"
        outcomes[type(e).__name__] = outcomes.get(type(e).__name__, 0) + 1
        return
    outcomes["result"] = outcomes.get("result", 0) + 1
    assert isinstance(result.text, str) and len(result.tokens) <= 4
    assert result.finish_reason in ("stop", "length", "context", "cancelled")


def test_python_api_fuzz_gives_a_result_or_a_documented_error(engine):
    outcomes: dict[str, int] = {}
    _python_api_case(engine, outcomes)
    print(f"\npython api: {sum(outcomes.values())} calls, {outcomes}")
    assert outcomes.get("result", 0) > 0 and sum(outcomes.values()) - outcomes.get("result", 0) > 0
