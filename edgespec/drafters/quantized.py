"""The verifier itself in int8 as the drafter, on the CPU device: no extra files, no training.

A drafter pays when it agrees with the verifier often and costs little. A small model's step
is bound by reading its weights, so the verifier's own weights in int8 (one scale an output
row, edgespec.kernels.q8) step in about a quarter of the float32 verifier's reads and agree
with its next token about 98% of the time on the mixed set (SmolLM2-135M; int4 agreed 72-78%,
chat 52-57%). MLX's CPU backend has no fast int8 product, so the pass is native
(edgespec/kernels/cpu_q8.c): one call a step.

State: like Gemma 4's assistant (edgespec.drafters.assistant) it owns no cache of the
committed text. With the committed sequence x_0..x_p the verifier's cache holds positions
0..n-1 (n <= p; every mode that drafts with it keeps n = p); a draft feeds x_n..x_p and then its
own tokens, reading the verifier's keys and values for the positions before them (float32,
exact: closer to the verifier than its own int8 ones would be) and keeping the new positions'
in a scratch of its own, dropped at the next draft. So there is no prompt prefill and no
catch-up, and nothing to roll back: `sync` only replaces the committed sequence.

Where it applies: a Llama-style verifier (`unsupported` says why another is not), float32 or
half weights, on the CPU device, with float32 caches (a quantized KV cache is read dequantized,
as the verifier reads it; half-precision caches or a cache without `state` give no draft: the
output is unchanged). On Metal MLX's own quantized products are the right tool; this kind declares
`runs_on` "host" and is offered on the CPU device only (`available`).
"""

from __future__ import annotations

import copy

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from edgespec.drafters.base import CHAIN_MODES, Draft, DrafterCaps, ReadsVerifierCache
from edgespec.errors import ModelLoadError
from edgespec.kernels import q8
from edgespec.models.base import MLP, Attention, DecoderLayer, Model, RoPE, rope_table
from edgespec.weights.numerics import runs_as_metal

NAME = "int8"
# New positions a draft call can hold: the tokens after the verifier's cache (one, in the
# modes that draft with it) plus the drafted ones. Longer calls are cut to it.
SCRATCH = 64


def _numpy(a: mx.array) -> np.ndarray:
    mx.eval(a)
    return np.asarray(a.astype(mx.float32) if a.dtype != mx.float32 else a)


def unsupported(model) -> str | None:
    """Why `model`'s pass cannot run in int8, or None when it can: every layer the base
    Llama-style decoder (RMSNorm, RoPE, grouped-query attention without bias, window, soft-cap,
    q/k norms or gate; a SiLU-gated MLP without bias), the same RoPE in every layer, dense weights."""
    if not isinstance(model, Model) or type(model).__call__ is not Model.__call__:
        return "its architecture has a forward pass of its own"
    if model.embed_scale or model._final_softcap is not None:
        return "it scales its embeddings or caps its output"
    if type(model.model.norm) is not nn.RMSNorm:
        return "its final norm is not a plain RMSNorm"
    for i, layer in enumerate(model.layers):
        a, m = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if type(layer) is not DecoderLayer or type(a) is not Attention or type(m) is not MLP:
            return f"layer {i} is not a plain decoder layer"
        if layer._sandwich or a._gated or a._qk_norm or a.window is not None or a.softcap is not None:
            return f"layer {i}'s attention has options the int8 pass does not"
        if type(a.rope) is not RoPE:
            return f"layer {i} has no plain RoPE"
        r, r0 = a.rope, model.layers[0].self_attn.rope
        if (r.dims, r.traditional, r.base, r.scale) != (r0.dims, r0.traditional, r0.base, r0.scale) \
                or (r._freqs is None) != (r0._freqs is None) \
                or (r._freqs is not None and not mx.array_equal(r._freqs, r0._freqs).item()):
            return "its layers' RoPE settings differ"
        if m._act != "silu":
            return f"layer {i}'s activation is {m._act}"
        if type(layer.input_layernorm) is not nn.RMSNorm or type(layer.post_attention_layernorm) is not nn.RMSNorm:
            return f"layer {i}'s norms are not plain RMSNorms"
        for lin in (a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj):
            params = lin.parameters()
            if "bias" in params or "scales" in params:
                return f"layer {i} has a bias or quantized weights"
    head = model.model.embed_tokens if model.args.tie_word_embeddings else model.lm_head
    if "scales" in head.parameters() or "scales" in model.model.embed_tokens.parameters():
        return "its embedding or output projection is quantized"
    return None


def available(model, as_metal: bool = False) -> str | None:
    """Why the int8 drafter cannot draft for `model` here, or None when it can. `as_metal`: the
    model runs in Metal's numerics (edgespec.weights.numerics), where it is refused as on a Mac."""
    if as_metal or mx.default_device().type != mx.DeviceType.cpu:
        return "it drafts on the CPU device only (on Metal, MLX's quantized products are the tool)"
    why = unsupported(model)
    if why is not None:
        return why
    if q8.library() is None:
        return "its native kernel cannot be built on this machine"
    return None


