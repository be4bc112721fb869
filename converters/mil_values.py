"""What the numpy MIL executor and its op table share: the executor's error and the block /
slice arithmetic of MIL's ops (converters/mil_executor.py runs programs, mil_ops.py holds the ops)."""

from __future__ import annotations

import numpy as np


class MILExecutorError(RuntimeError):
    """The program uses an op or input this executor does not implement / accept."""


def _blocks(small: np.ndarray, full_shape) -> np.ndarray:
    """Repeat a per-block parameter (each axis divides `full_shape`) up to `full_shape`."""
    out = small
    for axis, (n, m) in enumerate(zip(full_shape, small.shape, strict=True)):
        if n % m:
            raise MILExecutorError(
                f"block parameter shape {small.shape} does not tile {tuple(full_shape)}"
            )
        if n != m:
            out = np.repeat(out, n // m, axis=axis)
    return out


def _slice(shape, begin, end, stride=None, begin_mask=None, end_mask=None, squeeze_mask=None):
    idx = []
    for i, n in enumerate(shape):
        b, e = int(begin[i]), int(end[i])
        s = 1 if stride is None else int(stride[i])
        if begin_mask is not None and begin_mask[i]:
            b = 0 if s > 0 else n - 1
        if end_mask is not None and end_mask[i]:
            e = n if s > 0 else -n - 1
        if squeeze_mask is not None and squeeze_mask[i]:
            idx.append(b)
        else:
            idx.append(slice(b, e, s))
    return tuple(idx)
