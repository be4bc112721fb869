"""`edgespec chat`: a streaming terminal chat that keeps the conversation."""

from __future__ import annotations

import sys

from edgespec.apps.common import (
    add_decoding_arguments,
    add_model_arguments,
    options_from_args,
    print_notes,
)

HELP = "chat with a model in the terminal (streams replies; /reset, /stats, /quit)"
DESCRIPTION = (
    "Chat in the terminal. Replies stream as they are generated and tokens/s is shown after "
    "each. Commands: /reset clears the conversation, /stats shows the last reply's decoding "
    "statistics, /quit leaves. Ctrl-C stops the current reply and keeps the session. "
    "Non-interactive: --prompt TEXT answers once; piped stdin is read one user turn per line."
)
COMMANDS = "/reset  clear the conversation\n/stats  statistics of the last reply\n/quit   leave"


def add_arguments(p) -> None:
    from edgespec.distributed.launch import add_distributed_arguments

    add_model_arguments(p)
    add_distributed_arguments(p)
    add_decoding_arguments(p)
    p.add_argument("--system", default=None, help="system prompt placed before the conversation")
    p.add_argument("--prompt", default=None, help="answer this one message and exit (non-interactive)")
    p.add_argument("--no-stats", action="store_true", help="do not print tokens/s after each reply")


class ChatSession:
    """The conversation and one reply at a time; no terminal I/O beyond `out`/`err`."""

    def __init__(self, engine, options, system: str | None, out=sys.stdout, err=sys.stderr):
        self.engine, self.options, self.system = engine, options, system
        self.out, self.err = out, err
        self.history: list[dict[str, str]] = []
        self.last_stats = None

    def messages(self) -> list[dict[str, str]]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + self.history

    def reset(self) -> None:
        self.history.clear()

    def reply(self, user_text: str, show_stats: bool = True) -> str:
        self.history.append({"role": "user", "content": user_text})
        pieces: list[str] = []
        interrupted = False
        try:
            stream = self.engine.stream(messages=self.messages(), options=self.options)
        except Exception:
            self.history.pop()
            raise
        try:
            for chunk in stream:
                if chunk.text:
                    pieces.append(chunk.text)
                    self.out.write(chunk.text)
                    self.out.flush()
        except KeyboardInterrupt:
            interrupted = True
        finally:
            stream.close()
        text = "".join(pieces)
        self.out.write("\n")
        self.out.flush()
        self.history.append({"role": "assistant", "content": text})
        self.last_stats = self.engine.last_stats
        if interrupted:
            self.err.write("[reply stopped]\n")
        if self.last_stats is not None:
            print_notes(self.engine, self.last_stats)
            if show_stats:
                self.err.write(f"[{self.last_stats.tokens_per_s:.1f} tok/s, {self.last_stats.generated_tokens} tokens]\n")
        self.err.flush()
        return text

    def handle(self, line: str, show_stats: bool = True) -> bool:
        """Process one input line; False means quit."""
        cmd = line.strip()
        if not cmd:
            return True
        if cmd in ("/quit", "/exit"):
            return False
        if cmd == "/reset":
            self.reset()
            self.err.write("[conversation cleared]\n")
        elif cmd == "/stats":
            s = self.last_stats
            self.err.write((s.summary() if s else "no reply yet") + "\n")
        elif cmd in ("/help", "/?"):
            self.err.write(COMMANDS + "\n")
        elif cmd.startswith("/") and " " not in cmd:
            self.err.write(f"unknown command {cmd}\n{COMMANDS}\n")
        else:
            try:
                self.reply(line.rstrip("\n"), show_stats)
            except ValueError as e:  # e.g. the conversation outgrew the context window
                self.err.write(f"error: {e}\n")
        return True


def run(args) -> int:
    from edgespec.apps.common import load_engine

    options = options_from_args(args)
    engine = None
    if args.distributed:  # start the ranks (mlx.launch), or join as one; rank 0 goes on below
        from edgespec.converters.default_model import default_bundle_path

        from edgespec.distributed.launch import join_or_launch

        code, engine = join_or_launch(args, default_bundle=default_bundle_path)
        if engine is None:
            return code
    engine = engine or load_engine(args)
    session = ChatSession(engine, options, args.system)
    show = not args.no_stats
    if args.prompt is not None:
        session.reply(args.prompt, show)
        return 0
    interactive = sys.stdin.isatty()
    if interactive:
        sys.stderr.write(f"edgespec chat ({engine.loaded.path}); /help for commands, Ctrl-D to leave\n")
    while True:
        try:
            line = input("> ") if interactive else sys.stdin.readline()
        except EOFError:
            break
        except KeyboardInterrupt:
            sys.stderr.write("\n")
            continue
        if not interactive and line == "":
            break
        if not session.handle(line, show):
            break
    return 0
