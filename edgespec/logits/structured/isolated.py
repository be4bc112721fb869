"""Grammars compiled in separate worker processes, with a time bound (see _worker.py).

llguidance is native code: on some inputs it overflows its stack (a segfault) or runs for
minutes. edgespec.logits.structured sends every new grammar here first; a small pool of
long-lived worker processes (started on first use, about 30 MB each, no MLX) compiles it
and checks it accepts text, for the model's tokenizer too. A worker that crashes or
runs past GrammarLimits.compile_timeout_s is ended and replaced, and the request gets a
ValueError (a 400) saying so; the serving process then compiles only what a worker
compiled without harm (the same library call, on a deep stack), so the crash never
reaches it. Results are cached by the callers (parsed formats, compiled matchers).
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import subprocess
import sys
import threading
from multiprocessing.connection import Connection
from pathlib import Path

from edgespec.logits.structured.bounds import LIMITS, GrammarLimitError
from edgespec.logits.structured.tokens import token_bytes

WORKERS = 2  # compiles at once (a long one does not hold up the next request's)
START_TIMEOUT_S = 60.0  # starting a worker, installing a tokenizer (0.1-0.7 s for 50k tokens)
_BOOT = "import runpy,sys; runpy.run_path(sys.argv[1])['main'](__import__('json').loads(sys.argv[2]))"


class GrammarCrashError(ValueError):
    """The grammar crashed or stalled the compiler's worker process (a 400: the grammar is refused)."""


class _Worker:
    def __init__(self, json_options: dict):
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _BOOT, str(Path(__file__).with_name("_worker.py")),
             json.dumps(json_options)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, close_fds=True)
        self.wr = Connection(os.dup(self.proc.stdin.fileno()), readable=False)
        self.rd = Connection(os.dup(self.proc.stdout.fileno()), writable=False)
        self.proc.stdin.close()
        self.proc.stdout.close()
        self.tokenizers: set[str] = set()

    def ask(self, request: tuple, timeout: float, what: str):
        try:
            self.wr.send(request)
            if not self.rd.poll(timeout):
                self.kill()
                raise GrammarCrashError(f"response_format: compiling the {what} took over {timeout:g} s, the "
                                        "limit (GrammarLimits.compile_timeout_s); it is refused")
            status, value = self.rd.recv()
        except (EOFError, OSError, BrokenPipeError):
            code = self.kill()
            how = f"signal {-code}" if code is not None and code < 0 else f"exit status {code}"
            raise GrammarCrashError(f"response_format: the {what} crashed the grammar compiler (its worker "
                                    f"process ended with {how}); it is refused") from None
        if status == "error":
            raise ValueError(value)
        return value

    def kill(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            code = self.proc.wait(5)
        except subprocess.TimeoutExpired:
            code = None
        for c in (self.wr, self.rd):
            try:
                c.close()
            except OSError:
                pass
        return code

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None


class IsolatedCompiler:
    """A pool of compiler workers: compile(kind, source) and check(tokenizer payload, text)."""

    def __init__(self, json_options: dict, workers: int = WORKERS):
        self.json_options = json_options
        self._idle: queue.Queue = queue.Queue()
        self._made = 0
        self._lock = threading.Lock()
        self.size = workers
        self.crashes = 0  # workers lost to a crash or a timeout (tests read it)
        self._busy: set[_Worker] = set()

    def busy_pids(self) -> list[int]:
        """The process ids of the workers compiling now."""
        return [w.proc.pid for w in list(self._busy)]

    def _take(self) -> _Worker:
        w = self._take_one()
        self._busy.add(w)
        return w

    def _take_one(self) -> _Worker:
        with self._lock:
            if self._idle.empty() and self._made < self.size:
                self._made += 1
                try:
                    return _Worker(self.json_options)
                except OSError:
                    self._made -= 1
                    raise
        w = self._idle.get()
        if not w.alive:
            w.kill()
            return _Worker(self.json_options)
        return w

    def _give(self, w: _Worker) -> None:
        self._busy.discard(w)
        if not w.alive:
            self.crashes += 1
            w = _Worker(self.json_options)
        self._idle.put(w)

    def compile(self, kind: str, source: str) -> str:
        """llguidance grammar text for a response format's source, checked to accept text."""
        what = {"json_schema": "JSON schema", "json_object": "JSON schema", "regex": "regex"}.get(kind, "grammar")
        w = self._take()
        try:
            return w.ask(("grammar", kind, source), LIMITS.compile_timeout_s, what)
        finally:
            self._give(w)

    def check(self, payload: dict, text: str) -> None:
        """Raise ValueError when `text` cannot start for this tokenizer (see _worker.first_step_error)."""
        w = self._take()
        try:
            if payload["key"] not in w.tokenizers:
                w.ask(("tokenizer", payload["key"], payload), START_TIMEOUT_S, "tokenizer")
                w.tokenizers.add(payload["key"])
            w.ask(("check", payload["key"], text), LIMITS.compile_timeout_s, "grammar")
        finally:
            self._give(w)

    def close(self) -> None:
        while not self._idle.empty():
            self._idle.get().kill()


def tokenizer_payload(tokenizer, n: int) -> dict:
    """What a worker needs to build llguidance's tokenizer for `tokenizer` (cached on it):
    the token bytes, special and EOS ids, and the backend's JSON (for encode)."""
    cache = tokenizer.__dict__.setdefault("_llg_payloads", {})
    hit = cache.get(n)
    if hit is not None:
        return hit
    tokens, special = token_bytes(tokenizer, n)
    eos = sorted(tokenizer.eos_token_ids)
    backend = tokenizer._tok.to_str()
    h = hashlib.sha256(backend.encode())
    for t in tokens:
        h.update(len(t).to_bytes(4, "little") + t)
    h.update(repr((special, eos, tokenizer.bos_token_id, n)).encode())
    p = {"key": h.hexdigest(), "tokens": tokens, "special": special, "eos": eos, "bos": tokenizer.bos_token_id,
         "n": n, "backend": backend}
    cache[n] = p
    return p


_STACK_BYTES = 256 << 20
_stack_lock = threading.Lock()


def on_deep_stack(fn, *args):
    """fn(*args) on a thread with a 256 MB stack (address space only), waited for: llguidance
    recurses over the grammar, and secondary threads get 512 KB on macOS."""
    out: dict = {}

    def run():
        try:
            out["value"] = fn(*args)
        except BaseException as e:  # handed to the caller
            out["error"] = e

    with _stack_lock:
        old = threading.stack_size(_STACK_BYTES)
        try:
            t = threading.Thread(target=run, name="edgespec-grammar", daemon=True)
            t.start()
        finally:
            threading.stack_size(old)
    t.join()
    if "error" in out:
        raise out["error"]
    return out.get("value")


__all__ = ["GrammarCrashError", "GrammarLimitError", "IsolatedCompiler", "on_deep_stack", "tokenizer_payload"]
