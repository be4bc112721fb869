"""Options of one generation request, validated up front."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from edgespec.logits.processors import Penalties
from edgespec.logits.sampling import SamplingParams
from edgespec.logits.structured import parse_response_format
from edgespec.modes import validate_mode_options

MAX_LOGPROBS = 20


@dataclass
class GenerateOptions:
    max_tokens: int = 256
    stop: list[str] = field(default_factory=list)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    mode: str = "auto"  # "auto" lets the engine choose (see Engine.resolve_mode)
    draft_tokens: int | str = "auto"  # K for speculative modes, or "auto"
    mode_options: dict[str, Any] = field(default_factory=dict)  # e.g. lookahead W/N/G
    # Structured output (edgespec.logits.structured): None, an OpenAI response_format dict, a JSON
    # schema dict or a Pydantic model class; compiled here (a bad one raises ValueError).
    response_format: Any = None
    logprobs: int | None = None  # each token's logprob and this many alternatives (0..20)
    penalties: Penalties = field(default_factory=Penalties)

    def __post_init__(self):
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not all(isinstance(s, str) for s in self.stop):
            raise ValueError("stop must be a string or a list of strings")

        if not isinstance(self.mode, str):
            raise ValueError(f"mode must be a string, got {self.mode!r}")
        if not isinstance(self.mode_options, dict):
            raise ValueError(f"mode_options must be a dict, got {type(self.mode_options).__name__}")
        # Typed and checked against the mode's declared options, before any model is loaded.
        self.mode_options = validate_mode_options(self.mode, self.mode_options)

        self.response_format = parse_response_format(self.response_format)
        lp = self.logprobs
        if lp is not None and (not isinstance(lp, int) or isinstance(lp, bool) or not 0 <= lp <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be None or an integer in 0..{MAX_LOGPROBS} (alternatives per token), "
                             f"got {lp!r}")
        if not isinstance(self.penalties, Penalties):
            raise ValueError(f"penalties must be an edgespec.logits.processors.Penalties, got {type(self.penalties).__name__}")
        dt = self.draft_tokens
        if dt != "auto" and (not isinstance(dt, int) or isinstance(dt, bool) or not 1 <= dt <= 16):
            raise ValueError(f"draft_tokens must be 'auto' or an integer in 1..16, got {dt!r}")
