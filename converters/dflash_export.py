"""`convert --drafter DFLASH_FOLDER`: a published DFlash drafter stored as the bundle's drafter/ and drafter.mlpackage.

The folder goes in as config.json + model.safetensors (every *.safetensors shard read, sanitized to
models/dflash.py's names, loaded into the model to check names and shapes, written in the bundle's
dtype), after the pairing checks against the verifier's config (drafters.dflash.check_args: width,
vocabulary, target layers, the mask token's embedding row). Loading the bundle finds it with
drafters.dflash.is_dflash_folder, like the published folder.

With coremltools (and `coreml`), the drafter is also exported to drafter.mlpackage for the Neural
Engine (`export_dflash`): the verifier's target-layer states and the block in, the block's logits
(and final-norm states, for DFlash2's selector, which runs on the host) out; the context's keys and
values are the package's state. A Mac drafts through it (drafters.dflash.PackageBlock), elsewhere
through the MLX folder; here the MIL executor runs it against the MLX forward (tests/test_dflash.py).
"""

from __future__ import annotations

import json
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
from edgespec.converters.mtp_export import _dense as dense
from edgespec.converters.mtp_export import _head_norm
from edgespec.models.dflash import Model, ModelArgs
from mlx.utils import tree_flatten

from edgespec.drafters.dflash import CONFIG, DFLASH_PACKAGE, check_args
from edgespec.errors import ModelLoadError
from edgespec.weights.formats.hf import read_safetensors
from edgespec.weights.loader import load_model_folder

DFLASH_NO_COREML = "the DFlash package is not compressed; pass --drafter-compress none"


def write_dflash_drafter(folder: Path, src: Path, verifier_args, verifier_hash: str, dtype, coreml: bool,
                         compress: str, context_length: int = 1024, prefill_chunk: int = 64) -> dict[str, Any]:
    """Check and write the DFlash drafter `src` into `folder`/drafter; the manifest's `drafter` entry."""
    if compress != "none":
        raise ValueError(f"--drafter-compress: {DFLASH_NO_COREML}")
    try:
        config = json.loads((src / CONFIG).read_text())
        args = ModelArgs.from_dict(config)
    except (OSError, ValueError, TypeError) as e:
        raise ModelLoadError(f"{src}/{CONFIG}: {e}") from None
    if verifier_args is not None:
        check_args(args, verifier_args, src)
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{src}: a DFlash drafter folder needs its *.safetensors")
    model = Model(args)
    weights = model.sanitize(read_safetensors(files))
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise ModelLoadError(f"{src}: the safetensors do not fit {CONFIG}: {e}") from None
    out = folder / "drafter"
    out.mkdir(parents=True, exist_ok=True)
    params = {k: v.astype(dtype) for k, v in tree_flatten(model.parameters())}
    mx.save_safetensors(str(out / "model.safetensors"), params)
    (out / CONFIG).write_text(json.dumps(args.to_dict(), indent=2))
    entry = {"config": "drafter/config.json", "weights": "drafter/model.safetensors",
             "num_layers": args.num_hidden_layers, "vocab_hash": verifier_hash, "source": {"name": src.name},
             "kind": args.kind, "coreml": None, "coreml_note": None}
    if coreml:
        try:
            check_exportable(args)
            import coremltools  # noqa: F401
        except ModelLoadError as e:
            entry["coreml_note"] = str(e)
            return entry
        except ImportError:
            raise ModelLoadError("exporting the DFlash drafter to Core ML needs coremltools (pip install "
                                 "'edgespec[convert]'); or pass --no-coreml") from None
        verifier = load_model_folder(folder)  # the bundle's verifier, written before the drafter
        entry["coreml"] = export_dflash(model, verifier, folder / "drafter.mlpackage", context_length=context_length,
                                        prefill_chunk=prefill_chunk, vocab_hash=verifier_hash)
    return entry


# ---------------------------------------------------------------- Core ML

KIND = DFLASH_PACKAGE
PACKAGE_FORMAT = 1
FEED_SIZES = (1, 2, 4, 8)  # context rows one call appends (a round adds 1..block_size); bigger runs in pieces


