"""Export Qwen3.5's MTP head (models/qwen3_5.MTPHead) to a stateful Core ML package.

    write_mtp_drafter(bundle_tmp, model, vocab_hash)   # `edgespec convert SRC OUT --drafter mtp`
    export_mtp(model, "drafter.mlpackage", context_length=1024)

The head drafts from the verifier's hidden state, so, unlike the other exported drafters, its
functions take that state as an input and return the head's own (the next draft step's input):

    inputs:  input_ids (1, T) int32     x_{t+1} of each entry
             hidden (1, E, 1, T) fp16   the verifier's final-norm hidden state h_t (or the head's own)
             position (1,) int32        cache slot (= RoPE position t) of the first entry
    states:  key_cache, value_cache (1, Hk, D, C) fp16   the head's attention layer
    outputs: logits (1, V, 1, T_out) fp16, hidden_out (1, E, 1, T_out) fp16

Functions: `decode` (T = 1), `decode_K` for each K of `decode_tokens` (the entries a round
adds: accepted drafts + the bonus token) and `prefill` (T = prefill_chunk, last entry only).
The graph follows the feature-free drafter's layout and choices (converters/coreml_program.py:
channels-first activations, 1x1 convs, fp32 RMSNorm reductions, in-graph mask from
`position`), with Qwen3.5's differences: (1 + w) norms (folded into the stored weights),
per-head q/k norms (the 1/sqrt(D) attention scale folded into q's), partial rotate-half RoPE
on the first `rope dims` of each head, the per-head output gate out * sigmoid(gate), and the
fc over [normed embedding; normed hidden] in front. The embedding table and the output head
are the verifier's (one constant when tied).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from edgespec.converters.coreml_export import (
    add_function,
    finish_package,
    package_staging,
    package_target,
)
from edgespec.converters.coreml_program import MASK_VALUE, _linear, _rms_norm, _rope, rope_tables

from edgespec.errors import ModelLoadError
from edgespec.weights.loader import load_model_folder

KIND = "mtp"
PACKAGE_FORMAT = 1


@dataclass(frozen=True)
class HeadShape:
    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rope_dims: int
    vocab: int
    context: int
    eps: float
    tied: bool

    @property
    def cache_shape(self) -> tuple[int, int, int, int]:
        return (1, self.n_kv_heads, self.head_dim, self.context)


def _dense(module) -> np.ndarray:
    """A Linear / Embedding's weight as float32 numpy (dequantized when quantized)."""
    w = module.weight
    if hasattr(module, "scales"):
        w = mx.dequantize(w, module.scales, getattr(module, "biases", None), module.group_size, module.bits)
    return np.array(w.astype(mx.float32))


def head_shape(model, context_length: int) -> HeadShape:
    head = getattr(model, "mtp", None)
    if head is None:
        raise ModelLoadError(f"the verifier ({model.args.model_type}) carries no MTP head (mtp.* weights) to export")
    if len(head.layers) != 1:
        raise ModelLoadError(f"the Core ML export takes an MTP head of one layer, this one has {len(head.layers)}")
    a, attn = model.args, head.layers[0].self_attn
    rope = attn.rope
    if rope.traditional or type(rope).__name__ != "RoPE" or rope.scale != 1.0 or rope._freqs is not None:
        raise ModelLoadError("the MTP head's Core ML export supports plain (default) rotate-half RoPE only")
    return HeadShape(hidden=a.hidden_size, n_heads=attn.n_heads, n_kv_heads=attn.n_kv_heads,
                     head_dim=attn.head_dim, rope_dims=rope.dims, vocab=a.vocab_size, context=context_length,
                     eps=float(a.rms_norm_eps), tied=bool(a.tie_word_embeddings))


