"""Which decoding configurations a benchmark compares.

A mode spec is `NAME` or `NAME:KEY=VALUE:KEY=VALUE`, and a list of them is
comma-separated, e.g. `plain,speculative:draft_tokens=4,lookahead:W=5:N=3:G=5`.
`draft_tokens` sets GenerateOptions.draft_tokens; `drafter` (none, self,
prompt_lookup or a path, as `--drafter`) attaches that drafter for this spec
only, so `speculative:drafter=self,speculative` compares two drafters in one
run; every other key goes into mode_options. Values are parsed as int, float, true/false, else kept as text.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from edgespec.engine import make_options

REFERENCE = "plain"


@dataclass
class ModeSpec:
    label: str  # unique name in reports, e.g. "speculative:draft_tokens=4"
    mode: str  # registered mode name (or "auto")
    draft_tokens: int | str = "auto"
    options: dict[str, Any] = field(default_factory=dict)
    drafter: str | None = None  # None = the engine's drafter

    @property
    def settings(self) -> dict[str, Any]:
        """All user-set knobs (draft_tokens included when not 'auto', drafter when set)."""
        d = {} if self.draft_tokens == "auto" else {"draft_tokens": self.draft_tokens}
        if self.drafter is not None:
            d["drafter"] = self.drafter
        d.update(self.options)
        return d

    @property
    def is_reference(self) -> bool:
        return self.mode == REFERENCE and not self.settings


def _value(text: str) -> Any:
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def parse_mode_spec(text: str) -> ModeSpec:
    parts = [p.strip() for p in text.strip().split(":")]
    name = parts[0]
    if not name:
        raise ValueError(
            f"empty mode name in mode spec {text!r}; expected NAME or NAME:KEY=VALUE:..."
        )
    draft_tokens: int | str = "auto"
    drafter = None
    options: dict[str, Any] = {}
    for kv in parts[1:]:
        key, eq, raw = kv.partition("=")
        key = key.strip()
        if not eq or not key or not raw.strip():
            raise ValueError(f"bad setting {kv!r} in mode spec {text!r}; expected KEY=VALUE")
        value = _value(raw.strip())
        if key == "draft_tokens":
            draft_tokens = value
        elif key == "drafter":
            drafter = raw.strip()
        else:
            options[key] = value
    label = ":".join([name] + [p for p in parts[1:]])
    spec = ModeSpec(
        label=label, mode=name, draft_tokens=draft_tokens, options=options, drafter=drafter
    )
    # Validate the knobs now (before a model is loaded): GenerateOptions checks the mode name,
    # draft_tokens and the options against the mode's declared schema.

    make_options(mode=name, draft_tokens=draft_tokens, **options)
    return spec


def parse_mode_specs(text: str | list[str] | None, available: list[str]) -> list[ModeSpec]:
    """Spec list -> ModeSpecs with the plain reference first (added when missing).

    None means every registered mode. An unknown name or option fails here,
    before any model is loaded.
    """
    if text is None:
        items = list(available)
    elif isinstance(text, str):
        items = [t for t in text.split(",") if t.strip()]
    else:
        items = list(text)
    if not items:
        raise ValueError("no modes given; choose from: " + ", ".join(available))
    specs = [parse_mode_spec(t) for t in items]
    labels = [s.label for s in specs]
    dupes = sorted({lab for lab in labels if labels.count(lab) > 1})
    if dupes:
        raise ValueError(f"mode spec(s) listed twice: {', '.join(dupes)}")
    refs = [s for s in specs if s.is_reference]
    if not refs:
        specs.insert(0, ModeSpec(label=REFERENCE, mode=REFERENCE))
    else:
        specs.remove(refs[0])
        specs.insert(0, refs[0])
    return specs
