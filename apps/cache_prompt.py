"""`edgespec cache-prompt`: prefill a long system prompt or document once, save its cache."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from edgespec.apps.common import add_cache_arguments, add_model_arguments

HELP = "prefill a long system prompt or document once and save its cache (for --prompt-cache)"
DESCRIPTION = (
    "Run a long system prompt or document through the model once and save its cache to a file. "
    "Later runs given that file (--prompt-cache FILE, for chat, generate and serve) skip prefilling "
    "it for every request that starts the same way. The file names the model and tokenizer it "
    "belongs to and is refused by any other."
)


def add_arguments(p) -> None:
    add_model_arguments(p)
    add_cache_arguments(p, prompt_cache_files=False)  # --kv-bits must match the runs that load it
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--system-file", default=None, metavar="FILE",
                     help="a system prompt, rendered by the model's chat template as a conversation's start "
                          "(reused by chats and requests with this system prompt)")
    src.add_argument("--prompt-file", default=None, metavar="FILE",
                     help="raw text, tokenized as is (reused by --raw prompts and completions that start with it)")
    p.add_argument("--out", required=True, metavar="FILE",
                   help="where to write the cache (atomically; an existing file is replaced only if edgespec saved it)")


def prompt_tokens(engine, system: str | None = None, text: str | None = None) -> list[int]:
    """The tokens a cached system prompt or document stands for."""
    tok = engine.tokenizer
    if system is not None:
        rendered = tok.apply_chat_template([{"role": "system", "content": system}], add_generation_prompt=False)
        ids = tok.encode(rendered, add_special_tokens=False, context_length=engine.context_length)
        if tok.add_bos_token and tok.bos_token_id is not None and (not ids or ids[0] != tok.bos_token_id) \
                and not (tok.bos_token and rendered.startswith(tok.bos_token)):
            ids = [tok.bos_token_id] + ids
        return ids
    return engine.encode_prompt(text)


def run(args) -> int:
    from edgespec.apps.common import load_engine  # deferred: CLI start-up

    from edgespec.caches import sessions  # deferred: CLI start-up

    sessions.check_destination(args.out)  # refused before the model loads
    src = Path(args.system_file or args.prompt_file)
    try:
        text = src.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read {src}: {e}") from None
    if not text.strip():
        raise ValueError(f"{src} is empty")
    engine = load_engine(args)
    if not engine.prefix_cache.enabled:
        raise ValueError("--prompt-cache-bytes 0 turns the cache off: nothing could be saved")
    ids = prompt_tokens(engine, system=text if args.system_file else None, text=None if args.system_file else text)
    print(f"[edgespec] prefilling {len(ids)} tokens of {src} ...", file=sys.stderr)
    t0 = time.perf_counter()
    engine.generate(ids, max_tokens=1, mode="plain")  # its prefill stores the prompt's blocks
    secs = time.perf_counter() - t0
    extra = {"kind": "prompt", "system": text} if args.system_file else {"kind": "prompt", "text": text}
    n = sessions.save(engine, args.out, ids, extra)
    print(f"[edgespec] saved {n} of {len(ids)} tokens' cache to {args.out} (prefill took {secs:.1f} s; "
          f"the last {len(ids) - n} tokens, under one {engine.prefix_cache.block}-token block, run per request)",
          file=sys.stderr)
    return 0
