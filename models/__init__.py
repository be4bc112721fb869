"""The MLX architectures: shared parts in base.py, one module per architecture.

Every architecture module defines `ModelArgs` (with `from_dict(config)`) and `Model`
(the model contract: args, make_cache, embed, layers, head, project, __call__ with
mask / positions / layer_ids / return_hidden). A new architecture is one file in
this folder plus one line in registry.py's ARCHITECTURES (Hugging Face `model_type`
-> module); the registry's names are re-exported here. Modules are imported on first use.
"""

from edgespec.models.registry import (
    ARCHITECTURES,
    DRAFTER_ONLY,
    get_architecture,
    model_from_config,
    supported_model_types,
)

__all__ = ["ARCHITECTURES", "DRAFTER_ONLY", "get_architecture", "model_from_config", "supported_model_types"]
