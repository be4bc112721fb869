"""An EAGLE-3 head (models/eagle3.py) as a stateful, multifunction Core ML package for the Neural Engine.

    export_eagle3(model, "drafter.mlpackage", context_length=1024) -> info dict (manifest drafter.coreml)

The head's keys and values are the package's state, one fixed buffer of C slots per layer:

    key_cache, value_cache: fp16 (layers, Hk, D, C)     slot j holds head entry j (RoPE position j + 1)

Functions (one weight file; all read and write the same state):
    feed_S   S entries appended at slot `position` (S in `feed_sizes`): inputs `embedding`
             (1, E, 1, S) fp16, the embeddings of the tokens at j + 1, `features` (1, n*Et, 1, S)
             fp16, the verifier's aux-layer states at j (fused by the package: fc and its norms),
             `position` (1,) int32 = the entries already held.
    draft    one drafted step: `embedding` (1, E, 1, 1), `hidden` (1, E, 1, 1) the state the last
             step returned, `position` (1,) int32.
Both return `logits` (1, Vd, 1, 1) fp16 over the head's draft vocabulary, after the last entry,
and `hidden_out` (1, E, 1, 1) fp16, the state the next step reads (norm(h) with norm_output).

Entry t of a call sees slots j <= position + t, so rolling back is passing a smaller `position`:
later writes overwrite the stale slots, which the mask hides until then. The tokens enter as
embedding rows, as Gemma 4's assistant package takes them: the table (the verifier's, or the
folder's own) is the head's largest tensor and stays with the runtime, which has it already. The
d2t map stays on the host too (edgespec.drafters.eagle3.Eagle3Drafter.full_logits), as the
reduced-vocabulary drafters' maps do: the package's logits are over the draft vocabulary.

Layout and precision as converters/coreml_program.py: channels-first (1, C, 1, T) activations,
linear layers as 1x1 convs, fp16 with the norms' mean of squares in fp32; the attention scale
folded into q_proj (or, with q/k norms, into q_norm). coremltools is imported only at export time.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from edgespec.converters.coreml_compress import compress_linear
from edgespec.converters.coreml_export import (
    COMPRESS_CHOICES,
    add_function,
    finish_package,
    package_staging,
    package_target,
)
from edgespec.converters.coreml_program import MASK_VALUE, _linear, _rms_norm, _rope, rope_tables
from edgespec.converters.mtp_export import _dense, _head_norm
from edgespec.models.base import LongRoPE

from edgespec.drafters.eagle3_coreml import EAGLE3_PACKAGE, FEED_SIZES
from edgespec.errors import ModelLoadError

PACKAGE_FORMAT = 1


def check_exportable(model) -> None:
    """Refuse, by name, what the package's graph does not express."""
    a = model.args
    rope = model.layers[0].self_attn.rope
    why = None
    if isinstance(rope, LongRoPE):
        why = "LongRoPE scaling"
    elif a.rope_traditional or getattr(rope, "dims", a.head_dim) != a.head_dim:
        why = "partial or traditional RoPE"
    elif a.attention_bias or a.mlp_bias:
        why = "biases"
    if why:
        raise ModelLoadError(f"the EAGLE-3 head's Core ML export does not take {why}; it drafts in MLX")


