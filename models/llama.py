"""Llama-family decoders: Llama 1-3.x (incl. llama3/linear RoPE scaling), Mistral, Qwen2/2.5,
SmolLM/SmolLM2. Pre-norm blocks, RMSNorm, gated SiLU MLP, grouped-query attention.

The math lives in models/base.py; this file only reads the family's config fields.
"""

from __future__ import annotations

from typing import Any

from edgespec.models.base import (  # noqa: F401  (re-exported: other modules import them from here)
    MLP,
    Attention,
    DecoderLayer,
    RoPE,
    gated_window,
    rope_frequencies,
)
from edgespec.models.base import Model as BaseModel
from edgespec.models.base import ModelArgs as BaseArgs

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "smollm", "smollm2")


class ModelArgs(BaseArgs):
    model_types = SUPPORTED_MODEL_TYPES
    gated_windows = ("qwen2",)

    @classmethod
    def translate(cls, config: dict[str, Any]) -> dict[str, Any]:
        config = dict(config)
        if config["model_type"] == "qwen2":
            # Qwen2 always has q/k/v biases (its config has no `attention_bias`); its window
            # applies only with use_sliding_window, to layers >= max_window_layers.
            config["attention_bias"] = True
            first = config.get("max_window_layers") or 0
            config = gated_window(config, lambda c, i: i >= first)
        elif config["model_type"] != "mistral":
            config.pop("sliding_window", None)  # read only by Mistral/Qwen2 in the reference code
            if config.get("layer_types") and "sliding_attention" in config["layer_types"]:
                raise ValueError(f"{config['model_type']} with sliding_attention layer_types is not supported")
        return config


class Model(BaseModel):
    """Causal LM. `model(tokens, cache)` -> logits (B, T, V)."""