def _dense(module) -> np.ndarray:
    return dense(module)


def check_exportable(args) -> None:
    """Refuse, by name, what the package's graph does not express."""
    why = None
    if args.rope_scaling:
        why = "rope scaling"
    elif args.partial_rotary_factor != 1.0 or args.rope_traditional:
        why = "partial or traditional RoPE"
    elif args.layer_types and "sliding_attention" in args.layer_types:
        why = "sliding-window layers"
    elif args.is_causal:
        why = "is_causal (a causal block)"
    elif args.final_logit_softcapping:
        why = "final_logit_softcapping"
    elif args.attention_bias or args.mlp_bias:
        why = "biases"
    if why:
        raise ModelLoadError(f"the DFlash drafter's Core ML export does not take {why}; it drafts in MLX")


def prepare_weights(model, verifier) -> dict:
    """float32 numpy weights for the graph: the drafter's, the verifier's embedding and head (the
    output multiplier folded into the head), q_norm times the attention scale."""
    a = model.args

    def vec(x) -> np.ndarray:
        return np.array(x.astype(mx.float32))

    w = {"embed": _dense(verifier.model.embed_tokens), "fc": _dense(model.fc), "hidden_norm": vec(model.hidden_norm.weight),
         "norm": vec(model.norm.weight)}
    if not verifier.args.tie_word_embeddings:
        w["lm_head"] = _dense(verifier.lm_head) * np.float32(a.output_multiplier)
    for i, layer in enumerate(model.layers):
        at, mlp = layer.self_attn, layer.mlp
        p = f"l{i}."
        w.update({p + "ln1": vec(layer.input_layernorm.weight), p + "ln2": vec(layer.post_attention_layernorm.weight),
                  p + "q": _dense(at.q_proj), p + "k": _dense(at.k_proj), p + "v": _dense(at.v_proj),
                  p + "o": _dense(at.o_proj), p + "q_norm": vec(at.q_norm.weight) * np.float32(at.scale),
                  p + "k_norm": vec(at.k_norm.weight), p + "gate": _dense(mlp.gate_proj),
                  p + "up": _dense(mlp.up_proj), p + "down": _dense(mlp.down_proj)})
        if a.kind == "dflash2":
            for name in ("attention_conv", "mlp_conv"):
                conv = getattr(layer, name)
                w[f"{p}{name}.base"] = vec(conv.base_kernel)  # (2, K, E)
                w[f"{p}{name}.proj"] = _dense(conv.kernel_projection)  # (2 K G, E)
    return w


def _conv(mb, x, dyn, base: np.ndarray, K: int, G: int, g: int, L: int, name: str):
    """DFlash2's grouped dynamic causal convolution on x (1, E, 1, L): dyn (K, G, 1, L) the
    dynamic taps, base (K, E) the static ones; tap o reads slot t - o (zeros before the block)."""
    xr = mb.reshape(x=x, shape=[G, g, L], name=f"{name}_x")
    out = None
    for o in range(min(K, L)):
        shifted = xr if o == 0 else mb.concat(
            values=[np.zeros((G, g, o), np.float16),
                    mb.slice_by_index(x=xr, begin=[0, 0, 0], end=[G, g, L - o], name=f"{name}_s{o}")],
            axis=2, name=f"{name}_shift{o}")
        d = mb.reshape(x=mb.slice_by_index(x=dyn, begin=[o, 0, 0, 0], end=[o + 1, G, 1, L], name=f"{name}_d{o}"),
                       shape=[G, 1, L], name=f"{name}_dr{o}")
        wt = mb.add(x=d, y=base[o].reshape(G, g, 1).astype(np.float16), name=f"{name}_w{o}")  # (G, g, L)
        term = mb.mul(x=wt, y=shifted, name=f"{name}_t{o}")
        out = term if out is None else mb.add(x=out, y=term, name=f"{name}_acc{o}")
    return mb.reshape(x=out, shape=[1, G * g, 1, L], name=f"{name}_out")


