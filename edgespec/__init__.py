"""edgespec's public API: `load()` gives an Engine for on-device LLM inference with lossless
speculative and lookahead decoding.

    import edgespec
    engine = edgespec.load()                  # default model (SmolLM2-135M-Instruct)
    print(engine.generate("Hello", max_tokens=32).text)
    for chunk in engine.stream(messages=[{"role": "user", "content": "Hi"}]):
        print(chunk.text, end="", flush=True)

The names below are re-exported lazily: each is imported from its module on first use, so
`import edgespec.cli` (every `import edgespec.X` runs this file) does not load the engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from edgespec.lazy import lazy_exports

if TYPE_CHECKING:
    from edgespec.api import load
    from edgespec.engine import Engine, GenerationResult, make_options
    from edgespec.errors import (
        ContextLengthError,
        DrafterRequiredError,
        EdgespecError,
        ModelLoadError,
        UnknownOptionError,
        VocabularyMismatchError,
    )
    from edgespec.logits.processors import Penalties, TokenLogprob
    from edgespec.logits.sampling import SamplingParams
    from edgespec.options import GenerateOptions
    from edgespec.version import __version__  # noqa: F401  (edgespec.__version__)

# public name -> the module that defines it
_EXPORTS = {
    "load": "edgespec.api",
    "Engine": "edgespec.engine",
    "GenerationResult": "edgespec.engine",
    "make_options": "edgespec.engine",
    "GenerateOptions": "edgespec.options",
    "SamplingParams": "edgespec.logits.sampling",
    "Penalties": "edgespec.logits.processors",
    "TokenLogprob": "edgespec.logits.processors",
    "EdgespecError": "edgespec.errors",
    "ModelLoadError": "edgespec.errors",
    "VocabularyMismatchError": "edgespec.errors",
    "ContextLengthError": "edgespec.errors",
    "DrafterRequiredError": "edgespec.errors",
    "UnknownOptionError": "edgespec.errors",
    "__version__": "edgespec.version",
}

__all__ = [
    "load",
    "Engine",
    "GenerationResult",
    "GenerateOptions",
    "SamplingParams",
    "Penalties",
    "TokenLogprob",
    "make_options",
    "EdgespecError",
    "ModelLoadError",
    "VocabularyMismatchError",
    "ContextLengthError",
    "DrafterRequiredError",
    "UnknownOptionError",
]


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
