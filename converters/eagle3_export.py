"""`edgespec convert MODEL OUT --drafter EAGLE3_FOLDER`: an EAGLE-3 head stored as the bundle's drafter/.

The head is checked against the verifier (edgespec.drafters.eagle3.check_args), read in either
published layout (safetensors or the authors' pytorch_model.bin), and written as drafter/ with the
folder's own config.json and one model.safetensors in edgespec's names (layer 0 as `layers.0.*`,
`d2t` / `t2d` / `embed_tokens.weight` kept), which the bundle loads as it loads the folder.

With coremltools (and `coreml`), the head is also exported to drafter.mlpackage for the Neural
Engine (converters/eagle3_coreml.py): a Mac drafts through it (drafters.eagle3_coreml), elsewhere
through drafter/; here the MIL executor runs it against the MLX head (tests/test_eagle3_coreml.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
from edgespec.converters.eagle3_coreml import check_exportable, export_eagle3
from edgespec.models.eagle3 import Model, ModelArgs
from mlx.utils import tree_flatten

from edgespec.drafters.eagle3 import CONFIG, check_args, check_maps, read_weights
from edgespec.errors import ModelLoadError


def write_eagle3_drafter(folder: Path, src: Path, verifier_args, verifier_hash: str, dtype,
                         compress: str = "none", coreml: bool = False, context_length: int = 1024,
                         prefill_chunk: int = 64) -> dict[str, Any]:
    """Check and write the EAGLE-3 head `src` into `folder`/drafter; the manifest's `drafter` entry.
    coreml: also drafter.mlpackage (`compress` packs its projections; see export_eagle3)."""
    if compress != "none" and not coreml:
        raise ValueError("--drafter-compress applies to the Core ML package; it cannot be used with --no-coreml")
    try:
        config = json.loads((src / CONFIG).read_text())
        args = ModelArgs.from_dict(config)
    except (OSError, ValueError, TypeError) as e:
        raise ModelLoadError(f"{src}/{CONFIG}: {e}") from None
    if verifier_args is not None:
        check_args(args, verifier_args, src)
    raw = read_weights(src)
    t2d = raw.get("t2d")
    weights, embed = Model.sanitize(raw)
    model = Model(args)
    if args.uses_draft_vocab and "d2t" not in weights:
        raise ModelLoadError(f"{src}: a head with draft_vocab_size {args.draft_vocab_size} < vocab_size "
                             f"{args.vocab_size} needs its d2t map")
    if not args.uses_draft_vocab:
        weights.pop("d2t", None)  # an identity map some folders carry: the head has no d2t
    try:
        model.load_weights([(k, v.astype(mx.int32) if k == "d2t" else v) for k, v in weights.items()], strict=True)
    except ValueError as e:
        raise ModelLoadError(f"{src}: the weights do not fit {CONFIG}: {e}") from None
    check_maps(model, t2d, src)
    params = {k: (v if k == "d2t" else v.astype(dtype)) for k, v in tree_flatten(model.parameters())}
    if t2d is not None:
        params["t2d"] = t2d
    if embed is not None:
        params["embed_tokens.weight"] = embed.astype(dtype)
    entry = {"config": "drafter/config.json", "weights": "drafter/model.safetensors",
             "num_layers": args.num_hidden_layers, "vocab_hash": verifier_hash, "source": {"name": src.name},
             "kind": "eagle3", "coreml": None, "coreml_note": None}
    if coreml:
        try:
            check_exportable(model)
            import coremltools  # noqa: F401
        except ModelLoadError as e:
            if compress != "none":
                raise ValueError(f"--drafter-compress: {e}") from None
            entry["coreml_note"] = str(e)
            coreml = False
        except ImportError:
            raise ModelLoadError("exporting the EAGLE-3 head to Core ML needs coremltools (pip install "
                                 "'edgespec[convert]'); or pass --no-coreml") from None
    out = folder / "drafter"
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), params)
    (out / CONFIG).write_text(json.dumps(config, indent=2))
    if coreml:
        entry["coreml"] = export_eagle3(model, folder / "drafter.mlpackage", context_length=context_length,
                                        prefill_chunk=prefill_chunk, vocab_hash=verifier_hash, compress=compress)
    return entry