def _dynamic(mb, x, proj: np.ndarray, K: int, G: int, L: int, name: str):
    """The kernel projection of x (1, E, 1, L) -> (pre taps, post taps), each (K, G, 1, L)."""
    d = mb.reshape(x=_linear(mb, x, proj, None, f"{name}_proj"), shape=[2, K, G, 1, L], name=f"{name}_dyn")
    pre = mb.reshape(x=mb.slice_by_index(x=d, begin=[0, 0, 0, 0, 0], end=[1, K, G, 1, L], name=f"{name}_pre5"),
                     shape=[K, G, 1, L], name=f"{name}_pre")
    post = mb.reshape(x=mb.slice_by_index(x=d, begin=[1, 0, 0, 0, 0], end=[2, K, G, 1, L], name=f"{name}_post5"),
                      shape=[K, G, 1, L], name=f"{name}_post")
    return pre, post


def build_function(mb, types, args, w: dict, vocab: int, tied: bool, context: int, S: int, opset):
    """One function: append S context rows at `position`, then fill the block.

    inputs:  features (1, n*E, 1, S) fp16, input_ids (1, L) int32 (the block), position (1,) int32
    states:  key_cache, value_cache (layers, Hk, D, C) fp16 (the context's keys and values)
    outputs: logits (1, V, 1, L-1) fp16, hidden_out (1, E, 1, L-1) fp16 (slots 1.., final-norm)."""
    E, H, Hk, D, L = args.hidden_size, args.num_attention_heads, args.num_key_value_heads, args.head_dim, args.block_size
    g, C, NL, F = H // Hk, context, args.num_hidden_layers, len(args.target_layer_ids) * args.hidden_size
    K, gs = args.conv_kernel_size, args.conv_group_size
    G = E // gs if gs else 0
    inv = 1.0 / (float(args.rope_theta) ** (np.arange(0, D, 2) / D))
    cos_t, sin_t = rope_tables(D, C + L, inv, 1.0)
    eps = float(args.rms_norm_eps)
    specs = [mb.TensorSpec(shape=(1, F, 1, S), dtype=types.fp16), mb.TensorSpec(shape=(1, L), dtype=types.int32),
             mb.TensorSpec(shape=(1,), dtype=types.int32),
             mb.StateTensorSpec(shape=(NL, Hk, D, C), dtype=types.fp16),
             mb.StateTensorSpec(shape=(NL, Hk, D, C), dtype=types.fp16)]

    @mb.program(input_specs=specs, opset_version=opset)
    def prog(features, input_ids, position, key_cache, value_cache):
        emb_w = mb.const(val=w["embed"].astype(np.float16), name="embed_weight")
        e = mb.gather(x=emb_w, indices=mb.reshape(x=input_ids, shape=[L], name="ids"), axis=0, name="embed")
        h = mb.reshape(x=mb.transpose(x=e, perm=[1, 0], name="embed_t"), shape=[1, E, 1, L], name="h_in")
        if args.input_embedding_scale != 1.0:
            h = mb.mul(x=h, y=np.float16(args.input_embedding_scale), name="h_scaled")
        ctx = _rms_norm(mb, _linear(mb, features, w["fc"], None, "fc"), w["hidden_norm"], eps, "hidden_norm")

        cpos = mb.add(x=position, y=np.arange(S, dtype=np.int32), name="cpos")  # context rows' positions
        bpos = mb.add(x=position, y=np.arange(S, S + L, dtype=np.int32), name="bpos")  # the block's
        trig = {}
        for tag, pos in (("c", cpos), ("b", bpos)):
            trig[tag] = tuple(mb.cast(x=mb.gather(x=t, indices=pos, axis=1, name=f"rope_{n}{tag}32"), dtype="fp16",
                                      name=f"rope_{n}{tag}") for n, t in (("cos", cos_t), ("sin", sin_t)))
        # (L, C + L) additive mask: cache slot j visible iff j < position + S; the block all visible
        unseen = mb.greater_equal(x=np.arange(C, dtype=np.int32).reshape(1, C),
                                  y=mb.reshape(x=mb.add(x=position, y=np.int32(S), name="ctx_end"), shape=[1, 1]),
                                  name="unseen")
        mask = mb.mul(x=mb.cast(x=unseen, dtype="fp16", name="unseen16"), y=np.float16(MASK_VALUE), name="mask_c")
        mask = mb.concat(values=[mb.add(x=mask, y=np.zeros((L, 1), np.float16), name="mask_rows"),
                                 np.zeros((L, L), np.float16)], axis=1, name="mask")

        kc = mb.read_state(input=key_cache, name="key_cache_in")
        vc = mb.read_state(input=value_cache, name="value_cache_in")
        for i in range(NL):
            p, n = f"l{i}.", f"l{i}"
            x = _rms_norm(mb, h, w[p + "ln1"], eps, f"{n}_ln1")
            if args.kind == "dflash2":
                pre, post = _dynamic(mb, x, w[p + "attention_conv.proj"], K, G, L, f"{n}_ac")
                x = _conv(mb, x, pre, w[p + "attention_conv.base"][0], K, G, gs, L, f"{n}_acp")
            q = _head_norm(mb, mb.reshape(x=_linear(mb, x, w[p + "q"], None, f"{n}_q"), shape=[H, D, L]),
                           w[p + "q_norm"], eps, f"{n}_qn")
            q = _rope(mb, mb.reshape(x=q, shape=[Hk, g, D, L]), *trig["b"], 2, f"{n}_qrope")
            ck = _head_norm(mb, mb.reshape(x=_linear(mb, ctx, w[p + "k"], None, f"{n}_ck"), shape=[Hk, D, S]),
                            w[p + "k_norm"], eps, f"{n}_ckn")
            ck = _rope(mb, mb.reshape(x=ck, shape=[1, Hk, D, S]), *trig["c"], 2, f"{n}_ckrope")
            cv = mb.reshape(x=_linear(mb, ctx, w[p + "v"], None, f"{n}_cv"), shape=[1, Hk, D, S], name=f"{n}_cv4")
            begin = mb.concat(values=[np.array([i, 0, 0], np.int32), position], axis=0, name=f"{n}_begin")
            end = mb.concat(values=[np.array([i + 1, Hk, D], np.int32), mb.add(x=position, y=np.int32(S))], axis=0,
                            name=f"{n}_end")
            kc = mb.slice_update(x=kc, update=ck, begin=begin, end=end, name=f"{n}_kc")
            vc = mb.slice_update(x=vc, update=cv, begin=begin, end=end, name=f"{n}_vc")
            lo, hi = np.array([i, 0, 0, 0], np.int32), np.array([i + 1, Hk, D, C], np.int32)
            bk = _head_norm(mb, mb.reshape(x=_linear(mb, x, w[p + "k"], None, f"{n}_bk"), shape=[Hk, D, L]),
                            w[p + "k_norm"], eps, f"{n}_bkn")
            bk = _rope(mb, mb.reshape(x=bk, shape=[Hk, 1, D, L]), *trig["b"], 2, f"{n}_bkrope")
            bv = mb.reshape(x=_linear(mb, x, w[p + "v"], None, f"{n}_bv"), shape=[Hk, 1, D, L], name=f"{n}_bv4")
            Kall = mb.concat(values=[mb.reshape(x=mb.slice_by_index(x=kc, begin=lo, end=hi, name=f"{n}_K"),
                                                shape=[Hk, 1, D, C]), bk], axis=3, name=f"{n}_Kall")
            Vall = mb.concat(values=[mb.reshape(x=mb.slice_by_index(x=vc, begin=lo, end=hi, name=f"{n}_V"),
                                                shape=[Hk, 1, D, C]), bv], axis=3, name=f"{n}_Vall")
            s = mb.add(x=mb.matmul(x=q, y=Kall, transpose_x=True, name=f"{n}_scores"), y=mask, name=f"{n}_masked")
            o = mb.matmul(x=Vall, y=mb.softmax(x=s, axis=-1, name=f"{n}_probs"), transpose_y=True, name=f"{n}_attn")
            o = _linear(mb, mb.reshape(x=o, shape=[1, H * D, 1, L]), w[p + "o"], None, f"{n}_o")
            if args.kind == "dflash2":
                o = _conv(mb, o, post, w[p + "attention_conv.base"][1], K, G, gs, L, f"{n}_acf")
            h = mb.add(x=h, y=o, name=f"{n}_res1")
            x = _rms_norm(mb, h, w[p + "ln2"], eps, f"{n}_ln2")
            if args.kind == "dflash2":
                pre, post = _dynamic(mb, x, w[p + "mlp_conv.proj"], K, G, L, f"{n}_mc")
                x = _conv(mb, x, pre, w[p + "mlp_conv.base"][0], K, G, gs, L, f"{n}_mcp")
            act = mb.mul(x=mb.silu(x=_linear(mb, x, w[p + "gate"], None, f"{n}_gate")),
                         y=_linear(mb, x, w[p + "up"], None, f"{n}_up"), name=f"{n}_act")
            y = _linear(mb, act, w[p + "down"], None, f"{n}_down")
            if args.kind == "dflash2":
                y = _conv(mb, y, post, w[p + "mlp_conv.base"][1], K, G, gs, L, f"{n}_mcf")
            h = mb.add(x=h, y=y, name=f"{n}_res2")
        mb.coreml_update_state(state=key_cache, value=kc, name="key_cache_out")
        mb.coreml_update_state(state=value_cache, value=vc, name="value_cache_out")

        h = mb.slice_by_index(x=h, begin=[0, 0, 0, 1], end=[1, E, 1, L], name="h_slots")
        h = _rms_norm(mb, h, w["norm"], eps, "final_norm")
        if tied:
            logits = mb.matmul(x=emb_w, y=mb.reshape(x=h, shape=[E, L - 1], name="h_flat"), name="head")
            if args.output_multiplier != 1.0:
                logits = mb.mul(x=logits, y=np.float16(args.output_multiplier), name="head_scaled")
            logits = mb.reshape(x=logits, shape=[1, vocab, 1, L - 1], name="logits")
        else:
            logits = _linear(mb, h, w["lm_head"], None, "logits")
        return logits, mb.identity(x=h, name="hidden_out")

    return prog


