"""Registry of decoding modes, each with its options declared once (see `schema`).

A mode factory takes (engine, options) and returns an object with
`name` and `steps(prompt, sampler, stats) -> Iterator[Token]` (see
`edgespec.generate.DecodingMode`). Modules register themselves on import;
every built-in mode module is imported here so the apps pick new modes up
without change. "auto" is not a mode of its own: the engine resolves it (to
"adaptive", see Engine.resolve_mode) and its options are adaptive's.
"""

from __future__ import annotations

from edgespec.modes.registry import (
    AUTO,
    DESCRIPTIONS,
    MODES,
    SCHEMAS,
    available_modes,
    check_mode,
    make_mode,
    register_mode,
    schema_of,
    validate_mode_options,
)

__all__ = ["AUTO", "DESCRIPTIONS", "MODES", "SCHEMAS", "available_modes", "check_mode", "make_mode",
           "register_mode", "schema_of", "validate_mode_options"]

# Built-in modes (each module calls register_mode at import).
from edgespec.modes import adaptive, cascade, lookahead, plain, prompt_lookup, speculative, tree  # noqa: E402,F401
