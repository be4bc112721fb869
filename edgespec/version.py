"""edgespec's version, below every module that records it (learnt-cost keys, the CLI)."""

__version__ = "0.1.0"
