"""numpy implementations of the MIL ops in edgespec's exported drafter programs.

Each entry: impl(op, get, state, executor) -> list of results (one per op
output). `get(name)` returns an input's value (numpy) or None when absent.
Floating inputs are widened to fp32 before computing; the executor rounds the
result to the op's declared dtype. Anything outside what the export emits
(e.g. a non-1x1 conv, strided slice_update) raises, so the oracle stays strict.
"""

from __future__ import annotations

from math import erf

import numpy as np
from edgespec.converters.mil_values import MILExecutorError, _blocks, _slice


def _f(x):
    x = np.asarray(x)
    return x.astype(np.float32) if x.dtype.kind == "f" else x


def _binary(fn):
    return lambda op, get, state, ex: [fn(_f(get("x")), _f(get("y")))]


def _const(op, get, state, ex):
    return [np.asarray(op.outputs[0].val)]


def _cast(op, get, state, ex):
    dtype = str(get("dtype"))
    table = {
        "fp16": np.float32,
        "fp32": np.float32,
        "int32": np.int32,
        "int16": np.int32,
        "bool": bool,
    }
    if dtype not in table:
        raise MILExecutorError(f"cast to {dtype} is not supported ({op.name})")
    x = _f(get("x"))
    if table[dtype] is np.int32 and x.dtype.kind == "f":
        x = np.trunc(x)  # MIL casts float -> int toward zero
    return [x.astype(table[dtype])]


def _gather(op, get, state, ex):
    x, idx, axis = get("x"), np.asarray(get("indices")), int(get("axis", 0))
    if int(get("batch_dims", 0)) != 0:
        raise MILExecutorError(f"gather with batch_dims != 0 is not supported ({op.name})")
    n = x.shape[axis]
    if idx.size and (idx.min() < -n or idx.max() >= n):
        raise MILExecutorError(f"gather index out of range [-{n}, {n}) in {op.name}")
    return [np.take(x, idx, axis=axis)]


def _reduce_mean(op, get, state, ex):
    axes = get("axes")
    axes = None if axes is None else tuple(int(a) for a in np.atleast_1d(axes))
    return [np.mean(_f(get("x")), axis=axes, keepdims=bool(get("keep_dims", False)))]


def _rsqrt(op, get, state, ex):
    return [1.0 / np.sqrt(_f(get("x")) + np.float32(get("epsilon", 1e-12)))]


def _conv(op, get, state, ex):
    """Only what the export emits: 1x1 kernel, stride 1, no padding, one group = a linear layer."""
    x, w, b = _f(get("x")), _f(get("weight")), get("bias")
    if w.ndim != 4 or w.shape[2:] != (1, 1) or int(get("groups", 1)) != 1:
        raise MILExecutorError(
            f"conv {op.name}: only 1x1, groups=1 convs (linear layers) are supported"
        )
    for key in ("strides", "dilations"):
        v = get(key)
        if v is not None and any(int(s) != 1 for s in np.atleast_1d(v)):
            raise MILExecutorError(f"conv {op.name}: {key} must be 1")
    pad = get("pad")
    if pad is not None and np.any(np.asarray(pad) != 0):
        raise MILExecutorError(f"conv {op.name}: padding is not supported")
    y = np.einsum("oi,nihw->nohw", w[:, :, 0, 0], x)
    if b is not None:
        y = y + _f(b).reshape(1, -1, 1, 1)
    return [y]


def _split(op, get, state, ex):
    x, axis = get("x"), int(get("axis"))
    sizes = get("split_sizes")
    if sizes is None:
        return list(np.split(x, int(get("num_splits")), axis=axis))
    return list(np.split(x, np.cumsum(np.asarray(sizes))[:-1], axis=axis))


def _concat(op, get, state, ex):
    if bool(get("interleave", False)):
        raise MILExecutorError(f"concat {op.name}: interleave is not supported")
    vals = get("values")
    kind = "f" if any(np.asarray(v).dtype.kind == "f" for v in vals) else None
    vals = [_f(v) if kind else np.asarray(v) for v in vals]
    return [np.concatenate(vals, axis=int(get("axis")))]


def _slice_by_index(op, get, state, ex):
    x = get("x")
    idx = _slice(
        x.shape,
        get("begin"),
        get("end"),
        get("stride"),
        get("begin_mask"),
        get("end_mask"),
        get("squeeze_mask"),
    )
    return [x[idx]]


def _slice_update(op, get, state, ex):
    x, upd = get("x"), get("update")
    for key in ("begin_mask", "end_mask", "squeeze_mask"):
        m = get(key)
        if m is not None and np.any(m):
            raise MILExecutorError(f"slice_update {op.name}: {key} is not supported")
    stride = get("stride")
    if stride is not None and np.any(np.asarray(stride) != 1):
        raise MILExecutorError(f"slice_update {op.name}: only stride 1 is supported")
    begin, end = np.asarray(get("begin")), np.asarray(get("end"))
    if np.any(begin < 0) or np.any(end > np.asarray(x.shape)) or np.any(end < begin):
        raise MILExecutorError(f"slice_update {op.name}: [{begin}, {end}) outside shape {x.shape}")
    out = _f(x).copy()
    out[_slice(x.shape, begin, end)] = _f(upd).reshape(tuple(end - begin))
    return [out]


def _matmul(op, get, state, ex):
    x, y = _f(get("x")), _f(get("y"))
    if bool(get("transpose_x", False)):
        x = np.swapaxes(x, -1, -2)
    if bool(get("transpose_y", False)):
        y = np.swapaxes(y, -1, -2)
    return [np.matmul(x, y)]


