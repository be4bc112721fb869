"""Export Gemma 4's assistant (`gemma4_assistant`) to a stateful, multifunction Core ML package.

    export_assistant(assistant, "drafter.mlpackage", verifier_args, context_length=1024)
        -> info dict for the manifest (drafter.coreml)

The assistant owns no keys or values: each of its layers attends, at the fixed position p of
a round, to the keys and values the verifier's store layer of its type (sliding or full
attention) computed for positions 0..p-1 (models/gemma4_assistant.py). The package holds them
as Core ML state, one fixed buffer of C slots per layer type and per keys/values:

    <t>_keys, <t>_values: fp16 (Hk_t, D_t, C)   t in {sliding, full}, the verifier's store layer's
                                                 key/value heads and head size; D before C, as the
                                                 drafter package lays out its cache

Functions (one weight file; all read or write the same states):
    draft      one step: inputs `embedding` (1, B, 1, 1) fp16, the verifier's (scaled) embedding
               of the input token, `hidden` (1, B, 1, 1) fp16, the verifier's final-norm hidden
               state at p - 1 (or the previous step's guess), `position` (1,) int32 = p.
               Outputs `logits` (1, V, 1, 1) fp16 and `next_hidden` (1, B, 1, 1) fp16 (the guess
               the next step reads). Slot j is visible iff j < p (and, for sliding layers,
               j >= p - window - 1, as the MLX forward's window).
    append_S   for each S in `append_tokens`: inputs `<t>_keys_new`, `<t>_values_new`
               (Hk_t, D_t, S) fp16 and `position` (1,) int32: writes slots [position,
               position + S) of every buffer; output `end` (1,) int32 = position + S.

Why the keys and values cross as a delta: the verifier's cache is in MLX (Metal) memory and the
package's state in Core ML's; the only link is a call's inputs. Each round commits a few
positions (the accepted drafts and the verifier's token), so each round sends only those
(`append_S` with the smallest S that holds them); a prompt goes in chunks. Rolling back is
free, as in the drafter package: the runtime passes a smaller `position`, the mask hides every
slot at or past it, and later writes overwrite those slots. A window is written whole: its
slots past the delta hold padding (masked until overwritten), and near the buffer's end it
starts earlier and rewrites committed slots with the values they already hold.

Why sliding layers get a full C-slot buffer rather than a ring of window + 1 slots: a ring
would make the write wrap (two writes, or a scatter) and a rollback past the ring's reach would
have to resend the window; with one linear buffer per type the append and the mask are the
same code for both kinds and the window is only a bound in the mask. Its cost is attention
over C instead of window + 1 slots in the sliding layers (a few layers of one query each).

Why the token enters as the verifier's embedding row, not as an id: the assistant's input is
the verifier's embedding (its largest tensor, e.g. 262144 x 1536); a copy in the package would
double that memory, while one row (B values) per step crosses as an input instead. The
runtime takes it from the verifier it already holds.

With `use_ordered_embeddings` the head computes all V logits (a 1x1 conv, the Neural Engine's
strength) and keeps those of the tokens whose cluster is among the top k centroids; every
other token gets the smallest kept logit minus 1, as the MLX forward (the gather of k clusters'
rows it does would leave the Neural Engine). Ties at the k-th centroid logit keep both.

Layout and precision as converters/coreml_program.py: channels-first (1, C, 1, T)
activations, linear layers as 1x1 convs, fp16 with RMSNorm's mean of squares in fp32.
coremltools is imported only at export time.
"""

from __future__ import annotations

from dataclasses import dataclass
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
)
from edgespec.converters.coreml_program import MASK_VALUE, _linear, _rope, rope_tables
from mlx.utils import tree_flatten

from edgespec.drafters.assistant import check_fit
from edgespec.errors import ModelLoadError
from edgespec.safe_write import check_replaceable, check_writable

