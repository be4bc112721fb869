"""Gemma 3 (text): Gemma 2's block with (1 + w) RMSNorm over each head of q and k, local
(sliding-window) layers with their own RoPE base (rope_local_base_freq, unscaled) and
global layers with rope_theta and rope scaling; five local layers per global one unless
layer_types says otherwise. No soft-capping unless the config sets it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from edgespec.models import gemma2
from edgespec.models.base import LayerOptions


@dataclass
class ModelArgs(gemma2.ModelArgs):
    rope_local_base_freq: float = 10000.0

    model_types = ("gemma3_text",)
    defaults = dict(gemma2.ModelArgs.defaults, rope_theta=1_000_000.0, rope_local_base_freq=10000.0,
                    attn_logit_softcapping=None, final_logit_softcapping=None)

    @classmethod
    def translate(cls, config: dict[str, Any]) -> dict[str, Any]:
        config = dict(config)
        # v4 wrote the local/global pattern as sliding_window_pattern, v5 as _sliding_window_pattern
        # (plus layer_types); the pattern is only read when layer_types is absent.
        v4, v5 = config.pop("sliding_window_pattern", None), config.pop("_sliding_window_pattern", None)
        config["_pattern"] = v4 or v5 or 6
        out = super().translate(config)
        out.pop("_pattern")
        return out

    @staticmethod
    def layer_type(config: dict[str, Any], i: int) -> str:
        return "sliding_attention" if (i + 1) % config["_pattern"] else "full_attention"


class Model(gemma2.Model):
    def layer_options(self, args: ModelArgs, i: int) -> LayerOptions:
        opts = super().layer_options(args, i)
        opts.qk_norm = True
        if args.layer_types[i] == "sliding_attention":
            opts.rope_base, opts.rope_scaled = args.rope_local_base_freq, False
        return opts
