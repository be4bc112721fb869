"""Drafters for speculative decoding and how an Engine gets one (edgespec.drafters.registry).

    attach_drafter(engine, None)             # the bundle's own drafter, else the model's MTP head,
                                             # else a shipped one, else none
    attach_drafter(engine, "mtp")            # the verifier's multi-token-prediction head (Qwen3.5)
    attach_drafter(engine, "self")           # skip-layer self-speculation (no extra weights)
    attach_drafter(engine, "prompt_lookup")  # n-gram lookup in the prompt
    attach_drafter(engine, "path/to/drafter")
    attach_drafter(engine, "none")
"""

from __future__ import annotations

from edgespec.drafters.base import Draft, Drafter, DrafterCaps, ModelDrafter
from edgespec.drafters.registry import (
           DATA,
           KINDS,
           attach_drafter,
           load_drafter,
           shipped_drafter_path,
)

__all__ = ["DATA", "KINDS", "Draft", "Drafter", "DrafterCaps", "ModelDrafter", "attach_drafter",
           "load_drafter", "shipped_drafter_path"]