def prepare_weights(model, shape: HeadShape) -> dict[str, np.ndarray]:
    """float32 numpy weights named for the graph: (1 + w) norms, q/gate rows split, scale folded."""
    head, layer = model.mtp, model.mtp.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    H, D = shape.n_heads, shape.head_dim

    def norm(m) -> np.ndarray:  # OffsetRMSNorm: applied as (1 + w)
        return 1.0 + np.array(m.weight.astype(mx.float32))

    qg = _dense(attn.q_proj).reshape(H, 2 * D, -1)  # per head: [q (D), gate (D)] rows
    inv = 1.0 / (float(attn.rope.base) ** (np.arange(0, shape.rope_dims, 2) / shape.rope_dims))
    cos, sin = rope_tables(shape.rope_dims, shape.context, inv, 1.0)
    w = {
        "embed": _dense(model.model.embed_tokens),
        "norm_e": norm(head.pre_fc_norm_embedding), "norm_h": norm(head.pre_fc_norm_hidden),
        "fc": _dense(head.fc), "ln1": norm(layer.input_layernorm), "ln2": norm(layer.post_attention_layernorm),
        "q": qg[:, :D].reshape(H * D, -1), "gate": qg[:, D:].reshape(H * D, -1),
        "k": _dense(attn.k_proj), "v": _dense(attn.v_proj), "o": _dense(attn.o_proj),
        "q_norm": norm(attn.q_norm) * attn.scale,  # the attention scale, folded in
        "k_norm": norm(attn.k_norm),
        "up": _dense(mlp.up_proj), "gate_proj": _dense(mlp.gate_proj), "down": _dense(mlp.down_proj),
        "final": norm(head.norm), "rope_cos": cos, "rope_sin": sin,
    }
    for name in ("q_proj", "k_proj", "v_proj"):
        if getattr(attn, name).get("bias") is not None:
            raise ModelLoadError(f"the MTP head's {name} has a bias; the Core ML export does not take one")
    if not shape.tied:
        w["lm_head"] = _dense(model.lm_head)
    return w


def _head_norm(mb, x, weight: np.ndarray, eps: float, name: str):
    """Per-head RMSNorm of x (heads, D, T) fp16 over D (fp32 reduction) times weight (D,)."""
    x32 = mb.cast(x=x, dtype="fp32", name=f"{name}_x32")
    ms = mb.reduce_mean(x=mb.mul(x=x32, y=x32, name=f"{name}_sq"), axes=[1], keep_dims=True, name=f"{name}_ms")
    y = mb.mul(x=x32, y=mb.rsqrt(x=ms, epsilon=np.float32(eps), name=f"{name}_rsqrt"), name=f"{name}_n32")
    y = mb.cast(x=y, dtype="fp16", name=f"{name}_n")
    return mb.mul(x=y, y=weight.astype(np.float16).reshape(1, -1, 1), name=f"{name}_out")


def _partial_rope(mb, x, cos, sin, shape: HeadShape, name: str):
    """Rotate-half RoPE on the first rope_dims of axis 1 of x (heads, D, T); the rest passes."""
    R, D = shape.rope_dims, shape.head_dim
    if R == D:
        return _rope(mb, x, cos, sin, 1, name)
    rot, rest = mb.split(x=x, split_sizes=[R, D - R], axis=1, name=f"{name}_part")
    return mb.concat(values=[_rope(mb, rot, cos, sin, 1, name), rest], axis=1, name=f"{name}_all")


