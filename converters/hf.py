"""Hugging Face folder reading lives in the runtime (edgespec.formats.hf); re-exported for converters."""

from edgespec.formats.hf import read_config, read_hf, read_safetensors, sanitize

__all__ = ["read_config", "read_hf", "read_safetensors", "sanitize"]
