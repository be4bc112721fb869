"""Fixture for the Swift package's tests (apps/swift, run by `make test`): the tiny random
bundle the server tests use, and the Python API's replies to the requests the Swift tests
make, as JSON.

    python tests/swift_fixture.py OUT_DIR     ->  OUT_DIR/tiny-test/ (bundle), OUT_DIR/tiny-json/
                                                  (bundle), OUT_DIR/reference.json

tiny-json: a tiny random model whose character tokenizer has JSON's punctuation and whose
chat template renders tools, for the structured-output and tool-call tests.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
CHAT_MAX_TOKENS = 30
COMPLETION_PROMPT, COMPLETION_MAX_TOKENS = "hello world", 20
SEEDED = dict(max_tokens=24, temperature=0.9, top_p=0.95, seed=1234)
STOP_MAX_TOKENS = 40
# Structured output on tiny-json: a schema whose every value is bounded (a random model
# then always finishes the object), the same schema as a tool's parameters.
FORECAST = {"type": "object", "properties": {
    "city": {"enum": ["Paris", "Rome", "Oslo"]}, "days": {"type": "integer", "minimum": 1, "maximum": 9},
    "sunny": {"type": "boolean"}}, "required": ["city", "days", "sunny"], "additionalProperties": False}
TOOL = {"type": "function", "function": {"name": "get_forecast", "description": "the weather to come",
                                          "parameters": FORECAST}}
JSON_MAX_TOKENS = 120
# Renders tools natively (as the templates of tool-calling models do), briefly: the tiny
# model's context is 512 characters.
JSON_TEMPLATE = (
    "{% if tools %}tools: {{ tools | map(attribute='function.name') | join(' ') }}\n{% endif %}"
    "{% for m in messages %}{{ m.role }}: {{ m.content }}{% for c in m.tool_calls or [] %}<tool_call>"
    "{{ c.function.name }} {{ c.function.arguments | tojson }}</tool_call>{% endfor %}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}")


def json_tokenizer():
    """One token per character, JSON's punctuation included; id 0 = EOS."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, pre_tokenizers
    from tokenizers import models as tk_models

    from edgespec.tokenizer import Tokenizer

    chars = [chr(c) for c in range(97, 123)] + [chr(c) for c in range(65, 91)] + list('0123456789 .,:"{}[]-_')
    vocab = {"</s>": 0} | {ch: i + 1 for i, ch in enumerate(chars)}
    backend = HFTokenizer(tk_models.WordLevel(vocab=vocab, unk_token="</s>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    backend.decoder = decoders.Fuse()
    return Tokenizer(backend, {"eos_token": "</s>", "chat_template": JSON_TEMPLATE})


def structured_reference(out: Path) -> dict:
    from server_support import write_tiny_bundle

    import edgespec

    bundle = out / "tiny-json"
    if bundle.exists():
        shutil.rmtree(bundle)
    tok = json_tokenizer()
    write_tiny_bundle(bundle, tokenizer=tok, vocab_size=tok.vocab_size)
    engine = edgespec.load(bundle, drafter="none", progress=False)
    fmt = {"type": "json_schema", "json_schema": {"name": "Forecast", "schema": FORECAST, "strict": True}}
    schema_reply = engine.chat(MESSAGES, response_format=fmt, max_tokens=JSON_MAX_TOKENS)
    named = {"type": "function", "function": {"name": "get_forecast"}}
    call = engine.chat(MESSAGES, tools=[TOOL], tool_choice=named, max_tokens=JSON_MAX_TOKENS).tool_calls[0]
    history = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call.to_openai()]},
               {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    answer = engine.chat(history, tools=[TOOL], max_tokens=CHAT_MAX_TOKENS)
    return {"bundle": str(bundle.resolve()), "schema": FORECAST, "tool": TOOL, "max_tokens": JSON_MAX_TOKENS,
            "schema_text": schema_reply.text, "call_name": call.name, "call_arguments": call.arguments_json,
            "call_id": call.id, "answer_max_tokens": CHAT_MAX_TOKENS, "answer_text": answer.text,
            "answer_prompt_tokens": answer.prompt_tokens}


def main(out: Path) -> None:
    from server_support import write_tiny_bundle

    import edgespec

    out.mkdir(parents=True, exist_ok=True)
    bundle = out / "tiny-test"
    if bundle.exists():
        shutil.rmtree(bundle)
    write_tiny_bundle(bundle)
    engine = edgespec.load(bundle, drafter="none", progress=False)

    chat = engine.chat(MESSAGES, max_tokens=CHAT_MAX_TOKENS)
    completion = engine.generate(COMPLETION_PROMPT, max_tokens=COMPLETION_MAX_TOKENS)
    seeded = engine.chat(MESSAGES, **SEEDED)
    full = engine.chat(MESSAGES, max_tokens=STOP_MAX_TOKENS).text
    stop = full[12:14]
    reference = {
        "bundle": str(bundle.resolve()),
        "model_id": bundle.name,
        "messages": MESSAGES,
        "chat": {"max_tokens": CHAT_MAX_TOKENS, "text": chat.text, "finish_reason": chat.finish_reason,
                 "prompt_tokens": len(engine.encode_prompt(messages=MESSAGES)), "completion_tokens": len(chat.tokens)},
        "completion": {"prompt": COMPLETION_PROMPT, "max_tokens": COMPLETION_MAX_TOKENS, "text": completion.text,
                       "prompt_tokens": len(engine.encode_prompt(COMPLETION_PROMPT)),
                       "prompt_ids": list(engine.tokenizer.encode(COMPLETION_PROMPT))},
        "seeded": {**SEEDED, "text": seeded.text},
        "stop": {"max_tokens": STOP_MAX_TOKENS, "stop": stop, "text": full[: full.index(stop)]},
        "structured": structured_reference(out),
    }
    (out / "reference.json").write_text(json.dumps(reference, indent=1, ensure_ascii=False))
    print(f"swift fixture: {bundle} and {out / 'reference.json'}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(Path(sys.argv[1]))
