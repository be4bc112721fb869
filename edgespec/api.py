"""edgespec.load: a model (bundle, HF folder, GGUF file or hub name) and its drafter, loaded into an Engine."""

from __future__ import annotations

from pathlib import Path

from edgespec.engine import Engine
from edgespec.errors import ModelLoadError, VocabularyMismatchError


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
    bitwise: bool | None = None,
    numerics: str | None = None,
) -> Engine:
    """Load a bundle, HF folder or GGUF file (default: SmolLM2-135M-Instruct) into an Engine.

    `drafter`: a drafter folder/bundle, "none" to disable, or None to use the
    bundle's own drafter when it has one (see edgespec.drafters).
    `history`: earlier prompts and replies as a draft source for mode auto: "memory"
    (this process only), "disk" ($EDGESPEC_HOME/history) or "off"; None =
    $EDGESPEC_HISTORY, else "memory". History shapes drafts only, never the output.
    `prompt_cache_bytes`: how much of earlier prompts' and replies' caches to keep for
    requests that start the same way (edgespec.caches.prefix); None = two full contexts of
    the model's KV cache, at most 1 GiB and a fifth of what the memory budget leaves for
    caches; "memory" = that fifth alone; 0 = off. Reuse never changes the output.
    `kv_bits` (8 or 4; None = full precision): store the KV cache quantized in groups of
    `kv_group_size` along the head size, from position `quantized_kv_start` on
    (edgespec.caches.kv_quant). It saves memory on long contexts and changes the output slightly.
    `bitwise`: bitwise verification (docs/bitwise.md): every row of a verifier pass over many
    positions is bitwise what a one-token pass gives, so speculation cannot flip a near-tie.
    A process-wide setting; None = $EDGESPEC_BITWISE (off unless set to 1).
    `numerics`: "native" (the device's own) or "metal": load and run the model as Metal would
    on any device (quantized weights kept quantized, float16 activations and KV caches, `auto`'s
    drafter as on a Mac; edgespec.weights.numerics, docs/numerics.md); None = $EDGESPEC_NUMERICS,
    else "native".
    $EDGESPEC_COST_PROFILE (a profile name, docs/costs.md): the engine's decoders price their
    choices by that profile's simulated clock instead of the host's timer (`engine.simulation`),
    as `edgespec bench --profile` does: the output is unchanged, the choices are the profile's.
    """
    from edgespec.weights.numerics import (
        resolve as resolve_numerics,  # deferred: light import edgespec
    )

    numerics = resolve_numerics(numerics)  # a bad value fails before anything loads
    from edgespec.caches.kv_quant import check_settings  # deferred: light import edgespec

    check_settings(kv_bits, kv_group_size, quantized_kv_start)  # before the model loads
    from edgespec.caches.prefix import check_limit  # deferred: light import edgespec

    check_limit(prompt_cache_bytes)
    from edgespec.adaptive.history import history_mode  # deferred: light import edgespec
    from edgespec.weights.loader import load as load_any  # deferred: light import edgespec

    history_mode(history)  # a bad setting fails before the model is fetched or loaded
    from edgespec.costs import clock as cost_clock  # deferred: light import edgespec

    cost_profile = cost_clock.from_env()
    if cost_profile is not None:
        try:
            cost_clock.parse(cost_profile)  # a bad name fails before the model loads
        except (KeyError, ValueError) as e:
            raise ModelLoadError(f"${cost_clock.ENV}: {e}") from None
    if bitwise is not None:
        from edgespec.kernels import exact  # deferred: light import edgespec

        exact.set_enabled(bitwise)  # builds the CPU kernel now: fails before the model loads

    from edgespec.hub.names import as_hub_name, local_path_error  # deferred: light import edgespec

    hub, paired, notes = as_hub_name(model), None, []
    for spec, what in ((model, "model"), (drafter, "drafter")):
        missing = local_path_error(spec)  # a mistyped local path: said so, never looked up on the hub
        if missing:
            raise ModelLoadError(f"{what} {missing}")
    if hub is not None or as_hub_name(drafter) is not None:  # names: resolved (fetched once) before loading
        from edgespec.hub.fetch import resolve  # deferred: light import edgespec

        report = _stderr if progress else None
        if as_hub_name(drafter) is not None:
            drafter = resolve(as_hub_name(drafter), progress=progress, report=report).local.path
        if hub is not None:
            resolved = resolve(hub, progress=progress, report=report)
            model, paired, notes = resolved.local.path, resolved.drafter, resolved.notes
    if model is None:
        from edgespec.weights.default_model import load_default  # deferred: light import edgespec

        loaded = load_default(progress=progress, verify_hashes=verify_hashes, numerics=numerics)
    else:
        loaded = load_any(model, verify_hashes=verify_hashes, numerics=numerics)
    if hub is not None:  # named by the hub name, not by the snapshot folder's commit hash
        loaded.manifest = {**loaded.manifest, "source": {**(loaded.manifest.get("source") or {}),
                                                         "name": hub.repo_id.split("/")[1], "hub": str(hub)}}
    from edgespec.drafters import attach_drafter  # deferred: light import edgespec
    from edgespec.drafters.registry import auto_drafter  # deferred: light import edgespec

    engine = Engine(loaded, history=history, prompt_cache_bytes=prompt_cache_bytes, kv_bits=kv_bits,
                    kv_group_size=kv_group_size, quantized_kv_start=quantized_kv_start)
    engine._prompt_cache_limit()  # a bad bound fails here, not at the first request
    if attach_drafter(engine, drafter) is None and drafter is None and paired is not None:
        notes += _attach_paired(engine, paired)
    if drafter is None and paired is None:
        engine.auto_drafter = auto_drafter(engine)
    engine.load_notes = notes
    if cost_profile is not None:  # $EDGESPEC_COST_PROFILE: the planner on a profile's prices
        engine.simulation, _ = cost_clock.attach(engine, cost_profile)
    return engine


def _stderr(message: str) -> None:
    import sys  # deferred: light import edgespec

    print(f"edgespec: {message}", file=sys.stderr, flush=True)


def _attach_paired(engine: Engine, folder: Path) -> list[str]:
    """The catalog's drafter for a model run by name, when its weights fit the memory free now;
    the tokenizer check runs as for any drafter, and a refusal is a note, not an error."""
    from edgespec.drafters import attach_drafter  # deferred: light import edgespec
    from edgespec.lookahead.memory import available_memory  # deferred: light import edgespec

    size = sum(f.stat().st_size for f in Path(folder).glob("*.safetensors"))
    free = available_memory()
    if free is not None and size > free:
        return [f"the paired drafter ({size / 1e9:.2f} GB) does not fit the {free / 1e9:.2f} GB free: running without it"]
    try:
        attach_drafter(engine, folder)
    except (VocabularyMismatchError, ModelLoadError) as e:
        return [f"the paired drafter was not used: {e}"]
    return []
