"""Loading a sharded verifier: join the group, load this rank's shard, an Engine over it on rank 0."""

from __future__ import annotations

import os
from pathlib import Path

from edgespec.distributed.comm import Group
from edgespec.distributed.errors import DistributedError
from edgespec.distributed.model import ShardedModel, follow
from edgespec.distributed.shard import MODES, load_shard
from edgespec.distributed.stage import Stage
from edgespec.drafters import attach_drafter
from edgespec.engine import Engine
from edgespec.models import get_architecture
from edgespec.tokenizer import Tokenizer
from edgespec.weights.bundle import read_manifest
from edgespec.weights.loader import LoadedModel


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
