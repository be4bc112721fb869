"""The Qwen3.5 architecture (dense text model; `qwen3_5_text`, and the text part of `qwen3_5`).

Gated DeltaNet layers (linear attention) interleaved with gated full attention:
- linear_attention: in_proj_qkv -> depthwise causal conv (width linear_conv_kernel_dim) ->
  SiLU -> q, k (L2-normed, q scaled by Dk^-0.5), v; decay g = -exp(A_log) softplus(a +
  dt_bias), beta = sigmoid(b); the gated delta rule (edgespec.caches.recurrent: recurrent form for
  decode and verify passes, chunked form for long prompt chunks; per-branch in tree passes);
  output RMSNorm(o) * silu(z), out_proj. Its state is an edgespec.caches.recurrent.DeltaCache.
- full_attention: q_proj gives q and a per-head output gate, (1 + w) RMSNorm over heads of
  q and k, RoPE on the first partial_rotary_factor of each head (text positions: the
  multimodal RoPE sections coincide), out * sigmoid(gate) before o_proj.
Norms are (1 + w) RMSNorms, except the delta rule's gated output norm (w). The vision tower
of a `qwen3_5` checkpoint is not loaded.

Multi-token prediction (`mtp.*` weights, config `mtp_num_hidden_layers`): when the checkpoint
carries them, `Model.mtp` is an MTPHead, a drafter that ships with the model (used by
edgespec/drafters/mtp.py). Its definition, as published in vLLM's
`model_executor/models/qwen3_5_mtp.py` (Qwen3_5MultiTokenPredictor.forward) and
`qwen3_next_mtp.py`, and SGLang's `qwen3_next_mtp.py`:
- inputs at position t: the verifier's hidden state h_t as the model returns it, i.e. after
  its final norm (vLLM's Qwen3NextForCausalLM.compute_logits applies lm_head straight to the
  states its forward returns, and its speculative proposer hands those same states to the MTP
  model), and the embedding of x_{t+1} from the shared `embed_tokens` (SGLang's
  qwen3_next_mtp uses the target model's embeddings, the checkpoint providing no dedicated ones);
- e = pre_fc_norm_embedding(embed(x_{t+1})), h = pre_fc_norm_hidden(h_t), both (1 + w)
  RMSNorms (Qwen3_5RMSNorm = GemmaRMSNorm); x = fc(concat[e, h]) (embedding first; 2H -> H,
  no bias);
- `mtp.layers.*`: Qwen3.5 decoder layers of layer_type "full_attention" (gated attention
  with (1 + w) q/k norms and partial RoPE, the model's MLP), with their own KV cache over
  the MTP positions; the query for (x_{t+1}, h_t) sits at RoPE position t (vLLM passes the
  target positions);
- `mtp.norm` ((1 + w)), then the shared lm_head gives logits for x_{t+2}; drafting further
  feeds this normed output back as the next step's hidden state (vLLM's proposer, method
  "mtp"), at position t + 1.
With several MTP layers vLLM runs layer (step mod n) per draft step; edgespec loads a head
of one layer (as Qwen3.5 ships it) and skips, with a note naming the field, a head with
more layers or with `mtp_use_dedicated_embeddings`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from edgespec.models.base import MLP, DecoderLayer, LayerOptions, OffsetRMSNorm
from edgespec.models.base import Model as BaseModel
from edgespec.models.base import ModelArgs as BaseArgs
from mlx.utils import tree_flatten

from edgespec.caches.kv import HiddenKVCache
from edgespec.caches.recurrent import (
    RECURRENT_MAX,
    DeltaCache,
    conv_windows,
    delta_chunked,
    delta_rule,
    depthwise,
    tree_parents,
)
from edgespec.errors import ModelLoadError
from edgespec.kernels import base2
from edgespec.kernels.linear import Linear

KINDS = ("linear_attention", "full_attention")
NOTE_SKIPPED = "qwen3_5: the vision tower is not loaded (text model only); mtp.* weights load as a drafter"


@dataclass
class ModelArgs(BaseArgs):
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    blocks: list[str] | None = None  # per layer: "linear_attention" or "full_attention"
    mtp_num_hidden_layers: int = 0  # multi-token-prediction layers (loaded when mtp.* weights are present)
    mtp_use_dedicated_embeddings: bool = False

    model_types = ("qwen3_5_text", "qwen3_5")

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> ModelArgs:
        c = dict(config)
        wrapper = cls.model_types[-1]  # qwen3_5 / qwen3_5_moe: the multimodal wrapper, read as its text model
        if c.get("model_type") == wrapper and "text_config" in c:
            text = dict(c.get("text_config") or {})
            text["tie_word_embeddings"] = c.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
            c = {**text, "model_type": wrapper}
        rp = c.get("rope_parameters")
        if isinstance(rp, dict):  # text positions: the multimodal sections all coincide
            c["rope_parameters"] = {k: v for k, v in rp.items() if k not in ("mrope_section", "mrope_interleaved")}
        return super().from_dict(c)

    @classmethod
    def translate(cls, config: dict[str, Any]) -> dict[str, Any]:
        c = dict(config)
        c.setdefault("partial_rotary_factor", 0.25)
        c.setdefault("rms_norm_eps", 1e-6)
        n = c.get("num_hidden_layers") or 0
        every = c.pop("full_attention_interval", 4)
        kinds = c.pop("layer_types", None)
        c["blocks"] = kinds if kinds is not None else [
            "linear_attention" if (i + 1) % every else "full_attention" for i in range(n)]
        return c

    def __post_init__(self):
        super().__post_init__()
        if self.blocks is None or len(self.blocks) != self.num_hidden_layers or set(self.blocks) - set(KINDS):
            raise ValueError(f"qwen3_5 layer_types must list {self.num_hidden_layers} of {list(KINDS)}; "
                             f"got {self.blocks}")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError("linear_num_value_heads must be a multiple of linear_num_key_heads")


def l2norm(x: mx.array, eps: float = 1e-6) -> mx.array:
    return x * mx.rsqrt((x * x).sum(axis=-1, keepdims=True) + eps)


class GatedDeltaNet(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        E = args.hidden_size
        self.Hk, self.Hv = args.linear_num_key_heads, args.linear_num_value_heads
        self.Dk, self.Dv = args.linear_key_head_dim, args.linear_value_head_dim
        self.K = args.linear_conv_kernel_dim
        C = 2 * self.Hk * self.Dk + self.Hv * self.Dv
        self.in_proj_qkv = Linear(E, C, bias=False)
        self.in_proj_z = Linear(E, self.Hv * self.Dv, bias=False)
        self.in_proj_b = Linear(E, self.Hv, bias=False)
        self.in_proj_a = Linear(E, self.Hv, bias=False)
        self.conv1d = nn.Module()
        self.conv1d.weight = mx.zeros((C, 1, self.K))  # Hugging Face's (C, 1, K)
        self.dt_bias = mx.ones((self.Hv,))
        self.A_log = mx.zeros((self.Hv,))
        self.norm = nn.RMSNorm(self.Dv, eps=args.rms_norm_eps)
        self.out_proj = Linear(self.Hv * self.Dv, E, bias=False)

    def __call__(self, x, mask, cache: DeltaCache | None):
        B, T, _ = x.shape
        qkv = self.in_proj_qkv(x)
        z = self.in_proj_z(x).reshape(B, T, self.Hv, self.Dv)
        state = cache.state if cache is not None else None
        if state is None:
            state = (mx.zeros((B, self.K - 1, qkv.shape[-1]), qkv.dtype),
                     mx.zeros((B, self.Hv, self.Dk, self.Dv), mx.float32))
        parents = tree_parents(mask, cache.offset, T) if cache is not None else None
        win, last = conv_windows(qkv, state[0], parents)
        mixed = base2.silu(depthwise(win, self.conv1d.weight, None)).astype(mx.float32)
        kd = self.Hk * self.Dk
        r = self.Hv // self.Hk  # each q/k head serves r consecutive value heads
        q = mx.repeat(l2norm(mixed[..., :kd].reshape(B, T, self.Hk, self.Dk)), r, axis=2) * self.Dk**-0.5
        k = mx.repeat(l2norm(mixed[..., kd : 2 * kd].reshape(B, T, self.Hk, self.Dk)), r, axis=2)
        v = mixed[..., 2 * kd :].reshape(B, T, self.Hv, self.Dv)
        beta = base2.sigmoid(self.in_proj_b(x).astype(mx.float32))
        a = self.in_proj_a(x).astype(mx.float32)
        g = -mx.exp(self.A_log.astype(mx.float32)) * nn.softplus(a + self.dt_bias.astype(mx.float32))
        if parents is None and T > RECURRENT_MAX:
            out, S = delta_chunked(q, k, v, g, beta, state[1])
        else:
            out, S = delta_rule(q, k, v, g, beta, state[1], parents, inference=cache is not None)
        if cache is not None:
            cache.write((qkv, k, v, g, beta), (last, S), parents, state)
        out = self.norm(out.astype(x.dtype)) * base2.silu(z.astype(mx.float32)).astype(x.dtype)
        return self.out_proj(out.reshape(B, T, -1))


class DeltaLayer(nn.Module):
    def __init__(self, args: ModelArgs, mlp=MLP):
        super().__init__()
        self.linear_attn = GatedDeltaNet(args)
        self.mlp = mlp(args)
        self.input_layernorm = OffsetRMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = OffsetRMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def make_cache(self) -> DeltaCache:
        return DeltaCache()

    def __call__(self, x, mask, cache, positions):
        h = x + self.linear_attn(self.input_layernorm(x), mask, cache)
        return h + self.mlp(self.post_attention_layernorm(h), cache is not None)


class MTPHead(nn.Module):
    """The multi-token-prediction head (see the module docstring): (embedding of x_{t+1}, the
    verifier's final-norm hidden state at t) -> its own normed hidden state at t, whose
    projection by the shared head gives logits for x_{t+2}."""

    def __init__(self, args: ModelArgs, make_layer):
        super().__init__()
        E, eps = args.hidden_size, args.rms_norm_eps
        self.pre_fc_norm_embedding = OffsetRMSNorm(E, eps=eps)
        self.pre_fc_norm_hidden = OffsetRMSNorm(E, eps=eps)
        self.fc = Linear(2 * E, E, bias=False)
        self.layers = [make_layer(args) for _ in range(args.mtp_num_hidden_layers)]
        self.norm = OffsetRMSNorm(E, eps=eps)

    def make_cache(self) -> list:
        return [layer.make_cache() for layer in self.layers]

    def __call__(self, emb: mx.array, hidden: mx.array, cache: list | None = None) -> mx.array:
        """emb (B, T, E) embeddings of x_{t+1}, hidden (B, T, E) states at t -> (B, T, E).

        Entries sit at RoPE positions cache offset, offset + 1, ... (entry t at position t)."""
        x = mx.concatenate([self.pre_fc_norm_embedding(emb), self.pre_fc_norm_hidden(hidden)], axis=-1)
        h = self.fc(x)  # (B, T, 2E) -> (B, T, E)
        mask = "causal" if h.shape[1] > 1 else None
        for i, layer in enumerate(self.layers):
            h = layer(h, mask, cache[i] if cache is not None else None, None)
        return self.norm(h)


# The norms mlx-lm's qwen3_5 / qwen3_next `sanitize` stores as 1 + w (1-D weights whose names
# end so); the gated output norm of the delta rule (linear_attn.norm, applied as w) is left alone.
MLX_SHIFTED_NORMS = (".input_layernorm.weight", ".post_attention_layernorm.weight", "model.norm.weight",
                     ".q_norm.weight", ".k_norm.weight")


def mlx_lm_converted(weights: dict[str, mx.array]) -> bool:
    """True for weights written by mlx-lm (an mlx-community folder): its sanitize moves each
    conv1d weight from Hugging Face's (C, 1, K) to MLX's (C, K, 1), and in the same pass stores
    the (1 + w) norms above as 1 + w so that a plain RMSNorm applies (and drops mtp.*). The conv
    layout tells the two apart (with a kernel of width 1 both read (C, 1, 1): taken as Hugging
    Face's)."""
    return any(k.endswith("conv1d.weight") and v.ndim == 3 and v.shape[1] != 1 and v.shape[2] == 1
               for k, v in weights.items())


class Model(BaseModel):
    norm = OffsetRMSNorm
    keep_hidden = False  # set by an MTP drafter: caches then record the final-norm hidden states
    feed_forward: Any = MLP  # (args) -> every layer's feed-forward (Qwen3.5-MoE: the sparse block)

    def attention_layer(self, args: ModelArgs) -> nn.Module:
        """A gated full-attention layer: the main model's and the MTP head's (with the variant's
        feed-forward block)."""
        return DecoderLayer(args, LayerOptions(qk_norm=True, norm=OffsetRMSNorm, output_gate=True,
                                               mlp=self.feed_forward))

    def make_layer(self, args: ModelArgs, i: int) -> nn.Module:
        if args.blocks[i] == "linear_attention":
            return DeltaLayer(args, self.feed_forward)
        return self.attention_layer(args)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        shifted = mlx_lm_converted(weights)
        out, mtp = {}, {}
        for k, v in weights.items():
            if k.startswith(("model.visual.", "visual.", "vision_tower.")):
                continue
            if k.startswith(("mtp.", "model.mtp.")):
                mtp[k[k.index("mtp.") :]] = v
                continue
            k = k.replace("model.language_model.", "model.")
            if k.startswith("language_model."):  # mlx-lm's multimodal wrapper: language_model.model...
                k = k[len("language_model.") :]
            if k.endswith("conv1d.weight") and v.ndim == 3 and v.shape[1] != 1:
                v = v.swapaxes(1, 2)  # mlx-community folders store (C, K, 1)
            elif shifted and v.ndim == 1 and k.endswith(MLX_SHIFTED_NORMS):
                v = v - 1.0  # back to the w of (1 + w)
            out[k] = v
        out = super().sanitize(out)
        out.update(self._attach_mtp(mtp))
        return out

    def _attach_mtp(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Build the MTP head for the checkpoint's `mtp.*` weights (checked by name and shape);
        returns the weights to load, none when the head is absent or skipped (with a note)."""
        if not weights:
            return {}
        args = self.args
        skip = None
        if args.mtp_num_hidden_layers < 1:
            skip = "mtp_num_hidden_layers is 0 in config.json"
        elif args.mtp_num_hidden_layers > 1:
            skip = f"mtp_num_hidden_layers {args.mtp_num_hidden_layers} (edgespec runs a head of 1 layer)"
        elif args.mtp_use_dedicated_embeddings:
            skip = "mtp_use_dedicated_embeddings is set (edgespec's head reads the shared embeddings)"
        if skip:
            self.load_note = f"qwen3_5: {len(weights)} mtp.* tensors not loaded: {skip}"
            return {}

        weights = self.mtp_weights(weights)
        head = MTPHead(args, self.attention_layer)
        want = {f"mtp.{k}": v.shape for k, v in tree_flatten(head.parameters())}
        quantized = any(k.endswith(".scales") for k in weights)
        for name, shape in want.items():
            got = weights.get(name)
            if got is None:
                raise ModelLoadError(f"the checkpoint's MTP head lacks tensor {name} (shape {tuple(shape)})")
            if not quantized and tuple(got.shape) != tuple(shape):
                raise ModelLoadError(f"MTP tensor {name} has shape {tuple(got.shape)}, "
                                     f"the config makes it {tuple(shape)}")
        extra = sorted(k for k in weights if k not in want and not (quantized and k.endswith((".scales", ".biases"))))
        if extra:
            raise ModelLoadError(f"MTP tensor(s) {', '.join(extra[:4])} not part of a Qwen3.5 MTP head")
        self.mtp = head
        return weights

    def mtp_weights(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """The checkpoint's `mtp.*` tensors -> the head's names (a variant whose layers store
        their tensors differently, e.g. stacked experts, maps the MTP layer's here too)."""
        return weights

    def make_cache(self) -> list:
        caches = super().make_cache()
        j = self.hidden_layer
        if self.keep_hidden and j is not None:
            caches[j] = HiddenKVCache()
        return caches

    @property
    def hidden_layer(self) -> int | None:
        """The layer whose cache records hidden states for an MTP drafter (the first attention one)."""
        blocks = self.args.blocks
        return blocks.index("full_attention") if "full_attention" in blocks else None

    def __call__(self, inputs, cache=None, mask=None, positions=None, layer_ids=None, return_hidden=False,
                 last_only=False):
        """As models.base.Model; with an MTP drafter attached (`keep_hidden`), a pass with a
        cache also records its final-norm hidden states there (rows follow the cache's trims)."""
        j = self.hidden_layer
        tap = cache[j] if self.keep_hidden and cache is not None and layer_ids is None and j is not None else None
        if tap is None or not hasattr(tap, "put_hidden"):
            return super().__call__(inputs, cache, mask, positions, layer_ids, return_hidden, last_only)
        logits, h = super().__call__(inputs, cache, mask, positions, None, True, last_only)
        tap.put_hidden(h)
        return (logits, h) if return_hidden else logits
