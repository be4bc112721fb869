"""Tool calls: the tool list checked, rendered by chat templates (native and fallback), each
model family's call format parsed back, whole and streamed, and the constraint planned for
tool_choice "required" and a named function."""

from __future__ import annotations

import json

import pytest

from edgespec.logits.tools import (
    FORMATS,
    ToolCall,
    check_tools,
    openai_tool_call_deltas,
    plan_tools,
    template_tool_variable,
    tool_format,
)
from edgespec.tokenizer import Tokenizer, chat_messages

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}
TOOLS = [WEATHER, TIME]

HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "22 C and sunny"},
]

# A template in the style of tool-calling models (Qwen/Hermes): it renders `tools` and
# assistant tool_calls itself (arguments as objects, through tojson).
NATIVE_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    "Call as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{\"name\": \"{{ c.function.name }}\", "
    "\"arguments\": {{ c.function.arguments | tojson }}}</tool_call>{% endfor %}{% endif %}"
    "{% if m.role == 'tool' %} (from {{ m.name }}){% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _tok(template: str) -> Tokenizer:
    from tokenizers import Tokenizer as HF
    from tokenizers.models import WordLevel

    return Tokenizer(HF(WordLevel({"<unk>": 0}, unk_token="<unk>")), {"chat_template": template})


def _stream_all(plan, text: str, step: int = 1):
    s = plan.stream()
    events = []
    for i in range(0, len(text), step):
        events += s.feed(text[i:i + step])
    events += s.finish()
    content = "".join(e for k, e in events if k == "content")
    return content, [e for k, e in events if k == "call"], events


# ------------------------------------------------------------------ formats
@pytest.mark.parametrize("fmt,text,content,calls", [
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     "Let me check.\n", [("get_weather", {"city": "Paris"})]),
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}</tool_call>\n'
               '<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}</tool_call>',
     "", [("get_weather", {"city": "Oslo", "unit": "C"}), ("get_time", {"zone": "CET"})]),
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Rome"}}', "", [("get_weather", {"city": "Rome"})]),
    ("llama3", '<|python_tag|>{"name": "get_time", "parameters": {"zone": "UTC"}}; '
               '{"name": "get_weather", "parameters": {"city": "Lima"}}',
     "", [("get_time", {"zone": "UTC"}), ("get_weather", {"city": "Lima"})]),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Bern"}}]', "",
     [("get_weather", {"city": "Bern"})]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Kyiv"}[TOOL_CALLS]get_time[ARGS]{"zone": "EET"}', "",
     [("get_weather", {"city": "Kyiv"}), ("get_time", {"zone": "EET"})]),
    ("gemma", 'Checking.\n```tool_code\nget_weather(city="Lyon", unit="C")\n```', "Checking.\n",
     [("get_weather", {"city": "Lyon", "unit": "C"})]),
])
def test_each_format_parses_its_calls_whole_and_streamed(fmt, text, content, calls):
    plan = plan_tools(TOOLS, "auto")
    plan.fmt = FORMATS[fmt]
    got_content, got_calls = plan.parse(text)
    assert got_content == content
    assert [(c.name, c.arguments) for c in got_calls] == calls
    assert all(c.id and c.id != got_calls[0].id for c in got_calls[1:])
    for step in (1, 3, 7):  # any split of the text gives the same events
        s_content, s_calls, _ = _stream_all(plan, text, step)
        assert s_content == content
        assert [(c.name, c.arguments) for c in s_calls] == calls


@pytest.mark.parametrize("fmt,text", [
    ("hermes", "Paris is sunny today."),
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>'),  # broken JSON
    ("hermes", '<tool_call>{"name": "launch_rockets", "arguments": {}}</tool_call>'),  # not a tool offered
    ("llama3", "The weather is fine."),
    ("llama3", '{"temperature": 22}'),  # JSON, but not a call
    ("gemma", "```tool_code\nimport os\n```"),
])
def test_text_that_is_not_a_call_stays_content(fmt, text):
    plan = plan_tools(TOOLS, "auto")
    plan.fmt = FORMATS[fmt]
    content, calls = plan.parse(text)
    assert calls == []
    assert content == text
    assert _stream_all(plan, text, 2)[0] == text


