"""`edgespec chat`: a streaming terminal chat that keeps the conversation."""

from __future__ import annotations

import os
import sys

from edgespec.apps.common import (
    add_cache_arguments,
    add_decoding_arguments,
    add_model_arguments,
    load_prompt_caches,
    options_from_args,
    print_notes,
)

HELP = "chat with a model in the terminal (streams replies; /reset, /save, /load, /stats, /quit)"
DESCRIPTION = (
    "Chat in the terminal. Replies stream as they are generated and tokens/s is shown after "
    "each. The conversation's cache is kept between turns: a new turn runs only its new "
    "message (the stats line shows how many tokens were reused). Commands: /reset clears "
    "the conversation and frees its cache, /save FILE and /load FILE keep the conversation "
    "and its cache on disk, /stats shows the last reply's decoding statistics, /quit leaves. "
    "A conversation that outgrows the context window loses its oldest turns (the system "
    "prompt stays), with a note. Ctrl-C stops the current reply and keeps the session. "
    "Non-interactive: --prompt TEXT answers once; piped stdin is read one user turn per line."
)
COMMANDS = (
    "/reset       clear the conversation and free its cache\n"
    "/save FILE   save the conversation and its cache (atomic; only over a file edgespec saved)\n"
    "/load FILE   load a saved conversation and its cache (same model and tokenizer only)\n"
    "/stats       statistics of the last reply\n"
    "/quit        leave"
)


def add_arguments(p) -> None:
    from edgespec.distributed.launch import add_distributed_arguments  # deferred: CLI start-up

    add_model_arguments(p)
    add_distributed_arguments(p)
    add_decoding_arguments(p)
    p.add_argument("--system", default=None, help="system prompt placed before the conversation")
    p.add_argument("--prompt", default=None, help="answer this one message and exit (non-interactive)")
    p.add_argument("--no-stats", action="store_true", help="do not print tokens/s after each reply")
    p.add_argument("--session", default=None, metavar="FILE",
                   help="load the conversation and its cache from FILE at start (when it exists) and save "
                        "them there at exit (as /load and /save)")
    add_cache_arguments(p)