KIND = "gemma4_assistant"
PACKAGE_FORMAT = 1
MAX_CONTEXT = 32767  # gather indices may be cast to int16 (coreml_export.MAX_CONTEXT)
SHORT = {"sliding_attention": "sliding", "full_attention": "full"}
ACTIVATIONS = {"gelu_pytorch_tanh": "TANH_APPROXIMATION", "gelu": "EXACT"}


@dataclass(frozen=True)
class AssistantShape:
    layer_types: tuple[str, ...]  # per assistant layer
    head_dims: tuple[int, ...]  # per assistant layer
    kv: dict  # short type name -> (Hk, D) of the verifier's store layer of that type
    hidden: int  # the assistant's width E
    backbone: int  # the verifier's width B
    n_heads: int
    vocab: int
    context: int
    window: int  # sliding layers see the last window + 1 entries
    eps: float
    activation: str
    tied: bool
    ordered: bool
    centroids: int
    top_k: int

    def state_shape(self, t: str, S: int | None = None) -> tuple[int, int, int]:
        hk, d = self.kv[t]
        return (hk, d, self.context if S is None else S)


def assistant_shape(assistant, verifier_args, context_length: int) -> AssistantShape:
    a = assistant.args
    t = a.text
    store = check_fit(a, verifier_args)
    if t.hidden_act not in ACTIVATIONS:
        raise ModelLoadError(f"the assistant's activation {t.hidden_act!r} has no Core ML form here "
                             f"(supported: {', '.join(ACTIVATIONS)})")
    if t.attention_bias:
        raise ModelLoadError("the assistant's attention_bias is not supported by the Core ML export")
    kv = {SHORT[k]: (verifier_args.layer_kv_heads[j], verifier_args.layer_head_dims[j]) for k, j in store.items()}
    return AssistantShape(
        layer_types=tuple(t.layer_types), head_dims=tuple(t.layer_head_dims), kv=kv, hidden=t.hidden_size,
        backbone=a.backbone_hidden_size, n_heads=t.num_attention_heads, vocab=a.vocab_size,
        context=context_length, window=int(t.sliding_window), eps=float(t.rms_norm_eps),
        activation=ACTIVATIONS[t.hidden_act], tied=bool(a.tie_word_embeddings),
        ordered=bool(a.use_ordered_embeddings), centroids=int(a.num_centroids),
        top_k=int(a.centroid_intermediate_top_k))


def prepare_weights(assistant, shape: AssistantShape) -> dict[str, np.ndarray]:
    """float32 numpy weights by MLX name, plus RoPE tables per layer type (D/2, C + 1) and, with
    ordered embeddings, each token's cluster (V,) int32."""
    w = {k: np.array(v.astype(mx.float32)) if mx.issubdtype(v.dtype, mx.floating) else np.array(v)
         for k, v in tree_flatten(assistant.parameters())}
    for i, layer in enumerate(assistant.model.layers):
        t = SHORT[shape.layer_types[i]]
        if f"rope_cos_{t}" in w:
            continue
        rope = layer.self_attn.rope
        inv = 1.0 / np.asarray(rope._freqs, np.float64)  # periods -> inverse; inf (unrotated) -> 0
        # C + 1 positions: with every slot in use the query sits at position C
        w[f"rope_cos_{t}"], w[f"rope_sin_{t}"] = rope_tables(shape.head_dims[i], shape.context + 1, inv, rope.scale)
    if shape.ordered:
        order = w["masked_embedding.token_ordering"].astype(np.int64)  # (V,): rows of the (C, V/C) clusters
        if sorted(order.tolist()) != list(range(shape.vocab)):
            raise ModelLoadError("the assistant's token_ordering is not a permutation of the vocabulary")
        cluster = np.empty(shape.vocab, np.int32)
        cluster[order] = np.arange(shape.vocab) // (shape.vocab // shape.centroids)
        w["token_cluster"] = cluster
    return w


