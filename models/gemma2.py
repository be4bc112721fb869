"""Gemma 2: sandwich norms (before and after attention and MLP), (1 + w) RMSNorm, embeddings
times sqrt(hidden), attention scale query_pre_attn_scalar ** -0.5, attention logits and
final logits soft-capped (cap * tanh(x / cap)), sliding-window and global layers
alternating (even layers windowed unless layer_types says otherwise), GeGLU MLP."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from edgespec.models.base import LayerOptions, OffsetRMSNorm
from edgespec.models.base import Model as BaseModel
from edgespec.models.base import ModelArgs as BaseArgs


@dataclass
class ModelArgs(BaseArgs):
    query_pre_attn_scalar: float = 256.0
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None

    model_types = ("gemma2",)
    activations = ("gelu_pytorch_tanh", "gelu")
    # the reference config's defaults, for configs that leave these out
    defaults = dict(head_dim=256, query_pre_attn_scalar=256, sliding_window=4096, rms_norm_eps=1e-6,
                    rope_theta=10000.0, tie_word_embeddings=True, hidden_act="gelu_pytorch_tanh",
                    attn_logit_softcapping=50.0, final_logit_softcapping=30.0)

    @classmethod
    def translate(cls, config: dict[str, Any]) -> dict[str, Any]:
        config = dict(config)
        if "hidden_activation" in config:  # the reference reads hidden_activation over hidden_act
            act = config.pop("hidden_activation")
            config["hidden_act"] = act if act is not None else config.get("hidden_act")
        for k, v in cls.defaults.items():
            if config.get(k) is None and not (k.endswith("softcapping") and k in config):
                config[k] = v
        if config.get("layer_types") is None:
            n = config.get("num_hidden_layers") or 0
            config["layer_types"] = [cls.layer_type(config, i) for i in range(n)]
        return config

    @staticmethod
    def layer_type(config: dict[str, Any], i: int) -> str:
        return "sliding_attention" if i % 2 == 0 else "full_attention"


class Model(BaseModel):
    norm = OffsetRMSNorm
    embed_scale = True

    def layer_options(self, args: ModelArgs, i: int) -> LayerOptions:
        return LayerOptions(window=args.window(i), norm=OffsetRMSNorm, sandwich=True,
                            softcap=args.attn_logit_softcapping, scale=args.query_pre_attn_scalar**-0.5)

    def final_softcap(self, args: ModelArgs) -> float | None:
        return args.final_logit_softcapping
