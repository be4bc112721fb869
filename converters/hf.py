"""Hugging Face folder reading lives in the runtime (edgespec.weights.formats.hf); re-exported for converters."""

from edgespec.weights.formats.hf import read_config, read_hf, read_safetensors, sanitize

__all__ = ["read_config", "read_hf", "read_safetensors", "sanitize"]
