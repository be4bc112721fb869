"""The adaptive decoder behind `auto`: candidate sources, acceptance estimates, the round loop."""

from edgespec.adaptive.corpus import CorpusTable
from edgespec.adaptive.decoder import AdaptiveDecoder
from edgespec.adaptive.estimate import AcceptanceStats, Costs, merge_candidates, plan_tree
from edgespec.adaptive.history import HistoryStore, make_history
from edgespec.adaptive.sources import (
    Candidate,
    Capabilities,
    ContextSource,
    CorpusSource,
    DrafterSource,
    HistorySource,
)

__all__ = [
    "AcceptanceStats",
    "AdaptiveDecoder",
    "Candidate",
    "Capabilities",
    "ContextSource",
    "CorpusSource",
    "CorpusTable",
    "Costs",
    "DrafterSource",
    "HistorySource",
    "HistoryStore",
    "make_history",
    "merge_candidates",
    "plan_tree",
]
