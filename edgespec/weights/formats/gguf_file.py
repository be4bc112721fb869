"""The GGUF container, parsed directly: metadata as Python values, tensors as memory-mapped arrays.

gguf's own GGUFReader builds a numpy view per metadata element; a 49k-token vocabulary
with its merges takes it ~3 s. This parser reads the same layout in one pass (~0.1 s):

    magic "GGUF" | version u32 (2 or 3) | n_tensors u64 | n_kv u64
    n_kv    x  key: string | type u32 | value          (string = u64 length + UTF-8 bytes)
    n_tensors x name: string | n_dims u32 | dims u64[n_dims] (ne0 = columns first)
                 | ggml type u32 | offset u64 (from the data start)
    padding to `general.alignment` (default 32), then the tensor data.

Tensor data is exposed as gguf's reader exposes it: F32/F16 as (rows..., columns) of
their dtype, every other type as (rows..., bytes per row) uint8.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

# GGUF metadata value types -> (struct format, numpy dtype)
_SCALARS = {0: ("<B", np.uint8), 1: ("<b", np.int8), 2: ("<H", np.uint16), 3: ("<h", np.int16),
            4: ("<I", np.uint32), 5: ("<i", np.int32), 6: ("<f", np.float32), 7: ("<?", np.bool_),
            10: ("<Q", np.uint64), 11: ("<q", np.int64), 12: ("<d", np.float64)}  # fmt: skip
_STRING, _ARRAY = 8, 9


class GGUFFormatError(ValueError):
    pass


@dataclass
class TensorType:
    name: str
    value: int


@dataclass
class Tensor:
    name: str
    shape: tuple[int, ...]  # GGUF order: ne0 (columns) first, like gguf.ReaderTensor.shape
    tensor_type: TensorType
    data: np.ndarray


class _Cursor:
    def __init__(self, buf: memoryview):
        self.buf, self.pos = buf, 0

    def take(self, n: int) -> memoryview:
        if self.pos + n > len(self.buf):
            raise GGUFFormatError(f"header ends early (need {n} bytes at offset {self.pos})")
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out

    def unpack(self, fmt: str):
        size = struct.calcsize(fmt)
        return struct.unpack_from(fmt, self.take(size))[0]

    def string(self) -> str:
        raw = bytes(self.take(self.unpack("<Q")))
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:  # some vocabularies hold partial UTF-8 pieces
            return raw.decode("utf-8", errors="replace")

    def value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            return self.unpack(_SCALARS[vtype][0])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, count = self.unpack("<I"), self.unpack("<Q")
            if etype in _SCALARS:
                dtype = np.dtype(_SCALARS[etype][1]).newbyteorder("<")
                arr = np.frombuffer(self.take(count * dtype.itemsize), dtype=dtype)
                return arr.tolist()
            return [self.value(etype) for _ in range(count)]
        raise GGUFFormatError(f"unknown metadata value type {vtype}")


class GGUFFile:
    """`fields`: key -> value (lists for arrays); `tensors`: list of Tensor over a memory map."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        mm = np.memmap(self.path, mode="r")
        cur = _Cursor(memoryview(mm))
        if bytes(cur.take(4)) != b"GGUF":
            raise GGUFFormatError("bad magic (not a GGUF file)")
        version = cur.unpack("<I")
        if version not in (2, 3):
            raise GGUFFormatError(f"GGUF version {version} is not supported (2 and 3 are; big-endian files are not)")
        n_tensors, n_kv = cur.unpack("<Q"), cur.unpack("<Q")
        self.fields: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string()
            self.fields[key] = cur.value(cur.unpack("<I"))
        infos = []
        for _ in range(n_tensors):
            name = cur.string()
            dims = tuple(cur.unpack("<Q") for _ in range(cur.unpack("<I")))
            infos.append((name, dims, cur.unpack("<I"), cur.unpack("<Q")))
        align = int(self.fields.get("general.alignment", 32))
        start = -(-cur.pos // align) * align
        self.tensors: list[Tensor] = []
        for name, dims, tval, offset in infos:
            try:
                qtype = gguf.GGMLQuantizationType(tval)
            except ValueError:
                raise GGUFFormatError(f"tensor {name}: unknown ggml type {tval}") from None
            block, type_bytes = gguf.GGML_QUANT_SIZES[qtype]
            cols, rows = dims[0], tuple(reversed(dims[1:]))
            if cols % block:
                raise GGUFFormatError(f"tensor {name}: {cols} columns is not a multiple of {qtype.name}'s {block}")
            row_bytes = cols // block * type_bytes
            n_bytes = row_bytes * int(np.prod(rows, dtype=np.int64))
            lo = start + offset
            if lo + n_bytes > len(mm):
                raise GGUFFormatError(f"tensor {name}: data past the end of the file (truncated?)")
            raw = mm[lo : lo + n_bytes]
            if qtype.name in ("F32", "F16"):
                data = raw.view(np.float32 if qtype.name == "F32" else np.float16).reshape(*rows, cols)
            else:
                data = raw.reshape(*rows, row_bytes)
            self.tensors.append(Tensor(name, dims, TensorType(qtype.name, tval), data))