def test_stream_gives_content_before_a_call_opens_and_holds_a_partial_marker():
    plan = plan_tools(TOOLS, "auto")
    s = plan.stream()
    assert s.feed("Sure, one moment <tool") == [("content", "Sure, one moment ")]  # "<tool" held back
    assert s.feed('_call>{"name": "get_time", ') == []
    events = s.feed('"arguments": {"zone": "UTC"}}</tool_call>')
    assert [k for k, _ in events] == ["call"] and events[0][1].arguments == {"zone": "UTC"}
    assert s.finish() == []
    assert s.finish() == []  # a second end adds nothing


def test_parallel_false_keeps_the_first_call_only():
    plan = plan_tools(TOOLS, "auto", parallel_tool_calls=False)
    text = ('<tool_call>{"name": "get_weather", "arguments": {"city": "A"}}</tool_call>'
            '<tool_call>{"name": "get_time", "arguments": {"zone": "B"}}</tool_call>')
    assert [c.name for c in plan.parse(text)[1]] == ["get_weather"]


def test_tool_choice_none_parses_nothing_and_renders_no_tools():
    plan = plan_tools(TOOLS, "none")
    assert plan.render_tools is None and plan.response_format is None
    text = '<tool_call>{"name": "get_weather", "arguments": {"city": "A"}}</tool_call>'
    assert plan.parse(text) == (text, [])


def test_format_detected_from_the_chat_template():
    assert tool_format("... <tool_call> ...").name == "hermes"
    assert tool_format("{{ '[TOOL_CALLS]' }}").name == "mistral"
    assert tool_format("<|start_header_id|>ipython<|end_header_id|>").name == "llama3"
    assert tool_format("<start_of_turn>user").name == "gemma"
    assert tool_format(CHATML).name == "hermes"  # the fallback teaches hermes
    assert tool_format(None).name == "hermes"
    assert template_tool_variable(NATIVE_TEMPLATE) == "tools"
    assert template_tool_variable("{% if xml_tools %}{{ xml_tools }}{% endif %}") == "xml_tools"
    assert template_tool_variable(CHATML) is None


# ------------------------------------------------------------------ the plan for tool_choice
def test_named_choice_constrains_to_the_functions_parameters():
    plan = plan_tools(TOOLS, {"type": "function", "function": {"name": "get_time"}})
    assert plan.render_tools == [TIME]
    rf = plan.response_format
    assert rf["type"] == "json_schema"
    assert rf["json_schema"]["schema"] == {**TIME["function"]["parameters"], "additionalProperties": False}
    content, calls = plan.parse('{"zone": "Europe/Paris"}')
    assert content == "" and [(c.name, c.arguments) for c in calls] == [("get_time", {"zone": "Europe/Paris"})]


