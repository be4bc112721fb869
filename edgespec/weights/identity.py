"""What identifies a loaded model for the files edgespec keeps about it (learnt pass costs,
self-speculation's skip set): the sha256 of its weight files where a manifest records them,
else their sizes and modification times (a GGUF or Hugging Face folder read in place), with
its shape, dtypes and quantization."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from mlx.utils import tree_flatten


def model_identity(loaded) -> dict | None:
    """The model's identity, or None when it has none worth a file (built in memory)."""
    m = loaded.manifest or {}
    files = m.get("files") if isinstance(m.get("files"), dict) else {}
    weights = {n: e.get("sha256") for n, e in sorted(files.items())
               if isinstance(e, dict) and n.endswith((".safetensors", ".gguf", ".npz", ".bin"))}
    src = m.get("source") if isinstance(m.get("source"), dict) else {}
    if weights:
        ident: dict = {"weights": weights}
    elif loaded.path is not None:
        p = Path(loaded.path)
        try:
            targets = [p] if p.is_file() else sorted(p.glob("*.safetensors")) + sorted(p.glob("*.gguf"))
            ident = {"files": {t.name: [t.stat().st_size, t.stat().st_mtime_ns] for t in targets}}
        except OSError:
            return None
        if not ident["files"]:
            return None
    else:
        return None
    args = getattr(loaded.model, "args", None)
    shape = {k: getattr(args, k, None) for k in ("model_type", "hidden_size", "num_hidden_layers",
                                                 "intermediate_size", "num_attention_heads",
                                                 "num_key_value_heads", "vocab_size")}
    try:
        dtypes = sorted({str(v.dtype) for _, v in tree_flatten(loaded.model.parameters())})
    except Exception:  # noqa: BLE001
        dtypes = []
    name = str(src.get("name") or (Path(loaded.path).name if loaded.path is not None else "model"))
    return {"name": name, "model": ident, "shape": shape, "dtypes": dtypes, "quantization":
            getattr(args, "quantization", None)}


def identity_digest(loaded) -> str | None:
    """sha256 (hex) of `model_identity`, or None for a model with none (built in memory)."""
    ident = model_identity(loaded)
    if ident is None:
        return None
    return hashlib.sha256(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()
