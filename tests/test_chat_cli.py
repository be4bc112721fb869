"""`edgespec chat` and `edgespec generate`, driven the way scripts drive them."""

import io
import subprocess
import sys

import pytest
from conftest import make_tiny_engine, write_tiny_bundle
from edgespec.apps.chat import ChatSession

from edgespec.engine import make_options

SEED = 3


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    # Seed 3: a tiny random model whose replies to these prompts do not start with EOS.
    return write_tiny_bundle(tmp_path_factory.mktemp("chat") / "tiny", seed=SEED)


def run_cli(args, stdin=None):
    return subprocess.run(
        [sys.executable, "-m", "edgespec.cli", *args], input=stdin, capture_output=True, text=True, timeout=300
    )


def test_prompt_mode_prints_the_greedy_reply(bundle):
    engine = make_tiny_engine(SEED)
    want = engine.generate(messages=[{"role": "user", "content": "abc"}], max_tokens=12).text
    r = run_cli(["chat", "--model", str(bundle), "--prompt", "abc", "--max-tokens", "12"])
    assert r.returncode == 0, r.stderr
    assert r.stdout == want + "\n"
    assert "tok/s" in r.stderr


def test_piped_stdin_keeps_the_conversation_and_commands(bundle):
    r = run_cli(["chat", "--model", str(bundle), "--max-tokens", "5"], stdin="abc\n/stats\n/reset\nxyz\n/quit\nnever\n")
    assert r.returncode == 0, r.stderr
    assert len(r.stdout.strip().splitlines()) == 2  # two replies; nothing after /quit
    assert "mode adaptive" in r.stderr and "conversation cleared" in r.stderr  # auto = adaptive


def test_generate_reports_bad_sampling_settings(bundle):
    r = run_cli(["generate", "--model", str(bundle), "--prompt", "a", "--top-p", "0"])
    assert r.returncode == 1 and "top_p must be in (0, 1]" in r.stderr and "Traceback" not in r.stderr


def test_help_explains_every_option():
    r = run_cli(["chat", "--help"])
    assert r.returncode == 0
    for opt in ("--model", "--drafter", "--mode", "--draft-tokens", "--temperature", "--top-p", "--system", "--prompt"):
        assert opt in r.stdout


class InterruptingEngine:
    """Wraps a real engine; the stream raises KeyboardInterrupt after `after` chunks (Ctrl-C)."""

    def __init__(self, engine, after):
        self.engine, self.after = engine, after
        self.closed = False

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def stream(self, **kw):
        inner = self.engine.stream(**kw)
        outer = self

        class S:
            def __iter__(self):
                for i, chunk in enumerate(inner):
                    if i == outer.after:
                        raise KeyboardInterrupt
                    yield chunk

            def close(self):
                outer.closed = True
                inner.close()

        return S()


def test_ctrl_c_stops_the_reply_but_keeps_the_session():
    engine = InterruptingEngine(make_tiny_engine(SEED), after=3)
    out, err = io.StringIO(), io.StringIO()
    session = ChatSession(engine, make_options(max_tokens=50), None, out=out, err=err)
    text = session.reply("abc")
    assert engine.closed and "reply stopped" in err.getvalue()
    assert len(text) >= 3 and session.history[-1] == {"role": "assistant", "content": text}
    engine.after = 10**9
    assert session.handle("again")  # the session goes on
    assert len(session.history) == 4


def test_prompt_past_the_context_window_is_refused_and_session_survives():
    engine = make_tiny_engine()
    out, err = io.StringIO(), io.StringIO()
    session = ChatSession(engine, make_options(max_tokens=5), None, out=out, err=err)
    assert session.handle("a" * 600)
    assert "context window" in err.getvalue() and session.history == []


def test_invalid_utf8_in_a_chat_line_or_prompt_is_replaced_not_fatal(bundle):
    """Bad bytes become U+FFFD (as a UTF-8 decoder makes them); the session goes on."""
    r = subprocess.run(
        [sys.executable, "-m", "edgespec.cli", "chat", "--model", str(bundle), "--max-tokens", "4"],
        input=b"ab\xff\xfec\nxyz\n", capture_output=True, timeout=300,
    )
    assert r.returncode == 0, r.stderr.decode()
    assert len(r.stdout.decode().strip().splitlines()) == 2 and b"Traceback" not in r.stderr
    r = subprocess.run(
        [sys.executable, "-m", "edgespec.cli", "generate", "--model", str(bundle), "--max-tokens", "4",
         "--prompt", b"ab\xffc"], capture_output=True, timeout=300,
    )
    assert r.returncode == 0 and b"Traceback" not in r.stderr, r.stderr.decode()


def test_bad_memory_budget_fails_before_the_model_loads(tmp_path):
    r = run_cli(["generate", "--model", str(tmp_path / "missing"), "--prompt", "a", "--memory-budget", "lots"])
    assert r.returncode == 1 and "memory budget 'lots'" in r.stderr and "missing" not in r.stderr, r.stderr