def build_function(mb, types, shape: HeadShape, w: dict[str, np.ndarray], T: int, last_only: bool, opset):
    E, H, Hk, D, C = shape.hidden, shape.n_heads, shape.n_kv_heads, shape.head_dim, shape.context
    g = H // Hk
    specs = [
        mb.TensorSpec(shape=(1, T), dtype=types.int32),
        mb.TensorSpec(shape=(1, E, 1, T), dtype=types.fp16),
        mb.TensorSpec(shape=(1,), dtype=types.int32),
        mb.StateTensorSpec(shape=shape.cache_shape, dtype=types.fp16),
        mb.StateTensorSpec(shape=shape.cache_shape, dtype=types.fp16),
    ]

    @mb.program(input_specs=specs, opset_version=opset)
    def prog(input_ids, hidden, position, key_cache, value_cache):
        emb_w = mb.const(val=w["embed"].astype(np.float16), name="embed_weight")
        e = mb.gather(x=emb_w, indices=mb.reshape(x=input_ids, shape=[T], name="ids"), axis=0, name="embed")
        e = mb.reshape(x=mb.transpose(x=e, perm=[1, 0], name="embed_t"), shape=[1, E, 1, T], name="e_in")
        e = _rms_norm(mb, e, w["norm_e"], shape.eps, "norm_e")
        hh = _rms_norm(mb, hidden, w["norm_h"], shape.eps, "norm_h")
        x = mb.concat(values=[e, hh], axis=1, name="eh")  # (1, 2E, 1, T): embedding first
        h = _linear(mb, x, w["fc"], None, "fc")  # (1, E, 1, T)

        qpos = mb.add(x=position, y=np.arange(T, dtype=np.int32), name="qpos")
        diff = mb.sub(x=np.arange(C, dtype=np.int32).reshape(1, C), y=mb.reshape(x=qpos, shape=[T, 1]),
                      name="mask_diff")
        mask = mb.mul(x=mb.cast(x=mb.greater(x=diff, y=np.int32(0)), dtype="fp16", name="mask_future"),
                      y=np.float16(MASK_VALUE), name="mask")  # (T, C)
        cos = mb.cast(x=mb.gather(x=w["rope_cos"], indices=qpos, axis=1, name="rope_cos32"), dtype="fp16",
                      name="rope_cos")  # (R/2, T)
        sin = mb.cast(x=mb.gather(x=w["rope_sin"], indices=qpos, axis=1, name="rope_sin32"), dtype="fp16",
                      name="rope_sin")

        kc = mb.read_state(input=key_cache, name="key_cache_in")  # (1, Hk, D, C)
        vc = mb.read_state(input=value_cache, name="value_cache_in")
        x = _rms_norm(mb, h, w["ln1"], shape.eps, "ln1")
        q = _head_norm(mb, mb.reshape(x=_linear(mb, x, w["q"], None, "q"), shape=[H, D, T]), w["q_norm"],
                       shape.eps, "q_norm")
        k = _head_norm(mb, mb.reshape(x=_linear(mb, x, w["k"], None, "k"), shape=[Hk, D, T]), w["k_norm"],
                       shape.eps, "k_norm")
        q = mb.reshape(x=_partial_rope(mb, q, cos, sin, shape, "q_rope"), shape=[Hk, g, D, T])
        k = mb.reshape(x=_partial_rope(mb, k, cos, sin, shape, "k_rope"), shape=[1, Hk, D, T])
        v = mb.reshape(x=_linear(mb, x, w["v"], None, "v"), shape=[1, Hk, D, T], name="v4")
        begin = mb.concat(values=[np.array([0, 0, 0], np.int32), position], axis=0, name="slot_begin")
        end = mb.concat(values=[np.array([1, Hk, D], np.int32), mb.add(x=position, y=np.int32(T))], axis=0,
                        name="slot_end")
        kc = mb.slice_update(x=kc, update=k, begin=begin, end=end, name="kc")
        vc = mb.slice_update(x=vc, update=v, begin=begin, end=end, name="vc")
        K = mb.reshape(x=kc, shape=[Hk, 1, D, C])
        V = mb.reshape(x=vc, shape=[Hk, 1, D, C])
        s = mb.add(x=mb.matmul(x=q, y=K, transpose_x=True, name="scores"), y=mask, name="masked")  # (Hk, g, T, C)
        o = mb.matmul(x=V, y=mb.softmax(x=s, axis=-1, name="probs"), transpose_y=True, name="attn")  # (Hk, g, D, T)
        o = mb.reshape(x=o, shape=[1, H * D, 1, T])
        o = mb.mul(x=o, y=mb.sigmoid(x=_linear(mb, x, w["gate"], None, "gate"), name="gate_sig"), name="gated")
        h = mb.add(x=h, y=_linear(mb, o, w["o"], None, "o"), name="res1")
        x = _rms_norm(mb, h, w["ln2"], shape.eps, "ln2")
        act = mb.mul(x=mb.silu(x=_linear(mb, x, w["gate_proj"], None, "mlp_gate")),
                     y=_linear(mb, x, w["up"], None, "mlp_up"), name="act")
        h = mb.add(x=h, y=_linear(mb, act, w["down"], None, "down"), name="res2")
        mb.coreml_update_state(state=key_cache, value=kc, name="key_cache_out")
        mb.coreml_update_state(state=value_cache, value=vc, name="value_cache_out")

        t_out = T
        if last_only and T > 1:
            h = mb.slice_by_index(x=h, begin=[0, 0, 0, T - 1], end=[1, E, 1, T], name="h_last")
            t_out = 1
        h = _rms_norm(mb, h, w["final"], shape.eps, "final_norm")
        if shape.tied:
            logits = mb.matmul(x=emb_w, y=mb.reshape(x=h, shape=[E, t_out], name="h_flat"), name="head")
            logits = mb.reshape(x=logits, shape=[1, shape.vocab, 1, t_out], name="logits")
        else:
            logits = _linear(mb, h, w["lm_head"], None, "logits")
        return logits, mb.identity(x=h, name="hidden_out")

    return prog


