"""Format readers the runtime needs: Hugging Face folders (config.json, safetensors) and GGUF.

Runtime reads, converters write: everything here is imported by the runtime
(edgespec.weights.loader, the drafters) and by the converters; nothing here imports
edgespec.converters, coremltools or torch (tests/test_runtime_imports.py).
"""
