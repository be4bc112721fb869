"""A generation request as the batch takes it: its tokens, options and callbacks (`emit`, `cancel`,
`ready`), checked at the API boundary; `Cancelled` is what a request whose client left gets."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from greenlet import GreenletExit

from edgespec.errors import CallbackError
from edgespec.generate import GenerationStats

log = logging.getLogger("edgespec.batch")  # the batch's one logger


def cancel_callable(cancel) -> Callable[[], bool] | None:
    """A request's `cancel` as a callable: None, a callable returning a bool, or an Event-like
    object (anything with `is_set()`, such as threading.Event). Anything else is refused here,
    at the API boundary, with a ValueError."""
    if cancel is None or callable(cancel):
        return cancel
    is_set = getattr(cancel, "is_set", None)
    if callable(is_set):
        return is_set
    raise ValueError(
        f"cancel must be a callable returning True to stop, or an Event-like object with is_set() "
        f"(e.g. threading.Event), got {type(cancel).__name__}: {cancel!r:.60}"
    )


class Cancelled(Exception):
    """Thrown into a sequence whose client is gone: it stops at its pending model call."""


@dataclass
class Request:
    """One generation. `emit(kind, payload)` gets ("start", None), ("chunk", Chunk),
    then ("done", stats) or ("error", exception), from the worker thread."""

    ids: list[int]
    options: Any  # GenerateOptions
    mode_name: str
    emit: Callable[[str, Any], None]
    stats: GenerationStats = field(default_factory=GenerationStats)
    cancel_check: Callable[[], bool] | None = None
    # Flow control for a reader that pulls (Engine.stream): False while it has not taken the
    # last chunk yet. After each chunk the sequence waits for it (the others go on), so
    # nothing is generated past the point where the reader would cancel. None = never wait.
    ready: Callable[[], bool] | None = None
    need_bytes: int = 0  # its caches' bytes, were they all its own (memory.reserve_bytes)
    own_bytes: int = 0  # what it holds outside the batch's KV arena
    arena_positions: int = 0  # positions of an arena row it needs; 0: it keeps caches of its own
    submitted_at: float = field(default_factory=time.perf_counter)
    started_at: float | None = None
    _cancelled: threading.Event = field(default_factory=threading.Event)

    # The error this request ends with when one of its caller's callbacks raised (CallbackError).
    error: BaseException | None = None
    _ended: bool = False  # its "done" or "error" was sent

    def __post_init__(self):
        self.cancel_check = cancel_callable(self.cancel_check)

    def cancel(self) -> None:
        self._cancelled.set()

    def fail(self, error: BaseException) -> None:
        """End this request with `error` (the first one wins): it is cancelled at its next
        step, and its caller gets the error instead of "done"."""
        if self.error is None:
            self.error = error
        self._cancelled.set()

    def _callback_failed(self, name: str, e: BaseException) -> None:
        err = CallbackError(f"the request's {name} callback raised {type(e).__name__}: {e}")
        err.__cause__ = e
        log.warning("%s; that request ends, the others go on", err)
        self.fail(err)

    def _ask(self, name: str, callback: Callable[[], bool]) -> bool:
        """The caller's yes/no callback; one that raises fails this request (never the worker)
        and counts as True (stop / go on: either way the request ends next)."""
        try:
            return bool(callback())
        except GreenletExit:
            raise
        except BaseException as e:
            self._callback_failed(name, e)
            return True

    @property
    def cancelled(self) -> bool:
        if self._cancelled.is_set():
            return True
        return self.cancel_check is not None and self._ask("cancel", self.cancel_check)

    def is_ready(self) -> bool:
        """Whether its reader took the last chunk (always, for a reader that does not pull)."""
        return self.ready is None or self._ask("ready", self.ready)

    def send(self, kind: str, payload: Any) -> None:
        """Hand one event to the caller's `emit`. The end ("done" or "error") is sent once, and
        as "error" when a callback failed; an `emit` that raises fails this request alone."""
        if self._ended:
            return
        if kind in ("done", "error"):
            self._ended = True
            if kind == "done" and self.error is not None:
                kind, payload = "error", self.error
        try:
            self.emit(kind, payload)
        except GreenletExit:
            raise
        except BaseException as e:
            if self._ended:  # nobody left to tell
                log.warning("the request's emit callback raised %s on its %r event: %s",
                            type(e).__name__, kind, e)
            else:
                self._callback_failed("emit", e)
