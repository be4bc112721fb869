"""Gemma 4's assistant (`gemma4_assistant`): the small drafter Google ships beside Gemma 4.

It owns no keys or values: every layer is a Gemma 4 layer that attends, at one fixed
position p, to the verifier's keys and values of positions 0..p-1 as the verifier's
"store" layers computed them (the last layer of each type that computes its own, see
models/gemma4.py), sliding-window layers to the last `sliding_window` + 1 of them. Its input
at position p is [embedding of the token at p; the verifier's final-norm hidden state at
p - 1] (2 x the verifier's width), brought to its own width by `pre_projection`. Each
step yields logits for the token at p + 1 and, through `post_projection`, a guess of the
verifier's hidden state there, which the next step reads in place of the verifier's (the
position stays p: the keys and values are the verifier's, unchanged within a round).

With `use_ordered_embeddings` the output head scores only the tokens of the
`centroid_intermediate_top_k` best of `num_centroids` token clusters (the clusters are
rows of `token_ordering`); every other token gets the smallest scored logit minus 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from edgespec.models import gemma4
from edgespec.models.base import _harmless

from edgespec.kernels.linear import Linear


@dataclass
class AssistantArgs:
    text: gemma4.ModelArgs
    backbone_hidden_size: int
    use_ordered_embeddings: bool = False
    num_centroids: int = 2048
    centroid_intermediate_top_k: int = 32
    tie_word_embeddings: bool = True
    model_type: str = "gemma4_assistant"

    @property
    def vocab_size(self) -> int:
        return self.text.vocab_size

    @property
    def num_hidden_layers(self) -> int:
        return self.text.num_hidden_layers

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> AssistantArgs:
        if config.get("model_type") != "gemma4_assistant":
            raise ValueError(f"not a gemma4_assistant config (model_type {config.get('model_type')!r})")
        text = dict(config.get("text_config") or {})
        if not text:
            raise ValueError("gemma4_assistant config has no text_config")
        text.setdefault("model_type", "gemma4_text")
        if not text.get("num_kv_shared_layers"):  # as the reference: every layer reads the verifier's
            text["num_kv_shared_layers"] = text.get("num_hidden_layers")
        args = gemma4.ModelArgs.from_dict(text)
        bad = [name for name, ok in (
            ("hidden_size_per_layer_input", not args.hidden_size_per_layer_input),
            ("enable_moe_block", not args.enable_moe_block),
            ("use_double_wide_mlp", not args.use_double_wide_mlp),
            ("num_kv_shared_layers", args.num_kv_shared_layers == args.num_hidden_layers)) if not ok]
        if bad:
            raise ValueError(f"gemma4_assistant text_config: {', '.join(bad)} not as an assistant has them")
        known = {"model_type", "text_config", "backbone_hidden_size", "use_ordered_embeddings", "num_centroids",
                 "centroid_intermediate_top_k", "tie_word_embeddings"}

        refused = sorted(k for k, v in config.items() if k not in known and not _harmless(k, v))
        if refused:
            raise ValueError(f"gemma4_assistant config field(s) {', '.join(refused)} not understood")
        out = cls(args, int(config.get("backbone_hidden_size", 1536)),
                  bool(config.get("use_ordered_embeddings", False)), int(config.get("num_centroids", 2048)),
                  int(config.get("centroid_intermediate_top_k", 32)), bool(config.get("tie_word_embeddings", True)))
        if out.use_ordered_embeddings and args.vocab_size % out.num_centroids:
            raise ValueError(f"vocab_size {args.vocab_size} is not a multiple of num_centroids {out.num_centroids}")
        return out

    def to_dict(self) -> dict[str, Any]:
        text = self.text.to_dict()
        return {"model_type": self.model_type, "text_config": text, "backbone_hidden_size": self.backbone_hidden_size,
                "use_ordered_embeddings": self.use_ordered_embeddings, "num_centroids": self.num_centroids,
                "centroid_intermediate_top_k": self.centroid_intermediate_top_k,
                "tie_word_embeddings": self.tie_word_embeddings}


class MaskedEmbedder(nn.Module):
    def __init__(self, args: AssistantArgs):
        super().__init__()
        self.centroids = Linear(args.text.hidden_size, args.num_centroids, bias=False)
        self.token_ordering = mx.zeros((args.vocab_size,), dtype=mx.int32)
        self.k = args.centroid_intermediate_top_k

    def __call__(self, h: mx.array, head: mx.array) -> mx.array:
        """h (B, T, E), head (V, E) -> logits (B, T, V), only the chosen clusters' tokens scored."""
        B, T, E = h.shape
        V, C = head.shape[0], self.centroids.weight.shape[0]
        top = mx.argpartition(-self.centroids(h), kth=self.k - 1, axis=-1)[..., : self.k]  # (B, T, k)
        clusters = self.token_ordering.astype(mx.int32).reshape(C, V // C)
        ids = clusters[top].reshape(B, T, -1)  # (B, T, k * V/C) token ids
        scores = (head[ids] @ h[..., None])[..., 0]  # (B, T, k * V/C)
        out = mx.full((B, T, V), scores.min() - 1.0, dtype=scores.dtype)
        rows = mx.arange(B * T)[:, None]
        out = out.reshape(B * T, V)
        out[rows, ids.reshape(B * T, -1)] = scores.reshape(B * T, -1)
        return out.reshape(B, T, V)


class AssistantModel(nn.Module):
    def __init__(self, args: AssistantArgs):
        super().__init__()
        self.args = args
        t = args.text
        self.model = gemma4.Body(t)
        self.pre_projection = Linear(2 * args.backbone_hidden_size, t.hidden_size, bias=False)
        self.post_projection = Linear(t.hidden_size, args.backbone_hidden_size, bias=False)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(t.hidden_size, t.vocab_size, bias=False)
        if args.use_ordered_embeddings:
            self.masked_embedding = MaskedEmbedder(args)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        out = {k: v for k, v in weights.items() if "rotary_emb" not in k}
        if self.args.tie_word_embeddings:
            out.pop("lm_head.weight", None)
        if "masked_embedding.token_ordering" in out:
            out["masked_embedding.token_ordering"] = out["masked_embedding.token_ordering"].astype(mx.int32)
        return out

    @property
    def head_weight(self) -> mx.array:
        return self.model.embed_tokens.weight if self.args.tie_word_embeddings else self.lm_head.weight

    def __call__(self, x: mx.array, shared: dict[str, tuple[mx.array, mx.array]], position: int
                 ) -> tuple[mx.array, mx.array]:
        """x (B, T, 2 * backbone) -> (logits (B, T, V), next hidden guess (B, T, backbone)).

        shared: per layer type, the verifier's keys and values (B, Hk, S, D) of positions 0..S-1;
        every query sits at `position` (S, in drafting) and sees all S full-attention entries and
        the last `sliding_window` + 1 sliding ones (as the reference's
        bidirectional window, flipped, gives them)."""
        h = self.pre_projection(x)
        S = {t: kv[0].shape[2] for t, kv in shared.items()}
        masks = {"full_attention": None, "sliding_attention": None}
        w = self.args.text.sliding_window
        if "sliding_attention" in S and S["sliding_attention"] > w + 1:  # the reference's window: w + 1 entries
            masks["sliding_attention"] = (mx.arange(S["sliding_attention"]) >= S["sliding_attention"] - w - 1)[None]
        kv = {t: (k, v, position) for t, (k, v) in shared.items()}
        for layer in self.model.layers:
            h = layer(h, masks, None, None, None, kv)
        h = self.model.norm(h)
        if self.args.use_ordered_embeddings:
            logits = self.masked_embedding(h, self.head_weight)
        elif self.args.tie_word_embeddings:
            logits = self.model.embed_tokens.as_linear(h)
        else:
            logits = self.lm_head(h)
        return logits, self.post_projection(h)
