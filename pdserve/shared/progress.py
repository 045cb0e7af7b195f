"""Progress bars on long loops (a model's load, the benchmarks): on a terminal only.

One decision for every bar: shown when stderr is a terminal, off otherwise (a service's log
file, a pipe, CI), so logs never fill with redrawn bars.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import TypeVar

from tqdm import tqdm

T = TypeVar("T")


def progress(items: Iterable[T], desc: str, total: int | None = None, unit: str = "it") -> Iterable[T]:
    """`items` as they come, counted on a bar on stderr when that is a terminal (cleared when done)."""
    return tqdm(items, desc=desc, total=total, unit=unit, leave=False, dynamic_ncols=True,
                disable=not sys.stderr.isatty())
