"""PyTorch's `torch.save` checkpoints (pytorch_model.bin) read without torch and without running them.

Some published drafter heads (the EAGLE authors' EAGLE-3 folders) ship only `pytorch_model.bin`:
a zip archive holding `<name>/data.pkl`, a pickle of a dict of tensors, and `<name>/data/<key>`,
each storage's raw bytes (little-endian unless `<name>/byteorder` says otherwise). The pickle is
read by an unpickler that knows exactly the few globals a state dict uses (the tensor rebuild
functions, the storage classes, OrderedDict) and refuses every other one by name, so a checkpoint
cannot run code. The legacy (pre-1.6, non-zip) format is refused by name.
"""

from __future__ import annotations

import pickle
import zipfile
from collections import OrderedDict
from pathlib import Path

import mlx.core as mx
import numpy as np

from edgespec.errors import ModelLoadError

STORAGES = {"FloatStorage": np.float32, "HalfStorage": np.float16, "BFloat16Storage": "bfloat16",
            "DoubleStorage": np.float64, "LongStorage": np.int64, "IntStorage": np.int32, "ShortStorage": np.int16,
            "CharStorage": np.int8, "ByteStorage": np.uint8, "BoolStorage": np.bool_}


class _Storage:
    def __init__(self, name: str):
        self.name = name


def _rebuild_tensor(storage, offset, size, stride, *_):
    """A view of `storage` (a flat numpy array) -> an mx.array of `size` with `stride`."""
    data = storage
    if not size:
        return np.array(data[offset])
    item = data.itemsize
    view = np.lib.stride_tricks.as_strided(data[offset:], shape=tuple(size), strides=tuple(s * item for s in stride))
    return np.ascontiguousarray(view)


def _rebuild_parameter(data, *_):
    return data


class _Unpickler(pickle.Unpickler):
    ALLOWED = {("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor, ("torch._utils", "_rebuild_tensor"): _rebuild_tensor,
               ("torch._utils", "_rebuild_parameter"): _rebuild_parameter, ("collections", "OrderedDict"): OrderedDict}

    def __init__(self, file, archive: zipfile.ZipFile, prefix: str, big_endian: bool, where: Path):
        super().__init__(file)
        self.archive, self.prefix, self.big_endian, self.where = archive, prefix, big_endian, where
        self.loaded: dict[str, np.ndarray] = {}

    def find_class(self, module: str, name: str):
        if (module, name) in self.ALLOWED:
            return self.ALLOWED[(module, name)]
        if module == "torch" and name in STORAGES:
            return _Storage(name)
        raise ModelLoadError(f"{self.where}: the checkpoint's pickle names {module}.{name}, not part of a plain "
                             "state dict of tensors; refused (it could run code)")

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) >= 3 and pid[0] == "storage" and isinstance(pid[1], _Storage)):
            raise ModelLoadError(f"{self.where}: an unexpected persistent id in the checkpoint: {pid!r}")
        key = str(pid[2])
        if key not in self.loaded:
            dtype = STORAGES[pid[1].name]
            raw = self.archive.read(f"{self.prefix}/data/{key}")
            if dtype == "bfloat16":  # numpy has none: the upper half of a float32
                u = np.frombuffer(raw, dtype=">u2" if self.big_endian else "<u2").astype(np.uint32) << 16
                arr = u.view(np.float32)
            else:
                arr = np.frombuffer(raw, dtype=np.dtype(dtype).newbyteorder(">" if self.big_endian else "<"))
            self.loaded[key] = arr
        return self.loaded[key]


def read_torch_checkpoint(path: Path) -> dict[str, mx.array]:
    """The tensors of a `torch.save` zip checkpoint of a (possibly nested under 'state_dict') dict."""
    path = Path(path)
    try:
        archive = zipfile.ZipFile(path)
    except (OSError, zipfile.BadZipFile):
        raise ModelLoadError(f"{path}: not a PyTorch zip checkpoint (the pre-1.6 format is not read: save it as "
                             "safetensors)") from None
    with archive:
        names = archive.namelist()
        pkl = next((n for n in names if n.endswith("/data.pkl")), None)
        if pkl is None:
            raise ModelLoadError(f"{path}: no data.pkl in the archive: not a PyTorch checkpoint")
        prefix = pkl[: -len("/data.pkl")]
        order = f"{prefix}/byteorder"
        big = order in names and archive.read(order).strip() == b"big"
        try:
            with archive.open(pkl) as f:
                obj = _Unpickler(f, archive, prefix, big, path).load()
        except ModelLoadError:
            raise
        except Exception as e:  # a truncated or malformed pickle or archive
            raise ModelLoadError(f"{path}: unreadable PyTorch checkpoint: {e}") from None
    if isinstance(obj, dict) and isinstance(obj.get("state_dict"), dict):
        obj = obj["state_dict"]
    if not isinstance(obj, dict):
        raise ModelLoadError(f"{path}: the checkpoint holds a {type(obj).__name__}, not a dict of tensors")
    out = {}
    for k, v in obj.items():
        if isinstance(v, np.ndarray):
            out[str(k)] = mx.array(v)
        elif isinstance(v, mx.array):
            out[str(k)] = v
    return out