def linear_weights(shape: AssistantShape) -> list[str]:
    """Names of the weights that compression packs: every 1x1 conv but the head and the centroids."""
    names = ["pre_projection.weight", "post_projection.weight"]
    for i in range(len(shape.layer_types)):
        p = f"model.layers.{i}."
        names += [p + n + ".weight" for n in ("self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
                                              "mlp.down_proj")]
    return names


# ----------------------------------------------------------------------------- program
def _norm(mb, x, weight: np.ndarray | None, eps: float, axis: int, name: str):
    """RMSNorm over `axis` of an fp16 tensor, the mean of squares in fp32; times `weight`
    (shaped to broadcast on that axis) when given."""
    x32 = mb.cast(x=x, dtype="fp32", name=f"{name}_x32")
    ms = mb.reduce_mean(x=mb.mul(x=x32, y=x32, name=f"{name}_sq"), axes=[axis], keep_dims=True, name=f"{name}_ms")
    r = mb.rsqrt(x=ms, epsilon=np.float32(eps), name=f"{name}_rsqrt")
    y = mb.cast(x=mb.mul(x=x32, y=r, name=f"{name}_norm32"), dtype="fp16", name=f"{name}_norm")
    if weight is None:
        return y
    shape = [1] * len(x.shape)
    shape[axis] = -1
    return mb.mul(x=y, y=weight.astype(np.float16).reshape(shape), name=f"{name}_out")