def prepare_weights(model, context: int) -> dict[str, Any]:
    """float32 numpy weights for the graph; the attention scale folded into q (or q_norm); RoPE
    tables for positions 0..C (entry j sits at j + 1)."""
    a = model.args

    def vec(x) -> np.ndarray:
        return np.array(x.astype(mx.float32))

    w: dict[str, Any] = {"fc": _dense(model.fc), "norm": vec(model.norm.weight), "lm_head": _dense(model.lm_head)}
    if a.norm_before_fc:
        w["input_norm"] = vec(model.input_norm.weight)
    if a.fc_norm:
        for i, n in enumerate(model.fc_norm):
            w[f"fc_norm.{i}"] = vec(n.weight)
    for i, layer in enumerate(model.layers):
        at, mlp, p = layer.self_attn, layer.mlp, f"l{i}."
        scale = np.float32(at.scale)
        w.update({p + "ln1": vec(layer.input_layernorm.weight), p + "ln2": vec(layer.post_attention_layernorm.weight),
                  p + "q": _dense(at.q_proj) * (1.0 if at.qk_norm else scale), p + "k": _dense(at.k_proj),
                  p + "v": _dense(at.v_proj), p + "o": _dense(at.o_proj), p + "gate": _dense(mlp.gate_proj),
                  p + "up": _dense(mlp.up_proj), p + "down": _dense(mlp.down_proj)})
        if at.qk_norm:
            w[p + "q_norm"] = vec(at.q_norm.weight) * scale
            w[p + "k_norm"] = vec(at.k_norm.weight)
        if i == 0:
            w["hidden_norm"] = vec(layer.hidden_norm.weight)
    rope = model.layers[0].self_attn.rope
    D = a.head_dim
    if rope._freqs is not None:  # scaled RoPE (llama3, yarn...): its periods, inf where unrotated
        inv = 1.0 / np.asarray(rope._freqs, np.float64)
    else:
        inv = 1.0 / (float(rope.base) ** (np.arange(0, D, 2) / D))
    w["rope_cos"], w["rope_sin"] = rope_tables(D, context + 1, inv, rope.scale)
    return w


def linear_weights(model) -> list[str]:
    """The weights compression packs: fc and every layer's projections (lm_head and norms stay fp16)."""
    return ["fc"] + [f"l{i}.{n}" for i in range(len(model.layers))
                     for n in ("q", "k", "v", "o", "gate", "up", "down")]


