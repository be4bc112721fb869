"""GGUF reading lives in the runtime (edgespec.formats.gguf); re-exported for converters."""

from edgespec.formats.gguf import *  # noqa: F403
from edgespec.formats.gguf import _open  # noqa: F401  (private helper the converter uses)
