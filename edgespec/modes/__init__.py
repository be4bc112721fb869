"""Registry of decoding modes.

A mode factory takes (engine, options) and returns an object with
`name` and `steps(prompt, sampler, stats) -> Iterator[Token]` (see
`edgespec.generate.DecodingMode`). Modules register themselves on import;
every built-in mode module is imported here so the apps pick new modes up
without change.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

MODES: dict[str, Callable[[Any, Any], Any]] = {}
DESCRIPTIONS: dict[str, str] = {}


def register_mode(name: str, description: str):
    def deco(factory):
        MODES[name] = factory
        DESCRIPTIONS[name] = description
        return factory

    return deco


def available_modes() -> list[str]:
    return list(MODES)


def make_mode(name: str, engine, options):
    if name not in MODES:
        raise ValueError(f"unknown decoding mode {name!r}; choose one of: auto, {', '.join(MODES)}")
    return MODES[name](engine, options)


# Built-in modes (each module calls register_mode at import).
from edgespec.modes import cascade, lookahead, plain, prompt_lookup, speculative, tree  # noqa: E402,F401