def build_function(mb, types, args, w: dict, context: int, S: int, fused: bool, opset):
    """One function: S entries at `position` (see the module doc); fused: the step's `hidden`
    (E wide, the head's own state) in place of the verifier's `features`."""
    E, H, Hk, D, C = args.hidden_size, args.num_attention_heads, args.num_key_value_heads, args.head_dim, context
    g, NL, F = H // Hk, args.num_hidden_layers, args.num_aux * args.target_hidden_size
    eps, Vd = float(args.rms_norm_eps), args.draft_vocab_size
    qk_norm = args.layer_type == "qwen3"
    specs = [mb.TensorSpec(shape=(1, E, 1, S), dtype=types.fp16),
             mb.TensorSpec(shape=(1, E if fused else F, 1, S), dtype=types.fp16),
             mb.TensorSpec(shape=(1,), dtype=types.int32),
             mb.StateTensorSpec(shape=(NL, Hk, D, C), dtype=types.fp16),
             mb.StateTensorSpec(shape=(NL, Hk, D, C), dtype=types.fp16)]

    def body(embedding, states, position, key_cache, value_cache):
        if fused:
            gst = states
        else:
            x = states
            if args.norm_before_fc:
                x = _rms_norm(mb, x, w["input_norm"], eps, "input_norm")
            elif args.fc_norm:
                n, Et = args.num_aux, args.target_hidden_size
                parts = mb.split(x=x, num_splits=n, axis=1, name="fc_parts")
                x = mb.concat(values=[_rms_norm(mb, parts[i], w[f"fc_norm.{i}"], eps, f"fc_norm{i}")
                                      for i in range(n)], axis=1, name="fc_normed")
                assert n * Et == F
            gst = _linear(mb, x, w["fc"], None, "fc")
        ent = mb.add(x=position, y=np.arange(S, dtype=np.int32), name="entries")  # (S,) slots written
        rpos = mb.add(x=ent, y=np.int32(1), name="rope_pos")  # entry j at RoPE position j + 1
        cos = mb.cast(x=mb.gather(x=w["rope_cos"], indices=rpos, axis=1, name="rope_cos32"), dtype="fp16",
                      name="rope_cos")
        sin = mb.cast(x=mb.gather(x=w["rope_sin"], indices=rpos, axis=1, name="rope_sin32"), dtype="fp16",
                      name="rope_sin")
        diff = mb.sub(x=np.arange(C, dtype=np.int32).reshape(1, C), y=mb.reshape(x=ent, shape=[S, 1]),
                      name="mask_diff")
        mask = mb.mul(x=mb.cast(x=mb.greater(x=diff, y=np.int32(0)), dtype="fp16", name="mask_future"),
                      y=np.float16(MASK_VALUE), name="mask")  # (S, C): slot j seen by entry t iff j <= position + t
        end = mb.add(x=position, y=np.int32(S), name="end_pos")
        kc = mb.read_state(input=key_cache, name="key_cache_in")
        vc = mb.read_state(input=value_cache, name="value_cache_in")
        h = None
        for i in range(NL):
            p, n = f"l{i}.", f"l{i}"
            if i == 0:
                r = _rms_norm(mb, gst, w["hidden_norm"], eps, "hidden_norm")
                x = mb.concat(values=[_rms_norm(mb, embedding, w[p + "ln1"], eps, f"{n}_ln1"), r], axis=1,
                              name=f"{n}_in")  # (1, 2E, 1, S)
                h = r if args.norm_before_residual else gst
            else:
                x = _rms_norm(mb, h, w[p + "ln1"], eps, f"{n}_ln1")
            q = mb.reshape(x=_linear(mb, x, w[p + "q"], None, f"{n}_q"), shape=[H, D, S], name=f"{n}_q3")
            k = mb.reshape(x=_linear(mb, x, w[p + "k"], None, f"{n}_k"), shape=[Hk, D, S], name=f"{n}_k3")
            if qk_norm:
                q = _head_norm(mb, q, w[p + "q_norm"], eps, f"{n}_qn")
                k = _head_norm(mb, k, w[p + "k_norm"], eps, f"{n}_kn")
            q = _rope(mb, mb.reshape(x=q, shape=[Hk, g, D, S], name=f"{n}_q4"), cos, sin, 2, f"{n}_qrope")
            k = _rope(mb, mb.reshape(x=k, shape=[1, Hk, D, S], name=f"{n}_k4"), cos, sin, 2, f"{n}_krope")
            v = mb.reshape(x=_linear(mb, x, w[p + "v"], None, f"{n}_v"), shape=[1, Hk, D, S], name=f"{n}_v4")
            begin = mb.concat(values=[np.array([i, 0, 0], np.int32), position], axis=0, name=f"{n}_begin")
            stop = mb.concat(values=[np.array([i + 1, Hk, D], np.int32), end], axis=0, name=f"{n}_stop")
            kc = mb.slice_update(x=kc, update=k, begin=begin, end=stop, name=f"{n}_kc")
            vc = mb.slice_update(x=vc, update=v, begin=begin, end=stop, name=f"{n}_vc")
            lo, hi = np.array([i, 0, 0, 0], np.int32), np.array([i + 1, Hk, D, C], np.int32)
            K = mb.reshape(x=mb.slice_by_index(x=kc, begin=lo, end=hi, name=f"{n}_K"), shape=[Hk, 1, D, C],
                           name=f"{n}_K4")
            V = mb.reshape(x=mb.slice_by_index(x=vc, begin=lo, end=hi, name=f"{n}_V"), shape=[Hk, 1, D, C],
                           name=f"{n}_V4")
            s = mb.add(x=mb.matmul(x=q, y=K, transpose_x=True, name=f"{n}_scores"), y=mask, name=f"{n}_masked")
            o = mb.matmul(x=V, y=mb.softmax(x=s, axis=-1, name=f"{n}_probs"), transpose_y=True, name=f"{n}_attn")
            o = _linear(mb, mb.reshape(x=o, shape=[1, H * D, 1, S], name=f"{n}_o4"), w[p + "o"], None, f"{n}_o")
            h = mb.add(x=h, y=o, name=f"{n}_res1")
            x = _rms_norm(mb, h, w[p + "ln2"], eps, f"{n}_ln2")
            act = mb.mul(x=mb.silu(x=_linear(mb, x, w[p + "gate"], None, f"{n}_gate"), name=f"{n}_silu"),
                         y=_linear(mb, x, w[p + "up"], None, f"{n}_up"), name=f"{n}_act")
            h = mb.add(x=h, y=_linear(mb, act, w[p + "down"], None, f"{n}_down"), name=f"{n}_res2")
        mb.coreml_update_state(state=key_cache, value=kc, name="key_cache_out")
        mb.coreml_update_state(state=value_cache, value=vc, name="value_cache_out")
        last = h if S == 1 else mb.slice_by_index(x=h, begin=[0, 0, 0, S - 1], end=[1, E, 1, S], name="h_last")
        normed = _rms_norm(mb, last, w["norm"], eps, "final_norm")
        logits = _linear(mb, normed, w["lm_head"], None, "head")
        assert logits.shape[1] == Vd
        return (mb.identity(x=logits, name="logits"),
                mb.identity(x=normed if args.norm_output else last, name="hidden_out"))

    names = ["embedding", "hidden" if fused else "features", "position", "key_cache", "value_cache"]
    return _program(mb, specs, names, body, opset)


