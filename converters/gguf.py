"""GGUF reading lives in the runtime (edgespec.weights.formats.gguf); re-exported for converters."""

from edgespec.weights.formats.gguf import *  # noqa: F403
from edgespec.weights.formats.gguf import _open  # noqa: F401  (private helper the converter uses)