def build_draft(mb, types, shape: AssistantShape, w: dict[str, np.ndarray], opset):
    """The `draft` function: one assistant step (see the module doc)."""
    B, C, H = shape.backbone, shape.context, shape.n_heads
    kinds = sorted(shape.kv)
    specs = [mb.TensorSpec(shape=(1, B, 1, 1), dtype=types.fp16), mb.TensorSpec(shape=(1, B, 1, 1), dtype=types.fp16),
             mb.TensorSpec(shape=(1,), dtype=types.int32)]
    for t in kinds:
        specs += [mb.StateTensorSpec(shape=shape.state_shape(t), dtype=types.fp16) for _ in range(2)]
    state_names = [f"{t}_{kv}" for t in kinds for kv in ("keys", "values")]

    def body(embedding, hidden, position, *states):
        st = dict(zip(state_names, states, strict=True))
        x = mb.concat(values=[embedding, hidden], axis=1, name="pre_in")  # (1, 2B, 1, 1)
        h = _linear(mb, x, w["pre_projection.weight"], None, "pre_proj")  # (1, E, 1, 1)
        # Slot j is visible iff j < p; in sliding layers also j >= p - window - 1.
        diff = mb.sub(x=np.arange(C, dtype=np.int32), y=position, name="slot_minus_p")  # (C,)
        future = mb.cast(x=mb.greater_equal(x=diff, y=np.int32(0)), dtype="fp16", name="future")
        masks = {"full": mb.reshape(x=mb.mul(x=future, y=np.float16(MASK_VALUE)), shape=[1, C], name="mask_full")}
        if "sliding" in shape.kv:
            old = mb.cast(x=mb.less(x=diff, y=np.int32(-shape.window - 1)), dtype="fp16", name="old")
            hidden_slots = mb.add(x=future, y=old, name="hidden_slots")  # 0 or 1: never both
            masks["sliding"] = mb.reshape(x=mb.mul(x=hidden_slots, y=np.float16(MASK_VALUE)), shape=[1, C],
                                          name="mask_sliding")
        rope = {}
        for t in kinds:
            cos = mb.gather(x=w[f"rope_cos_{t}"], indices=position, axis=1, name=f"rope_cos32_{t}")  # (D/2, 1)
            sin = mb.gather(x=w[f"rope_sin_{t}"], indices=position, axis=1, name=f"rope_sin32_{t}")
            rope[t] = (mb.cast(x=cos, dtype="fp16", name=f"rope_cos_{t}"),
                       mb.cast(x=sin, dtype="fp16", name=f"rope_sin_{t}"))
        cache = {}
        for t in kinds:
            hk, d = shape.kv[t]
            for kv in ("keys", "values"):
                full = mb.read_state(input=st[f"{t}_{kv}"], name=f"{t}_{kv}_in")  # (Hk, D, C)
                cache[t, kv] = mb.reshape(x=full, shape=[hk, 1, d, C], name=f"{t}_{kv}_4d")
        for i in range(len(shape.layer_types)):
            p, n = f"model.layers.{i}.", f"l{i}"
            t = SHORT[shape.layer_types[i]]
            hk, D = shape.kv[t]
            g = H // hk
            x = _norm(mb, h, w[p + "input_layernorm.weight"], shape.eps, 1, f"{n}_ln1")
            q = _linear(mb, x, w[p + "self_attn.q_proj.weight"], None, f"{n}_q")  # (1, H*D, 1, 1)
            q = mb.reshape(x=q, shape=[hk, g, D, 1], name=f"{n}_q4")
            q = _norm(mb, q, w[p + "self_attn.q_norm.weight"], shape.eps, 2, f"{n}_qn")
            q = _rope(mb, q, *rope[t], 2, f"{n}_qrope")  # attention scale 1: q and k are normalised
            s = mb.matmul(x=q, y=cache[t, "keys"], transpose_x=True, name=f"{n}_scores")  # (Hk, g, 1, C)
            s = mb.add(x=s, y=masks[t], name=f"{n}_masked")
            a = mb.softmax(x=s, axis=-1, name=f"{n}_probs")
            o = mb.matmul(x=cache[t, "values"], y=a, transpose_y=True, name=f"{n}_attn")  # (Hk, g, D, 1)
            o = _linear(mb, mb.reshape(x=o, shape=[1, H * D, 1, 1]), w[p + "self_attn.o_proj.weight"], None, f"{n}_o")
            h = mb.add(x=h, y=_norm(mb, o, w[p + "post_attention_layernorm.weight"], shape.eps, 1, f"{n}_ln2"),
                       name=f"{n}_res1")
            x = _norm(mb, h, w[p + "pre_feedforward_layernorm.weight"], shape.eps, 1, f"{n}_ln3")
            gate = _linear(mb, x, w[p + "mlp.gate_proj.weight"], None, f"{n}_gate")
            up = _linear(mb, x, w[p + "mlp.up_proj.weight"], None, f"{n}_up")
            act = mb.mul(x=mb.gelu(x=gate, mode=shape.activation, name=f"{n}_gelu"), y=up, name=f"{n}_act")
            m = _linear(mb, act, w[p + "mlp.down_proj.weight"], None, f"{n}_down")
            h = mb.add(x=h, y=_norm(mb, m, w[p + "post_feedforward_layernorm.weight"], shape.eps, 1, f"{n}_ln4"),
                       name=f"{n}_res2")
            h = mb.mul(x=h, y=w[p + "layer_scalar"].astype(np.float16).reshape(1, 1, 1, 1), name=f"{n}_scaled")
        h = _norm(mb, h, w["model.norm.weight"], shape.eps, 1, "final_norm")
        nxt = _linear(mb, h, w["post_projection.weight"], None, "next_hidden")
        head = w["model.embed_tokens.weight"] if shape.tied else w["lm_head.weight"]
        logits = _linear(mb, h, head, None, "head")  # (1, V, 1, 1)
        if shape.ordered:
            logits = _ordered(mb, shape, w, h, logits)
        return mb.identity(x=logits, name="logits"), nxt

    names = ["embedding", "hidden", "position", *state_names]
    return _program(mb, specs, names, body, opset)


