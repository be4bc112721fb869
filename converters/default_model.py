"""A converted bundle of the default model (SmolLM2-135M-Instruct), written once into the cache.

The runtime (edgespec.weights.default_model) fetches the GGUF and reads it directly; the
tests, benchmarks and distillation want a bundle folder (manifest, tokenizer.json),
which only a converter writes. The runtime loads this bundle when it is there.
"""

from __future__ import annotations

import sys
from pathlib import Path

from edgespec.converters.convert import convert

from edgespec.paths import held
from edgespec.weights.default_model import default_bundle_dir, default_gguf_path, variant


def default_bundle_path(progress: bool = True) -> Path:
    """Bundle of the default model for this device, converting on first use."""
    out = default_bundle_dir()
    if (out / "manifest.json").is_file():
        return out

    gguf = default_gguf_path(progress)
    with held(out):  # another process converting it (parallel test workers): wait, then use it
        if (out / "manifest.json").is_file():
            return out
        if progress:
            print(f"edgespec: converting {gguf.name} -> {out}", file=sys.stderr)
        convert(gguf, out, quantize="native" if variant() == "q4" else "none", force=True, progress=progress)
    return out
