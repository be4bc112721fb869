"""Progress bars for long work (tqdm on stderr), silenced when not wanted."""

from __future__ import annotations

import sys
from contextlib import contextmanager

from tqdm import tqdm


@contextmanager
def progress_bar(total=None, desc: str = "", unit: str = "it", enable: bool = True, unit_scale=False):
    bar = tqdm(
        total=total,
        desc=desc,
        unit=unit,
        unit_scale=unit_scale,
        disable=not enable,
        file=sys.stderr,
        dynamic_ncols=True,
        leave=True,
    )
    try:
        yield bar
    finally:
        bar.close()
