"""Architecture registry: Hugging Face `model_type` -> the module in edgespec.models that implements it.

Every architecture module defines `ModelArgs` (with `from_dict(config)`) and `Model`
(the model contract: args, make_cache, embed, layers, head, project, __call__ with
mask / positions / layer_ids / return_hidden). A new architecture is one file in
this folder plus one line in ARCHITECTURES here. Modules are imported on first use.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

from edgespec.errors import ModelLoadError

# model_type -> module name in edgespec.models
ARCHITECTURES: dict[str, str] = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "llama",
    "smollm": "llama",
    "smollm2": "llama",
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3_moe",
    "gemma2": "gemma2",
    "gemma3_text": "gemma3",
    "gemma4_text": "gemma4",
    "gemma4": "gemma4",
    "phi3": "phi3",
    "smollm3": "smollm3",
    "lfm2": "lfm2",
    "lfm2_moe": "lfm2_moe",
    "qwen3_5_text": "qwen3_5",
    "qwen3_5": "qwen3_5",
    "qwen3_5_moe_text": "qwen3_5_moe",
    "qwen3_5_moe": "qwen3_5_moe",
}

# model_type values that only draft for another model (edgespec.drafters)
DRAFTER_ONLY = {"gemma4_assistant": "Gemma 4's assistant drafter"}


def supported_model_types() -> list[str]:
    return sorted(ARCHITECTURES)


def get_architecture(model_type: str | None) -> ModuleType:
    """The module implementing `model_type`; ModelLoadError naming the supported ones otherwise."""
    name = ARCHITECTURES.get(model_type or "llama")
    if name is None and model_type in DRAFTER_ONLY:
        raise ModelLoadError(f"{model_type!r} is {DRAFTER_ONLY[model_type]}, not a model of its own: load it as the "
                             "drafter, edgespec.load(verifier, drafter=this_folder)")
    if name is None:
        raise ModelLoadError(
            f"unsupported architecture {model_type!r} (config model_type); edgespec supports "
            f"{', '.join(supported_model_types())}"
        )
    return importlib.import_module(f"edgespec.models.{name}")


def model_from_config(config: dict[str, Any]):
    """An uninitialised Model for an HF-style config dict (bad configs raise ValueError)."""
    arch = get_architecture(config.get("model_type", "llama"))
    return arch.Model(arch.ModelArgs.from_dict(config))
