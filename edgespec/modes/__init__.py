"""Registry of decoding modes, each with its options declared once (see `schema`).

A mode factory takes (engine, options) and returns an object with
`name` and `steps(prompt, sampler, stats) -> Iterator[Token]` (see
`edgespec.generate.DecodingMode`). Modules register themselves on import;
every built-in mode module is imported here so the apps pick new modes up
without change. "auto" is not a mode of its own: the engine resolves it (to
"adaptive", see Engine.resolve_mode) and its options are adaptive's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from edgespec.modes.schema import PIPELINE, Option, Schema

MODES: dict[str, Callable[[Any, Any], Any]] = {}
DESCRIPTIONS: dict[str, str] = {}
SCHEMAS: dict[str, Schema] = {}
AUTO = "auto"


def register_mode(name: str, description: str, options: list[Option] | tuple = ()):
    def deco(factory):
        MODES[name] = factory
        DESCRIPTIONS[name] = description
        SCHEMAS[name] = Schema(name, options)
        return factory

    return deco


def available_modes() -> list[str]:
    return list(MODES)


def check_mode(name: str) -> str:
    if name != AUTO and name not in MODES:
        raise ValueError(f"unknown decoding mode {name!r}; choose one of: {AUTO}, {', '.join(MODES)}")
    return name


def schema_of(name: str) -> Schema:
    """The options schema of a mode; auto takes adaptive's (plus speculative's pipeline switch)."""
    check_mode(name)
    if name == AUTO:
        return Schema(AUTO, list(SCHEMAS["adaptive"].options.values()) + [PIPELINE])
    return SCHEMAS.get(name) or Schema(name)  # a mode added to MODES by hand takes no options


def validate_mode_options(name: str, options: dict | None) -> dict:
    return schema_of(name).validate(options)


def make_mode(name: str, engine, options):
    check_mode(name)
    return MODES[name](engine, options)


# Built-in modes (each module calls register_mode at import).
from edgespec.modes import adaptive, cascade, lookahead, plain, prompt_lookup, speculative, tree  # noqa: E402,F401
