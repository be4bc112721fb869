"""Continuous batching of concurrent generations (see docs/batching.md)."""

from edgespec.batch.batcher import Batcher
from edgespec.batch.forward import Row, batched_forward, group_rows
from edgespec.batch.memory import MemoryBudgetError
from edgespec.batch.request import Cancelled, Request
from edgespec.batch.seq import SeqModel

__all__ = ["Batcher", "Cancelled", "MemoryBudgetError", "Request", "Row", "SeqModel", "batched_forward",
           "group_rows"]