def _softmax(op, get, state, ex):
    x, axis = _f(get("x")), int(get("axis", -1))
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return [e / e.sum(axis=axis, keepdims=True)]


def _read_state(op, get, state, ex):
    name = op.inputs["input"].name
    if name not in state:
        raise MILExecutorError(f"state {name!r} was not provided (have {', '.join(state)})")
    return [state[name].copy()]


def _update_state(op, get, state, ex):
    name = op.inputs["state"].name
    value = get("value")
    if name not in state or state[name].shape != value.shape:
        raise MILExecutorError(
            f"coreml_update_state {op.name}: bad state {name!r} or shape {value.shape}"
        )
    state[name] = value.astype(state[name].dtype)  # fp16 storage under emulation
    return [value]


def _blockwise_shift_scale(op, get, state, ex):
    """iOS18 quantized weight: w = scale * (data - offset), scale/offset given per block."""
    data = get("data").astype(np.float32)
    scale = _blocks(_f(get("scale")), data.shape)
    offset = get("offset")
    if offset is not None:
        data = data - _blocks(_f(offset), data.shape)
    return [data * scale]


def _lut_to_dense(op, get, state, ex):
    """iOS18 palettized weight: indices (shape S) pick entries of a per-block lut (S', P, 1)."""
    idx, lut = np.asarray(get("indices")).astype(np.int64), _f(get("lut"))
    if lut.ndim != idx.ndim + 2 or lut.shape[-1] != 1:
        raise MILExecutorError(
            f"constexpr_lut_to_dense {op.name}: only scalar (vector size 1) palettes are supported"
        )
    table = lut[..., 0]  # (groups per axis..., P)
    for axis, (n, m) in enumerate(zip(idx.shape, table.shape[:-1], strict=True)):
        if n % m:
            raise MILExecutorError(
                f"constexpr_lut_to_dense {op.name}: lut grouping does not tile the weight"
            )
        if n != m:
            table = np.repeat(table, n // m, axis=axis)
    return [np.take_along_axis(table, idx[..., None], axis=-1)[..., 0]]


OPS = {
    "const": _const,
    "identity": lambda op, get, s, ex: [get("x")],
    "reshape": lambda op, get, s, ex: [np.reshape(get("x"), [int(d) for d in get("shape")])],
    "transpose": lambda op, get, s, ex: [np.transpose(get("x"), [int(d) for d in get("perm")])],
    "expand_dims": lambda op, get, s, ex: [
        np.expand_dims(get("x"), tuple(int(a) for a in get("axes")))
    ],
    "squeeze": lambda op, get, s, ex: [np.squeeze(get("x"), tuple(int(a) for a in get("axes")))],
    "add": _binary(np.add),
    "sub": _binary(np.subtract),
    "mul": _binary(np.multiply),
    "real_div": _binary(np.divide),
    "maximum": _binary(np.maximum),
    "minimum": _binary(np.minimum),
    "greater": _binary(np.greater),
    "greater_equal": _binary(np.greater_equal),
    "less": _binary(np.less),
    "select": lambda op, get, s, ex: [np.where(get("cond"), _f(get("a")), _f(get("b")))],
    "cast": _cast,
    "gather": _gather,
    "reduce_mean": _reduce_mean,
    "rsqrt": _rsqrt,
    "conv": _conv,
    "split": _split,
    "concat": _concat,
    "slice_by_index": _slice_by_index,
    "slice_update": _slice_update,
    "matmul": _matmul,
    "softmax": _softmax,
    "silu": lambda op, get, s, ex: [_f(get("x")) / (1.0 + np.exp(-_f(get("x"))))],
    "sigmoid": lambda op, get, s, ex: [0.5 * (1.0 + np.tanh(0.5 * _f(get("x"))))],  # the MTP head's output gate
    "read_state": _read_state,
    "coreml_update_state": _update_state,
    "constexpr_blockwise_shift_scale": _blockwise_shift_scale,
    "constexpr_lut_to_dense": _lut_to_dense,
}


# ---- ops of Gemma 4's assistant package (converters/coreml_assistant.py)
def _gelu(op, get, state, ex):
    x, mode = _f(get("x")), str(get("mode", "EXACT"))
    if mode == "TANH_APPROXIMATION":
        return [0.5 * x * (1.0 + np.tanh(np.float32(np.sqrt(2.0 / np.pi)) * (x + np.float32(0.044715) * x**3)))]
    if mode == "EXACT":
        return [(0.5 * x * (1.0 + np.vectorize(erf)(x / np.sqrt(2.0)))).astype(np.float32)]
    raise MILExecutorError(f"gelu {op.name}: mode {mode} is not supported")


def _topk(op, get, state, ex):
    """Values and indices of the k largest (or smallest) along `axis`; ties keep the lower index."""
    x, k, axis = _f(get("x")), int(get("k")), int(get("axis", -1))
    order = np.argsort(x if bool(get("ascending", False)) else -x, axis=axis, kind="stable")
    idx = np.take(order, np.arange(k), axis=axis)
    return [np.take_along_axis(x, idx, axis=axis), idx.astype(np.int32)]


def _reduce_min(op, get, state, ex):
    axes = get("axes")
    axes = None if axes is None else tuple(int(a) for a in np.atleast_1d(axes))
    return [np.min(_f(get("x")), axis=axes, keepdims=bool(get("keep_dims", False)))]


OPS.update({"gelu": _gelu, "topk": _topk, "reduce_min": _reduce_min})
