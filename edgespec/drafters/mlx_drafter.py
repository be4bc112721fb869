"""A smaller MLX model sharing the verifier's vocabulary, used as the drafter."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx

from edgespec.drafters.base import ModelDrafter
from edgespec.drafters.compat import check_compatible
from edgespec.errors import ModelLoadError
from edgespec.tokenizer import Tokenizer
from edgespec.weights.bundle import is_bundle, read_manifest
from edgespec.weights.formats.hf import read_config
from edgespec.weights.loader import load_model_folder


def _device() -> str:
    return "gpu" if mx.default_device().type == mx.DeviceType.gpu else "cpu"


class MLXDrafter(ModelDrafter):
    """Drafts with its own MLX model and KV cache (see ModelDrafter for the state rules).

    `vocab_size` is the verifier's output size. A drafter whose embedding table is padded
    to another size (same tokenizer) has its logits cut or padded with -inf to it, and an
    id past its own table (only a verifier padding id can be) is clamped when fed: a
    proposal only, so the output stays the verifier's.
    """

    name = "mlx"

    def __init__(self, model, name: str = "mlx", vocab_size: int | None = None):
        super().__init__(model)
        self.name = name
        self.device = _device()
        self.rows = int(model.args.vocab_size)
        self.vocab_size = int(vocab_size or self.rows)

    def _forward(self, x: mx.array, last_only: bool = False) -> mx.array:
        if self.vocab_size == self.rows:
            return super()._forward(x, last_only)
        logits = super()._forward(mx.minimum(x, self.rows - 1), last_only)  # (T, rows)
        if self.rows > self.vocab_size:
            return logits[:, : self.vocab_size]
        pad = mx.full((logits.shape[0], self.vocab_size - self.rows), -mx.inf, dtype=logits.dtype)
        return mx.concatenate([logits, pad], axis=-1)

    @classmethod
    def load(cls, path: str | Path, verifier) -> MLXDrafter:
        """Drafter from a bundle or a folder with config.json + model.safetensors.

        `verifier`: the Engine (or LoadedModel) it will draft for. With a tokenizer on both
        sides the tokenizers must agree id by id on the ids both define, and the drafter's
        table must cover every verifier token; without one, vocabulary sizes must match.
        """
        path = Path(path).expanduser()
        if not (path / "config.json").is_file() or not (path / "model.safetensors").is_file():
            raise ModelLoadError(f"{path}: a drafter folder needs config.json and model.safetensors")
        loaded = getattr(verifier, "loaded", verifier)
        v_rows = int(loaded.model.args.vocab_size)
        cfg = read_config(path)
        d_rows = int(cfg.get("vocab_size", -1))
        d_tok = Tokenizer.from_folder(path) if (path / "tokenizer.json").is_file() else None
        if d_tok is not None and loaded.tokenizer is not None:
            check_compatible(d_rows, v_rows, drafter_tokenizer=d_tok, verifier_tokenizer=loaded.tokenizer)
        else:
            d_hash = read_manifest(path).get("vocab_hash") if is_bundle(path) else None
            v_hash = (loaded.manifest or {}).get("vocab_hash")
            check_compatible(d_rows, v_rows, d_hash, v_hash)
        model = load_model_folder(path)
        return cls(model, name=f"mlx:{path.name}", vocab_size=v_rows)