def function_specs(prefill_chunk: int, decode_tokens: tuple[int, ...]) -> dict[str, tuple[int, bool]]:
    specs = {"prefill": (prefill_chunk, True)}
    for k in sorted(set(decode_tokens) | {1}):
        specs["decode" if k == 1 else f"decode_{k}"] = (k, False)
    return specs


def export_mtp(model, out: str | Path, context_length: int = 1024, prefill_chunk: int = 64,
               decode_tokens: tuple[int, ...] = (1, 2, 3, 4, 5), vocab_hash: str | None = None,
               force: bool = False) -> dict[str, Any]:
    """Write `out` (.mlpackage) atomically from the verifier `model`'s MTP head; returns its info."""
    out = package_target(out, force, context_length, prefill_chunk)
    if any(k < 1 or k > context_length for k in decode_tokens):
        raise ValueError(f"decode token counts must be in 1..{context_length}, got {decode_tokens}")
    shape = head_shape(model, context_length)
    weights = prepare_weights(model, shape)

    # coremltools is heavy and optional (the convert extra): imported only when a package is built or read
    import coremltools as ct  # optional: coremltools
    from coremltools.converters.mil import Builder as mb  # optional: coremltools
    from coremltools.converters.mil.mil import types  # optional: coremltools

    specs = function_specs(prefill_chunk, decode_tokens)
    with package_staging(out, force) as work:
        desc = ct.utils.MultiFunctionDescriptor()
        for name, (T, last_only) in specs.items():
            add_function(ct, desc, build_function(mb, types, shape, weights, T, last_only, ct.target.iOS18), work, name)
        info = {
            "kind": KIND,
            "package": out.name,
            "package_format": PACKAGE_FORMAT,
            "context_length": context_length,
            "prefill_chunk": prefill_chunk,
            "decode_tokens": sorted(set(decode_tokens) | {1}),
            "functions": list(specs),
            "compression": "none",
            "precision": "float16",
            "deployment_target": "iOS18/macOS15",
            "vocab_size": shape.vocab,
            "vocab_hash": vocab_hash,
            "hidden_size": shape.hidden,
            "num_layers": 1,
        }
        finish_package(ct, desc, "decode", work, info, out, force)
    return info


def write_mtp_drafter(folder: Path, vocab_hash: str, coreml: bool = True, compress: str = "none",
                      context_length: int = 1024, prefill_chunk: int = 64) -> dict[str, Any]:
    """The manifest's `drafter` entry for the bundle being written in `folder` (its verifier files
    already there) whose verifier carries its MTP head (the head's weights are the verifier's own,
    in model.safetensors); with `coreml`, drafter.mlpackage too."""
    model = load_model_folder(folder)
    if getattr(model, "mtp", None) is None:
        raise ModelLoadError(f"--drafter mtp: the source ({model.args.model_type}) carries no MTP head "
                             "(mtp.* weights)")
    if compress != "none":
        raise ValueError("--drafter-compress is not implemented for the MTP head's Core ML package; "
                         "use --drafter-compress none")
    entry = {"kind": KIND, "num_layers": 1, "vocab_hash": vocab_hash, "source": {"name": "mtp"}, "coreml": None}
    if coreml:
        try:
            import coremltools  # noqa: F401
        except ImportError:
            raise ModelLoadError("exporting the MTP head to Core ML needs coremltools (pip install "
                                 "'edgespec[convert]'); or pass --no-coreml") from None
        entry["coreml"] = export_mtp(model, folder / "drafter.mlpackage", context_length=context_length,
                                     prefill_chunk=prefill_chunk, vocab_hash=vocab_hash)
    return entry
