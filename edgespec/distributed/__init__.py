"""A verifier sharded over processes or machines (MLX's ring backend), drafter local.

Every rank runs the same program under `mlx.launch` (or `edgespec ... --distributed`):

    engine = edgespec.distributed.load(bundle, split="pipeline")   # None on ranks > 0
    if engine is not None:          # rank 0: a normal Engine over the sharded verifier
        print(engine.generate("Hello").text)
        engine.model.close()        # followers leave their loop and exit

`split`: "pipeline" (contiguous layer ranges per rank, hidden states passed rank to rank)
or "tensor" (every layer split by heads and MLP columns, partial sums all_sum'ed). Each
rank loads only its shard. The drafter (if any) runs on rank 0 only. See docs/distributed.md.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path

from edgespec.distributed.comm import Group
from edgespec.distributed.errors import EXIT_PEER_LOST, DistributedError
from edgespec.distributed.model import ShardedModel, follow
from edgespec.distributed.shard import MODES, load_shard
from edgespec.distributed.stage import Stage
from edgespec.drafters import attach_drafter
from edgespec.engine import Engine
from edgespec.models import get_architecture
from edgespec.tokenizer import Tokenizer
from edgespec.weights.bundle import read_manifest
from edgespec.weights.loader import LoadedModel

# The MLX-heavy parts load on first use, so the CLI's parser can import
# edgespec.distributed.launch without MLX.
_LAZY = {
    "Group": "edgespec.distributed.comm",
    "ShardedModel": "edgespec.distributed.model",
    "follow": "edgespec.distributed.model",
    "MODES": "edgespec.distributed.shard",
    "Plan": "edgespec.distributed.shard",
    "load_shard": "edgespec.distributed.shard",
    "shard_bytes": "edgespec.distributed.shard",
    "Stage": "edgespec.distributed.stage",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "EXIT_PEER_LOST",
    "MODES",
    "DistributedError",
    "Group",
    "Plan",
    "ShardedModel",
    "Stage",
    "follow",
    "load",
    "load_model",
    "load_shard",
    "shard_bytes",
]


def load_model(path: str | Path, split: str = "pipeline", timeout: float | None = None, on_lost=None,
               on_loaded=None):
    """Join the group and load this rank's shard.

    Rank 0 gets the ShardedModel; the other ranks serve rank 0's calls until it closes
    the group, then get None. `on_loaded(rank, local_model, plan)` runs on every rank once
    its shard is in memory (measurements).
    """
    if split not in MODES:
        raise DistributedError(f"distributed split {split!r}: use one of {', '.join(MODES)}")
    group = Group(timeout=timeout, on_lost=on_lost)
    local, plan, config = load_shard(path, split, group.rank, group.size)
    if on_loaded is not None:
        on_loaded(group.rank, local, plan)
    stage = Stage(local, plan, group.mx_group)
    if group.rank != 0:
        follow(stage, group)
        return None
    args = get_architecture(config.get("model_type", "llama")).ModelArgs.from_dict(config)
    return ShardedModel(stage, group, args)


def load(path: str | Path, split: str = "pipeline", drafter=None, history=None,
         verify_hashes: bool = True, timeout: float | None = None, on_lost=None, on_loaded=None):
    """An Engine over the sharded verifier on rank 0 (None on the other ranks, after rank 0 closes).

    `drafter` as in edgespec.load: the bundle's own drafter by default, "none", or a path;
    it is loaded on rank 0 only.
    """
    path = Path(path).expanduser()
    # every rank checks the bundle before the group forms; rank 0 also checks the hashes
    manifest = read_manifest(path, verify_hashes=verify_hashes and os.environ.get("MLX_RANK", "0") == "0")
    model = load_model(path, split, timeout, on_lost, on_loaded)
    if model is None:
        return None
    loaded = LoadedModel(model, Tokenizer.from_folder(path), path, manifest)
    engine = Engine(loaded, history=history)
    attach_drafter(engine, drafter)
    return engine
