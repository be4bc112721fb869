"""A verifier sharded over processes or machines (MLX's ring backend), drafter local.

Every rank runs the same program under `mlx.launch` (or `edgespec ... --distributed`):

    engine = edgespec.distributed.load(bundle, split="pipeline")   # None on ranks > 0
    if engine is not None:          # rank 0: a normal Engine over the sharded verifier
        print(engine.generate("Hello").text)
        engine.model.close()        # followers leave their loop and exit

`split`: "pipeline" (contiguous layer ranges per rank, hidden states passed rank to rank)
or "tensor" (every layer split by heads and MLP columns, partial sums all_sum'ed). Each
rank loads only its shard. The drafter (if any) runs on rank 0 only. load and load_model:
loading.py; the pieces: comm.py, shard.py, stage.py, model.py, launch.py. See docs/distributed.md.

The names below are re-exported lazily (each imported from its module on first use), so
the CLI's `add_distributed_arguments` (launch.py) does not load mlx.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from edgespec.lazy import lazy_exports

if TYPE_CHECKING:
    from edgespec.distributed.comm import Group
    from edgespec.distributed.errors import EXIT_PEER_LOST, DistributedError
    from edgespec.distributed.loading import load, load_model
    from edgespec.distributed.model import ShardedModel, follow
    from edgespec.distributed.shard import MODES, Plan, load_shard, shard_bytes
    from edgespec.distributed.stage import Stage

# public name -> the module that defines it
_EXPORTS = {
    "Group": "edgespec.distributed.comm",
    "EXIT_PEER_LOST": "edgespec.distributed.errors",
    "DistributedError": "edgespec.distributed.errors",
    "load": "edgespec.distributed.loading",
    "load_model": "edgespec.distributed.loading",
    "ShardedModel": "edgespec.distributed.model",
    "follow": "edgespec.distributed.model",
    "MODES": "edgespec.distributed.shard",
    "Plan": "edgespec.distributed.shard",
    "load_shard": "edgespec.distributed.shard",
    "shard_bytes": "edgespec.distributed.shard",
    "Stage": "edgespec.distributed.stage",
}

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


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
