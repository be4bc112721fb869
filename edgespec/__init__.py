"""edgespec: on-device LLM inference with lossless speculative and lookahead decoding.

    import edgespec
    engine = edgespec.load()                  # default model (SmolLM2-135M-Instruct)
    print(engine.generate("Hello", max_tokens=32).text)
    for chunk in engine.stream(messages=[{"role": "user", "content": "Hi"}]):
        print(chunk.text, end="", flush=True)
"""

from __future__ import annotations

from pathlib import Path

from edgespec.engine import Engine, GenerationResult, make_options
from edgespec.errors import (
    ContextLengthError,
    DrafterRequiredError,
    EdgespecError,
    ModelLoadError,
    UnknownOptionError,
    VocabularyMismatchError,
)
from edgespec.options import GenerateOptions
from edgespec.processors import Penalties, TokenLogprob
from edgespec.sampling import SamplingParams

__version__ = "0.1.0"

__all__ = [
    "load",
    "Engine",
    "GenerationResult",
    "GenerateOptions",
    "SamplingParams",
    "Penalties",
    "TokenLogprob",
    "make_options",
    "EdgespecError",
    "ModelLoadError",
    "VocabularyMismatchError",
    "ContextLengthError",
    "DrafterRequiredError",
    "UnknownOptionError",
]


def load(
    model: str | Path | None = None,
    drafter: str | Path | None = None,
    progress: bool = True,
    verify_hashes: bool = True,
    history: str | None = None,
    prompt_cache_bytes: int | None = None,
    kv_bits: int | None = None,
    kv_group_size: int = 64,
    quantized_kv_start: int = 0,
) -> Engine:
    """Load a bundle, HF folder or GGUF file (default: SmolLM2-135M-Instruct) into an Engine.

    `drafter`: a drafter folder/bundle, "none" to disable, or None to use the
    bundle's own drafter when it has one (see edgespec.drafters).
    `history`: earlier prompts and replies as a draft source for mode auto: "memory"
    (this process only), "disk" ($EDGESPEC_HOME/history) or "off"; None =
    $EDGESPEC_HISTORY, else "memory". History shapes drafts only, never the output.
    `prompt_cache_bytes`: how much of earlier prompts' and replies' caches to keep for
    requests that start the same way (edgespec.prefix_cache); None = two full contexts of
    the model's KV cache, at most 1 GiB and a fifth of what the memory budget leaves for
    caches; "memory" = that fifth alone; 0 = off. Reuse never changes the output.
    `kv_bits` (8 or 4; None = full precision): store the KV cache quantized in groups of
    `kv_group_size` along the head size, from position `quantized_kv_start` on
    (edgespec.kv_quant). It saves memory on long contexts and changes the output slightly.
    """
    from edgespec.kv_quant import check_settings

    check_settings(kv_bits, kv_group_size, quantized_kv_start)  # before the model loads
    from edgespec.prefix_cache import check_limit

    check_limit(prompt_cache_bytes)
    from edgespec.adaptive.history import history_mode
    from edgespec.loader import load as load_any

    history_mode(history)  # a bad setting fails before the model is fetched or loaded

    if model is None:
        from edgespec.default_model import load_default

        loaded = load_default(progress=progress, verify_hashes=verify_hashes)
    else:
        loaded = load_any(model, verify_hashes=verify_hashes)
    from edgespec.drafters import attach_drafter

    engine = Engine(loaded, history=history, prompt_cache_bytes=prompt_cache_bytes, kv_bits=kv_bits,
                    kv_group_size=kv_group_size, quantized_kv_start=quantized_kv_start)
    engine._prompt_cache_limit()  # a bad bound fails here, not at the first request
    attach_drafter(engine, drafter)
    return engine
