"""SmolLM3: the Llama block with NoPE layers (no rotary embedding at all) where
no_rope_layers[i] == 0, by default every no_rope_layer_interval-th layer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from edgespec.models.base import LayerOptions, gated_window
from edgespec.models.base import Model as BaseModel
from edgespec.models.base import ModelArgs as BaseArgs


@dataclass
class ModelArgs(BaseArgs):
    no_rope_layers: list[int] | None = None  # 1 = RoPE, 0 = NoPE, per layer

    model_types = ("smollm3",)
    gated_windows = ("smollm3",)

    @classmethod
    def translate(cls, config: dict[str, Any]) -> dict[str, Any]:
        config = dict(config)
        interval = config.pop("no_rope_layer_interval", 4)
        n = config.get("num_hidden_layers") or 0
        if config.get("no_rope_layers") is None:
            config["no_rope_layers"] = [int((i + 1) % interval != 0) for i in range(n)]
        rope = config["no_rope_layers"]
        # windowed layers, when enabled, are the NoPE ones (the reference's derivation)
        return gated_window(config, lambda c, i: not rope[i])

    def __post_init__(self):
        super().__post_init__()
        if len(self.no_rope_layers or ()) != self.num_hidden_layers:
            raise ValueError(f"no_rope_layers must have {self.num_hidden_layers} entries, got {self.no_rope_layers}")


class Model(BaseModel):
    def layer_options(self, args: ModelArgs, i: int) -> LayerOptions:
        return LayerOptions(window=args.window(i), rope=bool(args.no_rope_layers[i]))
