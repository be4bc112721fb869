"""Every HTTP example in the docs (```http blocks: a request, then the response's status
and body) is sent to a real `edgespec serve` and must get the status and the error the
docs show: `type`, `param` and `code` as written, the message as written but for its
figures (token counts and vocabulary sizes depend on the model). As
tests/test_docs_commands.py does for the commands."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
from server_support import ServerProcess, tiny_bpe_tokenizer, write_tiny_bundle

REPO = Path(__file__).resolve().parents[1]
DOCS = sorted((REPO / "docs").glob("*.md")) + [REPO / "README.md"]
KEY = "KEY"
MODEL_ID = "SmolLM2-135M-Instruct-f32"  # the id the docs' examples show
CONTEXT = 8192  # the default model's context window, as the docs say
PLACEHOLDER = re.compile(r'"<(\d+) characters>"')
WITHOUT_EXAMPLE = {(503, "queue_full"), (500, "generation_failed"),  # need a full queue, a bug
                   (400, "grammar_error")}  # needs a grammar library that gives up mid-reply


def http_examples() -> list:
    out = []
    for path in DOCS:
        block, start = None, 0
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            if block is None and line.strip() == "```http":
                block, start = [], n
            elif block is not None and line.startswith("```"):
                out.append(pytest.param(_parse(block, f"{path.name}:{start}"), id=f"{path.name}:{start}"))
                block = None
            elif block is not None:
                block.append(line)
    return out


def _parse(lines: list[str], where: str) -> dict:
    method, target = lines[0].split()
    i, headers = 1, {}
    while i < len(lines) and re.match(r"^[A-Za-z-]+: ", lines[i]):
        name, value = lines[i].split(": ", 1)
        headers[name] = value
        i += 1
    body = []
    while i < len(lines) and lines[i].strip():
        body.append(lines[i])
        i += 1
    while i < len(lines) and not lines[i].strip():
        i += 1
    m = re.match(r"^HTTP/1\.1 (\d{3})$", lines[i]) if i < len(lines) else None
    assert m, f"{where}: no 'HTTP/1.1 STATUS' line after the request"
    response = json.loads("\n".join(lines[i + 1:]))
    return {"method": method, "path": target, "headers": headers, "body": "\n".join(body) or None,
            "status": int(m.group(1)), "response": response, "where": where}


def _text(n: int) -> str:
    return ("Once upon a time, " * (n // 18 + 1))[:n]


def _message_pattern(message: str) -> re.Pattern:
    """The documented message, with any run of digits standing for any number."""
    return re.compile("".join(r"\d+" if part.isdigit() else re.escape(part)
                              for part in re.split(r"(\d+)", message)))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tok = tiny_bpe_tokenizer()  # has a byte bound, as the default model's tokenizer
    bundle = write_tiny_bundle(tmp_path_factory.mktemp("docs") / "tiny-docs", tok, vocab_size=tok.vocab_size,
                               max_position_embeddings=CONTEXT)
    s = ServerProcess(bundle, "--api-key", KEY, "--model-id", MODEL_ID, "--drafter", "none")
    yield s
    s.stop()


EXAMPLES = http_examples()


@pytest.mark.parametrize("example", EXAMPLES)
def test_documented_http_example(server, example):
    headers = {"Authorization": f"Bearer {KEY}", **example["headers"]}
    body = example["body"]
    if body is not None:
        headers.setdefault("Content-Type", "application/json")
        body = PLACEHOLDER.sub(lambda m: json.dumps(_text(int(m.group(1)))), body).encode()
    r = httpx.request(example["method"], server.url + example["path"], content=body, headers=headers, timeout=120)
    want = example["response"]
    assert r.status_code == example["status"], r.text[:500]
    got = r.json()
    if "error" not in want:
        assert got == want
        return
    err, doc = got["error"], want["error"]
    assert {k: err[k] for k in ("type", "param", "code")} == {k: doc[k] for k in ("type", "param", "code")}, err
    assert _message_pattern(doc["message"]).fullmatch(err["message"]), (
        f"{example['where']}: the docs say\n  {doc['message']}\nthe server says\n  {err['message']}")


def test_the_docs_show_an_example_of_every_error():
    codes = {(e.values[0]["status"], e.values[0]["response"]["error"]["code"]) for e in EXAMPLES}
    table = set()
    for line in (REPO / "docs" / "server.md").read_text(encoding="utf-8").splitlines():
        m = re.match(r"^\| (\d{3}) \| (?:`(\w+)`|null) \|", line)
        if m:
            table.add((int(m.group(1)), m.group(2)))
    assert len(table) >= 12
    assert table - WITHOUT_EXAMPLE <= codes, sorted(table - WITHOUT_EXAMPLE - codes)
    assert len(EXAMPLES) >= 15
