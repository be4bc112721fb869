"""Mode options declared once: a typed schema per mode, validated before any model loads.

Each mode registers its options (`register_mode(..., options=[Option(...)])`).
`GenerateOptions` validates `mode_options` against the chosen mode's schema
when it is built, so the CLI (`--mode-option`), the server (`mode_options`)
and `edgespec bench` (`NAME:KEY=VALUE`) all reject a typo or a bad value
with the same message, before a model is fetched or loaded. Values may come
as text (the CLI) or typed (the Python API, JSON): "0"/"false"/"no"/"off"
are False for a bool, never truthy strings.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from edgespec.errors import UnknownOptionError

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


@dataclass(frozen=True)
class Option:
    name: str
    kind: str  # "int" | "float" | "bool" | "str" | "choice"
    default: Any
    help: str
    lo: float | None = None
    hi: float | None = None
    choices: tuple = ()
    check: Callable[[Any], Any] | None = None  # extra parse/validation of a str value; raises ValueError

    def describe(self) -> str:
        if self.kind == "bool":
            rng = "0/1"
        elif self.kind == "choice":
            rng = "|".join(map(str, self.choices))
        elif self.lo is not None:
            rng = f"{self.lo:g}..{self.hi:g}"
        else:
            rng = self.kind
        default = "device default" if self.default is None else self.default
        return f"{self.name} ({rng}, default {default}): {self.help}"

    def parse(self, mode: str, value: Any) -> Any:
        where = f"{mode} option {self.name!r}"
        if self.kind == "bool":
            if isinstance(value, bool):
                return value
            if isinstance(value, int) and value in (0, 1):
                return bool(value)
            if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
                return value.strip().lower() in _TRUE
            raise ValueError(f"{where} must be 0/1 or true/false, got {value!r}")
        if self.kind in ("int", "float"):
            v = value
            if isinstance(v, str):
                try:
                    v = int(v.strip()) if self.kind == "int" else float(v.strip())
                except ValueError:
                    v = None
            ok = (
                isinstance(v, (int, float))
                and not isinstance(v, bool)
                and (self.kind == "float" or isinstance(v, int))
            )
            if not ok or (self.lo is not None and not self.lo <= v <= self.hi):
                raise ValueError(f"{where} must be {'an integer' if self.kind == 'int' else 'a number'} in "
                                 f"{self.lo:g}..{self.hi:g}, got {value!r}")
            return v
        if self.kind == "choice":
            v = value.strip() if isinstance(value, str) else value
            if v not in self.choices:
                raise ValueError(f"{where} must be one of {', '.join(map(str, self.choices))}, got {value!r}")
            return v
        if self.check is not None:
            return self.check(value)
        if not isinstance(value, str):
            raise ValueError(f"{where} must be text, got {value!r}")
        return value


class Schema:
    def __init__(self, mode: str, options: list[Option] | tuple = ()):
        self.mode = mode
        self.options = {o.name: o for o in options}

    def validate(self, raw: dict[str, Any] | None) -> dict[str, Any]:
        """The given options, typed and checked (missing ones are left to the mode's defaults)."""
        raw = dict(raw or {})
        unknown = sorted(set(raw) - set(self.options))
        if unknown:
            valid = ", ".join(self.options) or "none"
            raise UnknownOptionError(f"unknown option(s) {', '.join(map(repr, unknown))} for mode "
                                     f"{self.mode!r}; valid: {valid}")
        return {k: self.options[k].parse(self.mode, v) for k, v in raw.items() if v is not None}

    def get(self, values: dict[str, Any], name: str) -> Any:
        """A validated value, or the declared default."""
        return values.get(name, self.options[name].default)

    def help(self) -> str:
        return "; ".join(o.describe() for o in self.options.values())


PIPELINE = Option(
    "pipeline", "bool", None,
    "draft the next round while the verifier checks this one (default: on when drafter and verifier "
    "sit on different devices)",
)
