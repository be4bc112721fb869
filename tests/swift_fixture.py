"""Fixture for the Swift package's tests (apps/swift, run by `make test`): the tiny random
bundle the server tests use, and the Python API's replies to the requests the Swift tests
make, as JSON.

    python tests/swift_fixture.py OUT_DIR     ->  OUT_DIR/tiny-test/ (bundle), OUT_DIR/reference.json
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
    }
    (out / "reference.json").write_text(json.dumps(reference, indent=1, ensure_ascii=False))
    print(f"swift fixture: {bundle} and {out / 'reference.json'}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(Path(sys.argv[1]))