def _program(mb, specs, names, body, opset):
    """A one-function MIL program whose inputs are named `names` (`hidden` or `features`)."""
    # coremltools is heavy and optional (the convert extra): imported only when a package is built or read
    from coremltools.converters.mil.mil import Function, Program  # optional: coremltools

    with Function(dict(zip(names, specs, strict=True)), opset) as func:
        func.set_outputs(list(body(*[func.inputs[n] for n in names])))
    prog = Program()
    prog.add_function("main", func)
    return prog


def function_names(sizes: list[int]) -> list[str]:
    return ["draft", *[f"feed_{s}" for s in sizes]]


def export_eagle3(model, out: str | Path, context_length: int = 1024, prefill_chunk: int = 64,
                  vocab_hash: str | None = None, compress: str = "none", force: bool = False) -> dict[str, Any]:
    """Write `out` (.mlpackage) atomically from a models.eagle3.Model; its info (the manifest's
    drafter.coreml). context_length C: the head's entries the package holds (it drafts while the
    committed sequence and the chain fit); feed sizes: FEED_SIZES and `prefill_chunk`. compress: fc
    and the layers' projections packed as converters/coreml_compress.py does (plain rounding);
    lm_head and the norms stay fp16."""
    out = package_target(out, force, context_length, prefill_chunk)
    if compress not in COMPRESS_CHOICES:
        raise ValueError(f"--drafter-compress must be one of {', '.join(COMPRESS_CHOICES)}, got {compress!r}")
    check_exportable(model)
    args = model.args
    weights = prepare_weights(model, context_length)
    if compress != "none":
        for name in linear_weights(model):  # once: every function refers to the same blobs
            weights[name] = compress_linear(weights[name], compress)

    import coremltools as ct  # optional: coremltools
    from coremltools.converters.mil import Builder as mb  # optional: coremltools
    from coremltools.converters.mil.mil import types  # optional: coremltools

    sizes = sorted({s for s in FEED_SIZES if s <= context_length} | {prefill_chunk})
    names = function_names(sizes)
    with package_staging(out, force) as work:
        desc = ct.utils.MultiFunctionDescriptor()
        for name in names:
            fused = name == "draft"
            S = 1 if fused else int(name.split("_")[1])
            add_function(ct, desc, build_function(mb, types, args, weights, context_length, S, fused, ct.target.iOS18),
                         work, name)
        info = {"kind": EAGLE3_PACKAGE, "package": out.name, "package_format": PACKAGE_FORMAT,
                "context_length": context_length, "feed_sizes": sizes, "functions": names,
                "hidden_size": args.hidden_size, "features": args.num_aux * args.target_hidden_size,
                "draft_vocab_size": args.draft_vocab_size, "vocab_size": args.vocab_size, "vocab_hash": vocab_hash,
                "num_layers": args.num_hidden_layers, "compression": compress, "precision": "float16",
                "deployment_target": "iOS18/macOS15"}
        finish_package(ct, desc, "draft", work, info, out, force)
    return info
