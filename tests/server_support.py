"""Helpers for the server tests: a tiny random model saved as a real bundle, and a real
`edgespec serve` process on a free loopback port."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
from conftest import make_tiny_model, make_tiny_tokenizer, tiny_args
from edgespec.converters.bundle import atomic_folder, finish_manifest, write_model_files
from mlx.utils import tree_flatten

# seed 2, scale 4: varied text, no early EOS for short prompts (see test_server.py).
TINY_SEED, TINY_SCALE = 2, 4.0


def tiny_bpe_tokenizer():
    """A byte-level BPE tokenizer of 400 tokens (longest: 32 dashes, 32 bytes): a tokenizer
    with a byte bound (Tokenizer.max_token_bytes), unlike the character one."""
    from tokenizers import ByteLevelBPETokenizer

    from edgespec.tokenizer import Tokenizer

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(["hello world " * 50, "café naïve ünïcödé " * 10, "-" * 32],
                            vocab_size=400, min_frequency=1, show_progress=False)
    return Tokenizer(bpe._tokenizer, {"eos_token": "</s>"})


def write_tiny_bundle(out: Path, tokenizer=None, **overrides) -> Path:
    """A random 2-layer Llama + character tokenizer as an edgespec bundle on disk.
    `tokenizer`: another edgespec Tokenizer; `overrides`: model config fields
    (e.g. max_position_embeddings, vocab_size to cover the tokenizer's)."""
    model = make_tiny_model(TINY_SEED, TINY_SCALE, **overrides)
    config = {k: v for k, v in vars(tiny_args(**overrides)).items() if isinstance(v, (int, float, str, bool))}
    with atomic_folder(out) as tmp:
        entry = write_model_files(tmp, config, dict(tree_flatten(model.parameters())), None)
        (tokenizer or make_tiny_tokenizer(model.args.vocab_size)).save(tmp)
        finish_manifest(tmp, {"source": {"format": "test", "name": "tiny"}, "model": entry})
    return out


class ServerProcess:
    """`python -m edgespec.cli serve ...` on port 0; the real port is read from its banner."""

    def __init__(self, model: Path, *args: str, timeout: float = 120.0):
        self.log = Path(os.environ.get("TMPDIR", "/tmp")) / f"edgespec-serve-{os.getpid()}-{id(self)}.log"
        self._log_f = open(self.log, "w")
        cmd = [sys.executable, "-m", "edgespec.cli", "serve", "--model", str(model), "--port", "0", *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self._log_f, text=True)
        self.port = self._read_port(timeout)
        self.url = f"http://127.0.0.1:{self.port}"
        self._wait_healthy(timeout)

    def _read_port(self, timeout: float) -> int:
        found: list[str] = []

        def reader():
            for line in self.proc.stdout:
                found.append(line)
                if " on http://" in line:
                    return

        t = threading.Thread(target=reader, daemon=True)
        t.start()
        t.join(timeout)
        m = re.search(r":(\d+)/v1", "".join(found))
        if not m:
            self.stop()
            raise RuntimeError(f"server did not start: {''.join(found)}\n{self.log.read_text()}")
        return int(m.group(1))

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"server never became healthy:\n{self.log.read_text()}")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        if self.proc.stdout:
            self.proc.stdout.close()
        self._log_f.close()