def _ordered(mb, shape: AssistantShape, w, h, logits):
    """Keep the logits of the tokens in the top-k clusters; the rest get the smallest kept one - 1."""
    V, N = shape.vocab, shape.centroids
    c = mb.reshape(x=_linear(mb, h, w["masked_embedding.centroids.weight"], None, "centroids"), shape=[N],
                   name="centroid_logits")
    top, _ = mb.topk(x=c, k=shape.top_k, axis=0, ascending=False, name="centroid_topk")
    kth = mb.slice_by_index(x=top, begin=[shape.top_k - 1], end=[shape.top_k], name="centroid_kth")  # (1,)
    chosen = mb.cast(x=mb.greater_equal(x=c, y=kth), dtype="fp16", name="centroid_chosen")  # (N,) 0/1
    keep = mb.gather(x=chosen, indices=w["token_cluster"], axis=0, name="token_chosen")  # (V,)
    keep = mb.greater(x=mb.reshape(x=keep, shape=[1, V, 1, 1]), y=np.float16(0.5), name="token_kept")
    kept = mb.select(cond=keep, a=logits, b=np.float16(-MASK_VALUE), name="kept_or_big")
    low = mb.reduce_min(x=kept, axes=[1], keep_dims=True, name="kept_min")
    fill = mb.sub(x=low, y=np.float16(1.0), name="fill")
    return mb.select(cond=keep, a=logits, b=fill, name="ordered_logits")


def build_append(mb, types, shape: AssistantShape, S: int, opset):
    """The `append_S` function: write S positions of every key/value buffer at `position`."""
    kinds = sorted(shape.kv)
    specs, names = [], []
    for t in kinds:
        for kv in ("keys", "values"):
            specs.append(mb.TensorSpec(shape=shape.state_shape(t, S), dtype=types.fp16))
            names.append(f"{t}_{kv}_new")
    specs.append(mb.TensorSpec(shape=(1,), dtype=types.int32))
    names.append("position")
    for t in kinds:
        specs += [mb.StateTensorSpec(shape=shape.state_shape(t), dtype=types.fp16) for _ in range(2)]
        names += [f"{t}_keys", f"{t}_values"]

    def body(*args):
        a = dict(zip(names, args, strict=True))
        position = a["position"]
        end = mb.add(x=position, y=np.int32(S), name="end_pos")
        for t in kinds:
            hk, d = shape.kv[t]
            begin = mb.concat(values=[np.zeros(2, np.int32), position], axis=0, name=f"{t}_begin")
            stop = mb.concat(values=[np.array([hk, d], np.int32), end], axis=0, name=f"{t}_end")
            for kv in ("keys", "values"):
                buf = mb.read_state(input=a[f"{t}_{kv}"], name=f"{t}_{kv}_in")
                buf = mb.slice_update(x=buf, update=a[f"{t}_{kv}_new"], begin=begin, end=stop, name=f"{t}_{kv}_upd")
                mb.coreml_update_state(state=a[f"{t}_{kv}"], value=buf, name=f"{t}_{kv}_out")
        return mb.identity(x=end, name="end")

    return _program(mb, specs, names, body, opset)


def _program(mb, specs, names, body, opset):
    """A one-function MIL program whose inputs are named `names` (mb.program would name them
    after a Python function's parameters; these depend on the assistant's layer types)."""
    # coremltools is heavy and optional (the convert extra): imported only when a package is built or read
    from coremltools.converters.mil.mil import Function, Program  # optional: coremltools

    with Function(dict(zip(names, specs, strict=True)), opset) as func:
        outs = body(*[func.inputs[n] for n in names])
        func.set_outputs(list(outs) if isinstance(outs, tuple) else [outs])
    prog = Program()
    prog.add_function("main", func)
    return prog


# ----------------------------------------------------------------------------- export
def function_names(append_tokens: tuple[int, ...]) -> list[str]:
    return ["draft", *[f"append_{s}" for s in append_tokens]]