def export_dflash(model, verifier, out: str | Path, context_length: int = 1024, prefill_chunk: int = 64,
                  vocab_hash: str | None = None, force: bool = False) -> dict[str, Any]:
    """Write `out` (.mlpackage) atomically from a models.dflash.Model paired with `verifier`; its info.

    Functions `feed_S`, S in FEED_SIZES and `prefill_chunk`: S new context rows, then the block."""
    out = package_target(out, force, context_length, prefill_chunk)
    args = model.args
    check_exportable(args)
    weights = prepare_weights(model, verifier)

    import coremltools as ct  # optional: coremltools
    from coremltools.converters.mil import Builder as mb  # optional: coremltools
    from coremltools.converters.mil.mil import types  # optional: coremltools

    sizes = sorted({s for s in FEED_SIZES if s <= context_length} | {prefill_chunk})
    tied = bool(verifier.args.tie_word_embeddings)
    with package_staging(out, force) as work:
        desc = ct.utils.MultiFunctionDescriptor()
        for S in sizes:
            prog = build_function(mb, types, args, weights, verifier.args.vocab_size, tied, context_length, S,
                                  ct.target.iOS18)
            add_function(ct, desc, prog, work, f"feed_{S}")
        info = {"kind": KIND, "dflash_kind": args.kind, "package": out.name, "package_format": PACKAGE_FORMAT,
                "context_length": context_length, "feed_sizes": sizes, "functions": [f"feed_{s}" for s in sizes],
                "block_size": args.block_size, "mask_token_id": args.mask_token_id,
                "target_layer_ids": list(args.target_layer_ids), "hidden_size": args.hidden_size,
                "vocab_size": verifier.args.vocab_size, "vocab_hash": vocab_hash, "num_layers": args.num_hidden_layers,
                "compression": "none", "precision": "float16", "deployment_target": "iOS18/macOS15"}
        finish_package(ct, desc, "feed_1", work, info, out, force)
    return info
