"""Qwen3 (dense): the Llama block with an RMSNorm over each head of q and k before RoPE,
and an explicit head_dim (often not hidden / heads)."""

from __future__ import annotations

from typing import Any

from edgespec.models.base import LayerOptions, gated_window
from edgespec.models.base import Model as BaseModel
from edgespec.models.base import ModelArgs as BaseArgs


class ModelArgs(BaseArgs):
    model_types = ("qwen3",)
    gated_windows = ("qwen3",)

    @classmethod
    def translate(cls, config: dict[str, Any]) -> dict[str, Any]:
        first = config.get("max_window_layers") or 0
        return gated_window(config, lambda c, i: i >= first)


class Model(BaseModel):
    def layer_options(self, args: BaseArgs, i: int) -> LayerOptions:
        return LayerOptions(window=args.window(i), qk_norm=True)