def export_assistant(
    assistant,
    out: str | Path,
    verifier_args,
    context_length: int = 1024,
    append_tokens: tuple[int, ...] = (1, 4, 16, 64),
    vocab_hash: str | None = None,
    compress: str = "none",
    progress=None,
    force: bool = False,
) -> dict[str, Any]:
    """Write `out` (.mlpackage) atomically; returns the manifest's `drafter.coreml` entry.

    assistant: the MLX AssistantModel (models/gemma4_assistant.py); verifier_args: the Gemma 4
    verifier's ModelArgs (its store layers give the key/value buffers' shapes; a misfit is
    refused by name). context_length C: key/value slots; the assistant drafts while the
    committed sequence fits. append_tokens: the positions one `append_S` call writes (a
    round's delta takes the smallest that holds it). progress(done, total, what) is called as
    each function is built. compress: the linear layers (projections, attention, MLP) as
    converters/coreml_compress.py packs them, by plain rounding (int8, int4, palette4); the
    embedding/head, centroids and norms stay fp16.
    """
    out = Path(out).expanduser()
    check_replaceable(out, force, label="package")
    check_writable(out, label="package")
    append_tokens = tuple(sorted(set(int(s) for s in append_tokens)))
    if not 1 <= context_length <= MAX_CONTEXT:
        raise ValueError(f"need 1 <= context_length ({context_length}) <= {MAX_CONTEXT}")
    if not append_tokens or append_tokens[0] < 1 or append_tokens[-1] > context_length:
        raise ValueError(f"append sizes must be in 1..{context_length}, got {append_tokens}")

    if compress not in COMPRESS_CHOICES:
        raise ValueError(f"--drafter-compress must be one of {', '.join(COMPRESS_CHOICES)}, got {compress!r}")
    shape = assistant_shape(assistant, verifier_args, context_length)
    weights = prepare_weights(assistant, shape)
    if compress != "none":
        for name in linear_weights(shape):  # once: every function refers to the same blobs
            weights[name] = compress_linear(weights[name], compress)

    # coremltools is heavy and optional (the convert extra): imported only when a package is built or read
    import coremltools as ct  # optional: coremltools
    from coremltools.converters.mil import Builder as mb  # optional: coremltools
    from coremltools.converters.mil.mil import types  # optional: coremltools

    names = function_names(append_tokens)
    with package_staging(out, force) as work:
        desc = ct.utils.MultiFunctionDescriptor()
        for done, name in enumerate(names):
            if progress:
                progress(done, len(names), name)
            if name == "draft":
                prog = build_draft(mb, types, shape, weights, ct.target.iOS18)
            else:
                prog = build_append(mb, types, shape, int(name.split("_")[1]), ct.target.iOS18)
            add_function(ct, desc, prog, work, name)
        if progress:
            progress(len(names), len(names), "assembling")
        info = {
            "package": out.name,
            "package_format": PACKAGE_FORMAT,
            "kind": KIND,
            "context_length": context_length,
            "append_tokens": list(append_tokens),
            "functions": names,
            "states": {f"{t}_{kv}": list(shape.state_shape(t)) for t in sorted(shape.kv) for kv in ("keys", "values")},
            "layer_types": sorted(set(shape.layer_types)),
            "window": shape.window,
            "backbone_hidden_size": shape.backbone,
            "ordered_embeddings": shape.ordered,
            "compression": compress,
            "precision": "float16",
            "deployment_target": "iOS18/macOS15",
            "vocab_size": shape.vocab,
            "vocab_hash": vocab_hash,
            "num_layers": len(shape.layer_types),
        }
        finish_package(ct, desc, "draft", work, info, out, force)
    return info


class AssistantExecutorBackend:
    """CoreMLAssistantDrafter backend running the package with the numpy MIL executor (Linux tests)."""

    def __init__(self, executor):
        self.executor = executor
        self.calls: list[tuple[str, int]] = []  # (function, position) log, for tests
        self.reset()

    def reset(self) -> None:
        self.state = self.executor.make_state("draft")

    def call(self, function: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.calls.append((function, int(np.asarray(inputs["position"]).reshape(-1)[0])))
        return self.executor.run(function, inputs, self.state)
