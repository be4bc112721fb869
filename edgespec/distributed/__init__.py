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
"""

from edgespec.distributed.comm import Group
from edgespec.distributed.errors import EXIT_PEER_LOST, DistributedError
from edgespec.distributed.loading import load, load_model
from edgespec.distributed.model import ShardedModel, follow
from edgespec.distributed.shard import MODES, Plan, load_shard, shard_bytes
from edgespec.distributed.stage import Stage

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
