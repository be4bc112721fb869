"""`convert --drafter DFLASH_FOLDER`: a published DFlash drafter stored as the bundle's drafter/.

The folder goes in as config.json + model.safetensors (every *.safetensors shard read, sanitized to
models/dflash.py's names, loaded into the model to check names and shapes, written in the bundle's
dtype), after the pairing checks against the verifier's config (drafters.dflash.check_args: width,
vocabulary, target layers, the mask token's embedding row). Loading the bundle finds it with
drafters.dflash.is_dflash_folder, like the published folder.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from edgespec.errors import ModelLoadError

DFLASH_NO_COREML = "DFlash drafters run in MLX; no Core ML package is made for them yet"


def write_dflash_drafter(folder: Path, src: Path, verifier_args, verifier_hash: str, dtype, coreml: bool,
                         compress: str) -> dict[str, Any]:
    """Check and write the DFlash drafter `src` into `folder`/drafter; the manifest's `drafter` entry."""
    import mlx.core as mx
    from edgespec.models.dflash import Model, ModelArgs
    from mlx.utils import tree_flatten

    from edgespec.drafters.dflash import CONFIG, check_args
    from edgespec.formats.hf import read_safetensors

    if compress != "none":
        raise ValueError(f"--drafter-compress applies to Core ML packages; {DFLASH_NO_COREML}")
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
    return {
        "config": "drafter/config.json",
        "weights": "drafter/model.safetensors",
        "num_layers": args.num_hidden_layers,
        "vocab_hash": verifier_hash,
        "source": {"name": src.name},
        "kind": args.kind,
        "coreml": None,
        "coreml_note": DFLASH_NO_COREML if coreml else None,
    }
