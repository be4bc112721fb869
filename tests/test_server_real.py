"""`edgespec serve` on the real default model: greedy output over HTTP equals the Python API's."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from server_support import ServerProcess

pytestmark = pytest.mark.real_model

MSGS = [{"role": "user", "content": "Name three colours of the rainbow."}]
N = 16


@pytest.fixture(scope="module")
def real_server(real_bundle):
    s = ServerProcess(real_bundle, "--drafter", "none", timeout=300)
    yield s
    s.stop()


def test_real_chat_over_http_equals_python_api(real_server, real_engine, real_bundle):
    ref = real_engine.chat(MSGS, max_tokens=N)
    client = openai.OpenAI(base_url=real_server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    assert [m.id for m in client.models.list()] == [real_bundle.name, "default"]

    r = client.chat.completions.create(model=real_bundle.name, messages=MSGS, max_tokens=N, temperature=0)
    assert r.choices[0].message.content == ref.text
    assert r.usage.completion_tokens == len(ref.tokens)
    assert r.usage.prompt_tokens == ref.prompt_tokens

    # Streaming over plain HTTP, stopped by a stop string taken from the reference.
    words = ref.text.split()
    stop = " " + words[min(3, len(words) - 1)]
    expected = ref.text[: ref.text.index(stop)] if stop in ref.text else ref.text
    text = []
    body = {"model": "default", "messages": MSGS, "max_tokens": N, "stop": stop, "stream": True}
    with httpx.stream("POST", real_server.url + "/v1/chat/completions", json=body, timeout=300) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                text.append(choice["delta"].get("content") or "")
                finish = choice["finish_reason"] or None
    assert "".join(text) == expected
    assert finish == ("stop" if stop in ref.text else "length")
