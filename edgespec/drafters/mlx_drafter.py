"""A smaller MLX model sharing the verifier's vocabulary, used as the drafter."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx

from edgespec.drafters.base import ModelDrafter
from edgespec.errors import ModelLoadError, VocabularyMismatchError


def _device() -> str:
    return "gpu" if mx.default_device().type == mx.DeviceType.gpu else "cpu"


def check_vocabulary(drafter_vocab: int, verifier_vocab: int, drafter_hash=None, verifier_hash=None, what="drafter"):
    """Raise VocabularyMismatchError unless sizes (and hashes, when both are known) agree."""
    if drafter_vocab != verifier_vocab:
        raise VocabularyMismatchError(
            f"the {what} has a vocabulary of {drafter_vocab} tokens, the verifier {verifier_vocab}: "
            "a drafter must use the verifier's tokenizer"
        )
    if drafter_hash and verifier_hash and drafter_hash != verifier_hash:
        raise VocabularyMismatchError(
            f"the {what}'s tokenizer (vocab hash {drafter_hash}) differs from the verifier's "
            f"({verifier_hash}): a drafter must use the verifier's tokenizer"
        )


class MLXDrafter(ModelDrafter):
    """Drafts with its own MLX model and KV cache (see ModelDrafter for the state rules)."""

    name = "mlx"

    def __init__(self, model, name: str = "mlx"):
        super().__init__(model)
        self.name = name
        self.device = _device()

    @classmethod
    def load(cls, path: str | Path, verifier) -> MLXDrafter:
        """Drafter from a bundle or a folder with config.json + model.safetensors.

        `verifier`: the Engine (or LoadedModel) it will draft for; its vocabulary
        must match (size, and tokenizer hash when both sides know theirs).
        """
        from edgespec.bundle import is_bundle, read_manifest
        from edgespec.loader import load_model_folder

        path = Path(path).expanduser()
        if not (path / "config.json").is_file() or not (path / "model.safetensors").is_file():
            raise ModelLoadError(f"{path}: a drafter folder needs config.json and model.safetensors")
        d_hash = None
        if is_bundle(path):
            d_hash = read_manifest(path).get("vocab_hash")
        elif (path / "tokenizer.json").is_file():
            from edgespec.tokenizer import Tokenizer

            d_hash = Tokenizer.from_folder(path).vocab_hash()
        loaded = getattr(verifier, "loaded", verifier)
        v_hash = (loaded.manifest or {}).get("vocab_hash")
        if v_hash is None and d_hash is not None and loaded.tokenizer is not None:
            v_hash = loaded.tokenizer.vocab_hash()
        from edgespec.formats.hf import read_config

        cfg = read_config(path)
        check_vocabulary(int(cfg.get("vocab_size", -1)), loaded.model.args.vocab_size, d_hash, v_hash)
        model = load_model_folder(path)
        return cls(model, name=f"mlx:{path.name}")
