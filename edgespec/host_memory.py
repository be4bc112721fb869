"""This machine's memory, in bytes: total and available now (psutil when installed, else os.sysconf).

Below every layer that sizes something from memory (the prefix cache's limit check, the
drafter-fits and batch budgets), so the probe is written once.
"""

from __future__ import annotations

import os


def _probe(field: str, pages: str) -> int | None:
    """psutil.virtual_memory().<field>, else os.sysconf(<pages>) pages of SC_PAGE_SIZE; None when neither answers."""
    try:
        import psutil  # optional: psutil

        return int(getattr(psutil.virtual_memory(), field))
    except ImportError:
        try:
            return os.sysconf(pages) * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return None


def total_memory() -> int | None:
    """The machine's physical memory."""
    return _probe("total", "SC_PHYS_PAGES")


def available_memory() -> int | None:
    """The memory available now (free, and reclaimable without swapping)."""
    return _probe("available", "SC_AVPHYS_PAGES")
