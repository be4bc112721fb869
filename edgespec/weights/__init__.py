"""Weights in: reading a model from disk, whatever form it comes in, into the runtime.

    loader.py        load a verifier (or drafter) from a bundle, a Hugging Face or MLX folder,
                     or a GGUF file
    bundle.py        the bundle on disk (manifest, checksums): the converters' and runtime's contract
    default_model.py the default model (SmolLM2-135M-Instruct), fetched once
    formats/         format readers: safetensors and config.json, GGUF tensor types, names, tokenizers

Where edgespec keeps files (edgespec.paths) and how it writes them (edgespec.safe_write) stay
at the bottom of the package beside it: the caches and the cost store write too.
Import the module you need; nothing is re-exported here.
"""