def test_required_choice_constrains_to_an_array_of_calls():
    jsonschema = pytest.importorskip("jsonschema")
    plan = plan_tools(TOOLS, "required")
    schema = plan.response_format["json_schema"]["schema"]
    good = [{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "get_time", "arguments": {"zone": "X"}}]
    jsonschema.validate(good, schema)
    for bad in ([], [{"name": "get_weather", "arguments": {}}], [{"name": "nope", "arguments": {"zone": "X"}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    assert [(c.name, c.arguments) for c in plan.parse(json.dumps(good))[1]] == [(g["name"], g["arguments"]) for g in good]
    one = plan_tools(TOOLS, "required", parallel_tool_calls=False).response_format["json_schema"]["schema"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(good, one)
    # A reply cut short (max_tokens) is not a call: it comes back as text.
    assert plan.parse('[{"name": "get_wea') == ('[{"name": "get_wea', [])


@pytest.mark.parametrize("tools,choice,message", [
    ("get_weather", None, "tools must be a list"),
    ([{"type": "retrieval"}], None, "tools[0].type must be 'function'"),
    ([{"type": "function", "function": {"name": "has space"}}], None, "tools[0].function.name"),
    ([WEATHER, WEATHER], None, "a second function named 'get_weather'"),
    ([{"type": "function", "function": {"name": "f", "parameters": "x"}}], None, "parameters must be a JSON schema"),
    (TOOLS, "always", "tool_choice must be one of"),
    ([], "required", "needs a non-empty tools list"),
    (TOOLS, {"type": "function", "function": {"name": "get_news"}}, "not in tools"),
    (TOOLS, {"type": "function"}, "tool_choice must name a function"),
])
def test_bad_tools_and_tool_choice_are_named(tools, choice, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(")):
        plan_tools(tools, choice)


def test_bare_function_dicts_are_accepted():
    assert check_tools([{"name": "f"}]) == [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {}}}}]


def test_streamed_deltas_in_openais_shape():
    calls = [ToolCall("get_time", {"zone": "UTC"}, "call_a"), ToolCall("get_weather", {"city": "Rome"}, "call_b")]
    d = openai_tool_call_deltas(calls, first_index=1)
    assert d[0] == {"index": 1, "id": "call_a", "type": "function", "function": {"name": "get_time", "arguments": ""}}
    assert json.loads(d[1]["function"]["arguments"]) == {"zone": "UTC"} and d[1]["index"] == 1
    assert d[2]["index"] == 2 and d[2]["function"]["name"] == "get_weather"


# ------------------------------------------------------------------ rendering
def test_native_template_gets_the_tools_and_structured_history():
    tok = _tok(NATIVE_TEMPLATE)
    text = tok.apply_chat_template(chat_messages(HISTORY), tools=check_tools(TOOLS))
    assert json.dumps(check_tools([WEATHER])[0]) in text  # tojson: plain JSON, not HTML-escaped
    # Arguments given as a JSON string are rendered as an object once (not a string of JSON).
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in text
    assert "22 C and sunny (from get_weather)" in text  # the tool's name found from the call id
    assert "<tools>" not in text  # no fallback description when the template renders tools


def test_template_without_tools_gets_them_described_in_the_system_message():
    tok = _tok(CHATML)
    msgs = [{"role": "system", "content": "Be brief."}, *HISTORY]
    text = tok.apply_chat_template(chat_messages(msgs), tools=check_tools(TOOLS))
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nBe brief.\n\n")
    assert json.dumps(check_tools([TIME])[0]) in system and "<tool_call>" in system
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' \
        in text
    assert "<|im_start|>user\n<tool_response>\n22 C and sunny\n</tool_response>" in text
    assert "<|im_start|>tool" not in text


def test_smollm3_style_template_gets_xml_tools():
    tok = _tok("{% if xml_tools %}TOOLS={{ xml_tools | map(attribute='function.name') | join(',') }}\n{% endif %}"
               + CHATML)
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tools=check_tools(TOOLS)).startswith(
        "TOOLS=get_weather,get_time\n")


def test_real_default_template_renders_tools(real_bundle):
    tok = Tokenizer.from_folder(real_bundle)
    plain = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    with_tools = tok.apply_chat_template([{"role": "user", "content": "hi"}], tools=check_tools(TOOLS))
    assert "get_weather" not in plain and "get_weather" in with_tools
    assert with_tools.endswith(plain.split("<|im_end|>\n", 1)[1])  # the conversation after the system part


@pytest.mark.parametrize("messages,message", [
    ([{"role": "user", "content": "x", "tool_calls": []}], "only assistant messages carry tool_calls"),
    ([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{not json"}}]}],
     "arguments is not valid JSON"),
    ([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}],
     "arguments must be a JSON object"),
    ([{"role": "assistant", "tool_calls": "f()"}], "tool_calls must be a list"),
    ([{"role": "assistant", "tool_calls": [{"type": "function"}]}], r"tool_calls\[0\] must be"),
    ([{"role": "tool", "tool_call_id": 5, "content": "x"}], "tool_call_id must be a string"),
])
def test_bad_tool_messages_are_named(messages, message):
    with pytest.raises(ValueError, match=message):
        chat_messages(messages)


def test_assistant_tool_call_without_content_is_accepted():
    out = chat_messages(HISTORY)
    assert out[1]["content"] == "" and out[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}


def test_token_bytes_of_the_real_tokenizer_join_to_the_text(real_bundle):
    tok = Tokenizer.from_folder(real_bundle)
    text = " héllo wörld 日本 ok"
    ids = tok.encode(text, add_special_tokens=False)
    assert b"".join(tok.token_bytes(i) for i in ids).decode("utf-8") == text


def test_a_gguf_models_template_renders_tools_too(tmp_path):
    """GGUF files carry their chat template in the metadata; it gets the tools the same way."""
    import numpy as np
    from conftest import make_tiny_model
    from gguf_support import gpt2_tokenizer_meta, llama_cpp_tensors, write_gguf
    from mlx.utils import tree_flatten

    import edgespec

    model = make_tiny_model(0, vocab_size=272, max_position_embeddings=4096)
    config = model.args.to_dict()
    tensors = llama_cpp_tensors("llama", config, {k: np.array(v) for k, v in tree_flatten(model.parameters())})
    tok = {**gpt2_tokenizer_meta(272), "chat_template": NATIVE_TEMPLATE}
    path = write_gguf(tmp_path / "tools.gguf", "llama", config, tensors, tok)
    engine = edgespec.load(path, drafter="none", progress=False)
    assert engine.tokenizer.tool_variable == "tools" and engine.tokenizer.tool_format.name == "hermes"
    text = engine.tokenizer.apply_chat_template(chat_messages(HISTORY), tools=check_tools(TOOLS))
    assert json.dumps(check_tools([TIME])[0]) in text
    assert '"arguments": {"city": "Paris"}}</tool_call>' in text
    ids = engine.encode_prompt(messages=HISTORY, tools=TOOLS)
    assert len(ids) > len(engine.encode_prompt(messages=HISTORY))


def test_engine_stream_reads_calls_out_of_the_chunks():
    from edgespec.engine import _tool_chunks
    from edgespec.generate import Chunk

    text = 'On it. <tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>'
    pieces = [text[i:i + 6] for i in range(0, len(text), 6)]
    closed = []

    def chunks():
        try:
            for i, p in enumerate(pieces):
                yield Chunk(p, [i], "stop" if i == len(pieces) - 1 else None)
        finally:
            closed.append(True)

    out = list(_tool_chunks(chunks(), plan_tools(TOOLS, "auto")))
    assert "".join(c.text for c in out) == "On it. "
    assert [c.tokens for c in out] == [[i] for i in range(len(pieces))]  # every token still reported
    calls = [call for c in out for call in c.tool_calls or []]
    assert [(c.name, c.arguments) for c in calls] == [("get_time", {"zone": "UTC"})]
    assert out[-1].finish_reason == "tool_calls" and closed == [True]


@pytest.mark.real_model
def test_engine_chat_and_stream_with_tools_on_the_default_model(real_engine):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = real_engine.chat(ask, tools=TOOLS, tool_choice=named, max_tokens=60)
    assert r.finish_reason == "tool_calls" and r.text == ""
    (call,) = r.tool_calls
    assert call.name == "get_weather" and call.id.startswith("call_")
    pytest.importorskip("jsonschema").validate(call.arguments, WEATHER["function"]["parameters"])
    chunks = list(real_engine.stream(messages=ask, tools=TOOLS, tool_choice=named, max_tokens=60))
    streamed = [c for ch in chunks for c in ch.tool_calls or []]
    assert [(c.name, c.arguments) for c in streamed] == [(call.name, call.arguments)]
    assert chunks[-1].finish_reason == "tool_calls" and "".join(c.text for c in chunks) == ""
    with pytest.raises(ValueError, match="cannot be combined with response_format"):
        real_engine.chat(ask, tools=TOOLS, tool_choice="required", response_format={"type": "json_object"})
    # "none": no tools offered, the same reply as without them.
    assert real_engine.chat(ask, tools=TOOLS, tool_choice="none", max_tokens=12).text == \
        real_engine.chat(ask, max_tokens=12).text