class ChatSession:
    """The conversation and one reply at a time; no terminal I/O beyond `out`/`err`."""

    def __init__(self, engine, options, system: str | None, out=sys.stdout, err=sys.stderr):
        self.engine, self.options, self.system = engine, options, system
        self.out, self.err = out, err
        self.history: list[dict[str, str]] = []
        self.last_stats = None
        self.tokens: list[int] = []  # the last turn's prompt and reply: what its cache holds

    def messages(self) -> list[dict[str, str]]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + self.history

    def reset(self) -> None:
        self.history.clear()
        self.tokens = []
        self.engine.prefix_cache.clear(keep_pinned=True)

    def _prompt(self) -> list[int]:
        """The conversation's tokens; when it outgrows the context window (with room for a
        reply), its oldest whole turns go first (the system prompt and the new message stay)."""
        ids, dropped = self.engine.fit_messages(self.messages(), self.options.max_tokens)
        if dropped:
            starts = [i for i, m in enumerate(self.history) if m["role"] == "user"]
            del self.history[: starts[dropped]]
            self.err.write(f"[the conversation outgrew the context window ({self.engine.context_length} tokens): "
                           f"dropped its {dropped} oldest turn{'s' if dropped > 1 else ''}]\n")
        return ids

    def reply(self, user_text: str, show_stats: bool = True) -> str:
        self.history.append({"role": "user", "content": user_text})
        pieces: list[str] = []
        tokens: list[int] = []
        interrupted = False
        try:
            ids = self._prompt()
            stream = self.engine.stream(prompt=ids, options=self.options)
        except Exception:
            self.history.pop()
            raise
        try:
            for chunk in stream:
                tokens.extend(chunk.tokens)
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
        self.tokens = ids + tokens
        self.last_stats = self.engine.last_stats
        if interrupted:
            self.err.write("[reply stopped]\n")
        if self.last_stats is not None:
            print_notes(self.engine, self.last_stats)
            if show_stats:
                s = self.last_stats
                cached = f", {s.cached_tokens} of {s.prompt_tokens} prompt tokens reused" if s.cached_tokens else ""
                self.err.write(f"[{s.tokens_per_s:.1f} tok/s, {s.generated_tokens} tokens{cached}]\n")
        self.err.flush()
        return text

    def save(self, path: str) -> None:
        from edgespec.caches import sessions  # deferred: CLI start-up

        n = sessions.save(self.engine, path, self.tokens,
                          {"kind": "chat", "system": self.system, "messages": self.history})
        self.err.write(f"[saved {len(self.history)} messages and {n} cached tokens to {path}]\n")

    def save_at_exit(self, path: str) -> None:
        """save(), or when `path` cannot be written any more, a new file beside it or under
        $EDGESPEC_HOME/sessions, said where: the turns are never lost."""
        from edgespec.caches import sessions  # deferred: CLI start-up

        extra = {"kind": "chat", "system": self.system, "messages": self.history}
        try:
            where, n = sessions.save_somewhere(self.engine, path, self.tokens, extra)
        except (OSError, ValueError) as e:
            self.err.write(f"error: the conversation could not be saved anywhere ({e})\n")
            raise
        if where != sessions.check_destination_path(path):
            self.err.write(f"[could not save to {path}; saved {len(self.history)} messages and {n} cached tokens "
                           f"to {where} instead]\n")
        else:
            self.err.write(f"[saved {len(self.history)} messages and {n} cached tokens to {path}]\n")

    def load(self, path: str) -> None:
        from edgespec.caches import sessions  # deferred: CLI start-up
        from edgespec.tokenizer import chat_messages  # deferred: CLI start-up

        tokens, extra, n = sessions.load(self.engine, path)
        if extra.get("kind") != "chat":
            raise sessions.SessionFileError(f"{path} is a saved prompt cache, not a chat session "
                                            "(use it with --prompt-cache)")
        messages = chat_messages(extra["messages"]) if extra.get("messages") else []
        self.history, self.system, self.tokens = messages, extra.get("system"), tokens
        self.err.write(f"[loaded {len(messages)} messages and {n} cached tokens from {path}]\n")

    def handle(self, line: str, show_stats: bool = True) -> bool:
        """Process one input line; False means quit."""
        cmd = line.strip()
        if not cmd:
            return True
        if cmd in ("/quit", "/exit"):
            return False
        word, _, arg = cmd.partition(" ")
        arg = arg.strip()
        if cmd == "/reset":
            self.reset()
            self.err.write("[conversation cleared]\n")
        elif word in ("/save", "/load"):
            if not arg:
                self.err.write(f"usage: {word} FILE\n")
                return True
            try:
                (self.save if word == "/save" else self.load)(arg)
            except (ValueError, OSError) as e:  # refused or failed: the conversation is as it was
                self.err.write(f"error: {e}\n")
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
    from edgespec.apps.common import load_engine  # deferred: CLI start-up

    options = options_from_args(args)
    if args.session:
        from edgespec.caches import sessions  # deferred: CLI start-up

        # Checked before the model loads, so the turns of the chat can be saved at its end
        # (a folder that cannot be written, a foreign file: refused now, not at exit).
        sessions.check_destination(args.session)
    engine = None
    if args.distributed:  # start the ranks (mlx.launch), or join as one; rank 0 goes on below
        from edgespec.converters.default_model import default_bundle_path  # deferred: CLI start-up

        from edgespec.distributed.launch import join_or_launch  # deferred: CLI start-up

        code, engine = join_or_launch(args, default_bundle=default_bundle_path)
        if engine is None:
            return code
    engine = engine or load_engine(args)
    system = load_prompt_caches(engine, args)
    session = ChatSession(engine, options, args.system if args.system is not None else system)
    if args.session and os.path.exists(args.session):
        session.load(args.session)
    try:
        return _loop(session, args, engine)
    finally:
        if args.session and session.history:
            session.save_at_exit(args.session)


def _loop(session, args, engine) -> int:
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
