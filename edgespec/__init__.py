"""edgespec's public API: `load()` gives an Engine for on-device LLM inference with lossless
speculative and lookahead decoding.

    import edgespec
    engine = edgespec.load()                  # default model (SmolLM2-135M-Instruct)
    print(engine.generate("Hello", max_tokens=32).text)
    for chunk in engine.stream(messages=[{"role": "user", "content": "Hi"}]):
        print(chunk.text, end="", flush=True)
"""

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
