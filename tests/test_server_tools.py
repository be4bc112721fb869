"""The server's reply builder (apps/server/app.py `_Reply`) on engine chunks: a model's own
tool call, written in its format inside the text (tool_choice "auto"), becomes OpenAI's
`message.tool_calls` whole and `delta.tool_calls` streamed, however the text is split into
chunks; logprobs come out in OpenAI's chat and legacy shapes."""

from __future__ import annotations

import json
import math

import pytest
from edgespec.apps.server.app import _chunk_logprobs, _Reply, _Shape

from edgespec.generate import Chunk
from edgespec.logits.processors import TokenLogprob
from edgespec.logits.tools import plan_tools

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
REPLY = 'Checking. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'


class _Job:  # what _Reply reads of a scheduler Job: nothing but identity here
    pass


class _Tok:
    def token_bytes(self, i: int) -> bytes:
        return f"<{i}>".encode()


def _chunks(text: str, size: int, finish: str = "stop") -> list[Chunk]:
    pieces = [text[i:i + size] for i in range(0, len(text), size)]
    return [Chunk(p, [i], finish if i == len(pieces) - 1 else None) for i, p in enumerate(pieces)]


@pytest.mark.parametrize("size", [1, 4, 11, len(REPLY)])
def test_a_call_in_the_text_becomes_tool_calls_whole_and_streamed(size):
    plan = plan_tools([WEATHER], "auto")
    whole = _Reply(0, _Job(), _Shape(True, _Tok(), None, plan))
    streamed = _Reply(0, _Job(), _Shape(True, _Tok(), None, plan))
    content, deltas = [], []
    for chunk in _chunks(REPLY, size):
        whole.add(chunk)
        text, d, _ = streamed.add(chunk)
        content.append(text)
        deltas += d
    whole.end()
    final = whole.final()
    assert final["finish_reason"] == "tool_calls"
    msg = final["message"]
    assert msg["content"] == "Checking. "
    (call,) = msg["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "Oslo"}
    # Streamed: the same content, then the call as two pieces (id/type/name, then arguments).
    assert "".join(content) == "Checking. "
    assert [sorted(d) for d in deltas] == [["function", "id", "index", "type"], ["function", "index"]]
    assert deltas[0]["function"] == {"name": "get_weather", "arguments": ""}
    assert json.loads(deltas[1]["function"]["arguments"]) == {"city": "Oslo"}
    assert streamed.finish_reason == "tool_calls"
    delta = streamed.delta(None, deltas[:1])
    assert delta["delta"] == {"tool_calls": deltas[:1]} and delta["index"] == 0


def test_without_a_call_the_reply_is_plain_content_and_finish_is_kept():
    plan = plan_tools([WEATHER], "auto")
    r = _Reply(0, _Job(), _Shape(True, _Tok(), None, plan))
    for chunk in _chunks("It is sunny in Oslo.", 3, finish="length"):
        r.add(chunk)
    r.end()
    final = r.final()
    assert final["message"] == {"role": "assistant", "content": "It is sunny in Oslo."}
    assert final["finish_reason"] == "length"


def test_named_choice_reads_the_whole_reply_as_the_arguments():
    plan = plan_tools([WEATHER], {"type": "function", "function": {"name": "get_weather"}})
    r = _Reply(0, _Job(), _Shape(True, _Tok(), None, plan))
    for chunk in _chunks('{"city": "Lima"}', 5):
        assert r.add(chunk)[0] == ""  # nothing shown as content
    assert r.final()["message"]["tool_calls"][0]["function"]["arguments"] == '{"city": "Lima"}'


def test_logprobs_in_the_chat_and_legacy_shapes():
    lps = [TokenLogprob(5, -0.1, [(5, -0.1), (7, -2.5), (9, -3.0)]), TokenLogprob(7, -1.2, [(3, -0.9), (7, -1.2)])]
    chunk = Chunk("ab", [5, 7], "stop", logprobs=lps)
    assert _chunk_logprobs(chunk) == [(5, -0.1, [(5, -0.1), (7, -2.5), (9, -3.0)]), (7, -1.2, [(3, -0.9), (7, -1.2)])]

    chat = _Reply(0, _Job(), _Shape(True, _Tok(), 2))
    part = chat.add(chunk)[2]
    first = part["content"][0]
    assert first == {"token": "<5>", "logprob": -0.1, "bytes": list(b"<5>"), "top_logprobs": [
        {"token": "<5>", "logprob": -0.1, "bytes": list(b"<5>")}, {"token": "<7>", "logprob": -2.5, "bytes": list(b"<7>")}]}
    assert chat.final()["logprobs"]["content"] == part["content"]

    legacy = _Reply(0, _Job(), _Shape(False, _Tok(), 1))
    part = legacy.add(chunk)[2]
    assert part == {"tokens": ["<5>", "<7>"], "token_logprobs": [-0.1, -1.2],
                    "top_logprobs": [{"<5>": -0.1}, {"<3>": -0.9}], "text_offset": [0, 3]}
    assert legacy.final()["logprobs"] == part
    assert all(math.isfinite(v) for v in part["token_logprobs"])

    plain = _Reply(0, _Job(), _Shape(True, _Tok(), None))
    assert plain.add(chunk)[2] is None and plain.final()["logprobs"] is None
