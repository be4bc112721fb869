"""Errors users can act on. The CLI prints their message; it never shows a traceback for them."""


class EdgespecError(Exception):
    """Base class of edgespec's user-facing errors."""


class ModelLoadError(EdgespecError, ValueError):
    """A checkpoint, bundle or GGUF file is missing, corrupt, truncated or unsupported."""


class VocabularyMismatchError(EdgespecError, ValueError):
    """A drafter's vocabulary differs from the verifier's."""


class ContextLengthError(EdgespecError, ValueError):
    """The prompt does not fit the context window."""


class DrafterRequiredError(EdgespecError, ValueError):
    """The chosen mode (or draft source) needs a drafter the engine does not have (none, or
    not of a kind that mode can use)."""


class UnknownOptionError(EdgespecError, TypeError, ValueError):
    """A keyword or mode option that does not exist (a typo such as `temprature=`).

    A TypeError like any unexpected keyword argument in Python, and a ValueError so the
    CLI and the server refuse it as the bad input it is.
    """


class CallbackError(EdgespecError, RuntimeError):
    """A callback the caller handed in (cancel, emit, ready) raised: that request ends with
    this error (its `__cause__` is the callback's exception); the engine and every other
    request go on."""


class EngineError(EdgespecError, RuntimeError):
    """The engine's batch worker failed outside any one request (a bug): the requests it held
    end with this error, and the next request starts a new worker."""
