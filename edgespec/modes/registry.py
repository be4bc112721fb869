"""The registry of decoding modes: each mode module registers its factory, description and
options schema here at import (`register_mode`); the engine and the apps look modes up here."""

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
    return sorted(MODES)  # one order wherever they are listed (help, errors), whatever the import order


def check_mode(name: str) -> str:
    if name != AUTO and name not in MODES:
        raise ValueError(f"unknown decoding mode {name!r}; choose one of: {AUTO}, {', '.join(available_modes())}")
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
