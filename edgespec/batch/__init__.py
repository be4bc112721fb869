"""Continuous batching of concurrent generations (see docs/batching.md)."""

from edgespec.batch.batcher import Batcher, Cancelled, Request, SeqModel
from edgespec.batch.forward import Row, batched_forward, group_rows
from edgespec.batch.memory import MemoryBudgetError

__all__ = ["Batcher", "Cancelled", "MemoryBudgetError", "Request", "Row", "SeqModel", "batched_forward",
           "group_rows"]
