"""The grammar compiler's own process: compiles grammars where a native crash ends it alone.

Run by edgespec.logits.structured.isolated as `python -c ...` with this file (stdlib,
llguidance and tokenizers only: no MLX, no edgespec import, so it starts in a tenth of
a second and stays small). It reads requests from fd 0 and answers on fd 1 as
multiprocessing.connection messages:

    ("grammar", kind, source)     -> ("ok", llguidance grammar text) | ("error", message)
    ("tokenizer", key, payload)   -> ("ok", None)   (payload: see tokenizer_payload)
    ("check", key, text)          -> ("ok", None) | ("error", message)

"grammar" compiles a response format without a model tokenizer and checks that it accepts
some text (a matcher over a 256-byte vocabulary: a grammar empty there is empty for every
tokenizer); "check" builds the matcher for a model's tokenizer and checks that its first
step allows a token. The same functions (build_ll_tokenizer, compile_source,
first_step_error) serve the server's process, so both compile alike.
"""

from __future__ import annotations

import sys
import threading

STACK_BYTES = 256 << 20  # llguidance recurses over grammar structure; a deep stack costs only address space


def limits():
    import llguidance  # worker: loaded on use

    # verbose_errors=False: errors never carry the grammar or the parser's state.
    return llguidance.LLParserLimits(verbose_errors=False)


def short(message: str, limit: int = 200) -> str:
    """The first line of a native error, cut: no backtrace, no grammar dump."""
    line = next((s.strip() for s in str(message).splitlines() if s.strip()), "unknown error")
    for cut in ("<non-verbose/>", "stack backtrace", "note: run with"):
        line = line.split(cut)[0].strip()
    return line if len(line) <= limit else line[: limit - 3] + "..."


def build_ll_tokenizer(tokens, special, eos: list[int], bos, n: int, encode):
    """llguidance's tokenizer: token bytes (special ones b'\\xff' + name), eos ids, encode(str)->ids."""
    import llguidance  # worker: loaded on use

    class _Vocab:  # what llguidance.TokenizerWrapper reads
        eos_token_id = eos[0]
        bos_token_id = bos
        special_token_ids = special

        def __call__(self, s):
            if isinstance(s, (bytes, bytearray)):
                s = bytes(s).decode("utf-8", errors="replace")
            return encode(s)

    vocab = _Vocab()
    vocab.tokens = tokens
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(vocab), n_vocab=n, eos_token=eos)


def byte_tokenizer():
    """256 one-byte tokens and an EOS: every text is producible, so an empty first step means
    the grammar accepts nothing."""
    tokens = [bytes([i]) for i in range(256)] + [b"\xff</s>"]
    return build_ll_tokenizer(tokens, [256], [256], None, 257, lambda s: list(s.encode("utf-8")))


def compile_source(kind: str, source: str, json_options: dict) -> str:
    """A response format's source (JSON schema text, regex, Lark or GBNF) -> llguidance grammar
    text; ValueError with a short message when it does not compile."""
    import llguidance  # worker: loaded on use

    M = llguidance.LLMatcher
    what = {"json_schema": "JSON schema", "json_object": "json_object", "regex": "regex",
            "grammar:lark": "lark grammar", "grammar:gbnf": "GBNF grammar"}[kind]
    try:
        if kind in ("json_schema", "json_object"):
            text = M.grammar_from_json_schema(source, defaults=dict(json_options))
        elif kind == "regex":
            text = M.grammar_from_regex(source)
        else:
            lark = source
            if kind == "grammar:gbnf":
                from llguidance.gbnf_to_lark import gbnf_to_lark  # worker: loaded on use

                lark = gbnf_to_lark(source)
            text = M.grammar_from_lark(lark)
        err = M.validate_grammar(text, limits=limits())
    except Exception as e:  # llguidance raises ValueError/RuntimeError (a panic too) with the problem
        raise ValueError(f"response_format: invalid {what}: {short(e)}") from None
    if err and not err.startswith("WARNING"):
        raise ValueError(f"response_format: invalid {what}: {short(err)}")
    return text


def first_step_error(ll_tokenizer, text: str, tokenized: bool) -> str | None:
    """Why a matcher over `text` cannot start (None: it can): a compile error, a grammar that
    accepts no text, or (`tokenized`: a model's vocabulary) none that this tokenizer can write."""
    import llguidance  # worker: loaded on use

    m = llguidance.LLMatcher(ll_tokenizer, text, log_level=0, limits=limits())
    if m.is_error():
        return f"the grammar does not compile for this tokenizer: {short(m.get_error())}"
    bits = m.compute_bitmask()
    if m.is_error() or (m.is_stopped() and not m.is_accepting()):
        return "the grammar accepts no text (no reply could ever match it)"
    allowed = int.from_bytes(bits, "little") & ((1 << ll_tokenizer.vocab_size) - 1)  # bit i: token i
    for e in ll_tokenizer.eos_tokens:
        allowed &= ~(1 << e)
    if not allowed and not m.is_accepting():
        return ("the grammar's text cannot be written with this model's tokens" if tokenized
                else "the grammar accepts no text (no reply could ever match it)")
    return None


def _serve(rfd: int, wfd: int, json_options: dict) -> None:
    from multiprocessing.connection import Connection  # worker: loaded on use

    rd, wr = Connection(rfd, writable=False), Connection(wfd, readable=False)
    toks: dict = {}
    byte_tok = None
    while True:
        try:
            req = rd.recv()
        except EOFError:
            return
        try:
            op = req[0]
            if op == "grammar":
                text = compile_source(req[1], req[2], json_options)
                if byte_tok is None:
                    byte_tok = byte_tokenizer()
                err = first_step_error(byte_tok, text, tokenized=False)
                wr.send(("error", f"response_format: {err}") if err else ("ok", text))
            elif op == "tokenizer":
                from tokenizers import Tokenizer  # worker: loaded on use

                p = req[2]
                backend = Tokenizer.from_str(p["backend"])
                toks[req[1]] = build_ll_tokenizer(p["tokens"], p["special"], p["eos"], p["bos"], p["n"],
                                                  lambda s, b=backend: b.encode(s, add_special_tokens=False).ids)
                wr.send(("ok", None))
            elif op == "check":
                err = first_step_error(toks[req[1]], req[2], tokenized=True)
                wr.send(("error", f"response_format: {err}") if err else ("ok", None))
            else:
                wr.send(("error", f"unknown request {op!r}"))
        except ValueError as e:
            wr.send(("error", str(e)))
        except Exception as e:  # the request fails, the process goes on
            wr.send(("error", f"response_format: the grammar compiler failed: {short(e)}"))


def main(json_options: dict) -> None:
    import os  # worker: loaded on use

    try:  # a compile competes for the CPU with the server's event loop: the loop goes first
        os.nice(10)
    except (OSError, AttributeError):
        pass

    # The protocol owns fds 0 and 1; anything the native code prints goes to stderr.
    rfd, wfd = os.dup(0), os.dup(1)
    os.dup2(2, 1)
    threading.stack_size(STACK_BYTES)
    t = threading.Thread(target=_serve, args=(rfd, wfd, json_options), daemon=True)
    t.start()
    t.join()
    sys.exit(0)