def quantize_model(model) -> q8.Q8Model:
    """The int8 copy of `model`'s products (checked by `unsupported` first)."""
    why = unsupported(model)
    if why is not None:
        raise ValueError(f"the int8 drafter cannot run this model: {why}")
    layers = []
    for layer in model.layers:
        a, m = layer.self_attn, layer.mlp
        qkv = q8.quantize_rows(np.concatenate([_numpy(a.q_proj.weight), _numpy(a.k_proj.weight),
                                               _numpy(a.v_proj.weight)]))
        gu = q8.quantize_rows(np.concatenate([_numpy(m.gate_proj.weight), _numpy(m.up_proj.weight)]))
        layers.append(q8.Q8Layer(*qkv, *q8.quantize_rows(_numpy(a.o_proj.weight)), *gu,
                                 *q8.quantize_rows(_numpy(m.down_proj.weight)),
                                 np.array(_numpy(layer.input_layernorm.weight)),
                                 np.array(_numpy(layer.post_attention_layernorm.weight))))
    args, attn = model.args, model.layers[0].self_attn
    head_w = model.model.embed_tokens.weight if args.tie_word_embeddings else model.lm_head.weight
    return q8.Q8Model(layers, *q8.quantize_rows(_numpy(head_w)), np.array(_numpy(model.model.norm.weight)),
                      _numpy(model.model.embed_tokens.weight),
                      dims=(args.hidden_size, args.num_attention_heads, args.num_key_value_heads, args.head_dim,
                            args.intermediate_size),
                      rot=attn.rope.dims, traditional=attn.rope.traditional,
                      eps=layer.input_layernorm.eps, scale=attn.scale)


class QuantizedDrafter(ReadsVerifierCache):
    """Drafts with the verifier's own weights in int8 over the verifier's cache (module notes)."""

    caps = DrafterCaps(reads="verifier_cache", forks=True, runs_on="host", modes=CHAIN_MODES, ahead=True)
    expected_acceptance = 0.9  # before any is measured (98% agreement teacher-forced, SmolLM2)

    def __init__(self, verifier, weights: q8.Q8Model, name: str = NAME):
        self.verifier, self.weights, self.name = verifier, weights, name
        self.device = "cpu"
        self.vocab_size = int(verifier.args.vocab_size)
        self.rope = verifier.layers[0].self_attn.rope
        self.cache = None
        self.seq: list[int] = []
        self._last_draft: list[int] = []
        self._scratch: tuple[np.ndarray, np.ndarray] | None = None
        self._pinned = None  # the verified context `pin` read, for the next draft (drafting ahead)

    @property
    def host_bytes(self) -> int:
        return self.weights.nbytes

    def fork(self) -> QuantizedDrafter:
        """This drafter for one request: the same int8 weights, a cache binding, committed
        sequence and scratch of its own."""
        twin = copy.copy(self)
        twin.cache, twin.seq, twin._last_draft, twin._scratch, twin._pinned = None, [], [], None, None
        return twin

    def _context(self):
        """(per layer (keys, values) numpy (Hk, n, D), n) from the verifier cache, or None where
        it cannot be read (no cache, another layer count, no state, half precision)."""
        p = len(self.seq) - 1
        cache = self.cache
        if cache is None or p < 1 or len(cache) != self.weights.L:
            return None
        n = min(int(cache[0].offset), p)
        states = []
        for c in cache:
            if int(c.offset) < n:
                return None
            state = c.state  # what the verifier attends to (a quantized cache's, dequantized)
            if state is None or state[0].dtype != mx.float32 or state[0].shape[0] != 1:
                return None
            states.append(state)
        mx.eval([s for pair in states for s in pair])
        ctx = []
        for k, v in states:
            kn, vn = np.asarray(k)[0], np.asarray(v)[0]
            if kn.strides[-1] != 4 or kn.strides != vn.strides:
                return None
            ctx.append((kn, vn))
        return ctx, n

    def _rope(self, start: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        table = rope_table(self.rope, start + n)
        return _numpy(table[0][start : start + n]), _numpy(table[1][start : start + n])

    def pin(self, uses: int = 1) -> None:
        """Read the verifier cache's verified positions now (the committed sequence synced
        first), for the next `uses` drafts, made while the verifier's next pass changes the
        cache (drafting ahead, `DrafterCaps.ahead`; two: the runner-up premise's too): each
        feeds every token after them, its premise included, into the scratch (SCRATCH
        positions in all). The pass writes only positions after the pinned ones (its tree,
        then the accepted path packed in place)."""
        self._pinned = (self._context(), max(int(uses), 1))  # (None, n): unreadable now, no draft then

    # ------------------------------------------------------------- protocol
    def draft(self, k: int, sampler) -> Draft:
        pinned = self._pinned
        if pinned is not None:
            self._pinned = (pinned[0], pinned[1] - 1) if pinned[1] > 1 else None
        got = (pinned[0] if pinned is not None else self._context()) if k >= 1 else None
        if got is None:
            return self._no_draft()
        ctx, n = got
        feed = self.seq[n:]  # the committed tokens after the verifier's cache (usually the last one)
        k = min(k, SCRATCH - len(feed))
        if k < 1:
            return self._no_draft()
        if self._scratch is None:
            self._scratch = self.weights.scratch(SCRATCH)
        toks, rows, n_scr = [], [], 0
        for _ in range(k):
            logits = self.weights.forward(feed, ctx, n, self._scratch, n_scr, self._rope(n + n_scr, len(feed)))
            n_scr += len(feed)
            lp = sampler.logprobs(mx.array(logits[-1][: self.vocab_size]))
            t = sampler.sample(lp)
            toks.append(t)
            rows.append(lp)
            feed = [int(t.item())]
        return self._finish(toks, rows)

    @classmethod
    def load(cls, verifier) -> QuantizedDrafter:
        """For `verifier` (an Engine or LoadedModel); ModelLoadError where `available` says no."""
        model = getattr(getattr(verifier, "loaded", verifier), "model", verifier)
        why = available(model, as_metal=runs_as_metal(verifier))
        if why is not None:
            raise ModelLoadError(f"drafter 'int8' cannot draft for this model: {why}")
        return cls(model, quantize_model(model))
