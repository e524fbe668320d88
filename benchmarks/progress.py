"""One progress line per phase of a long benchmark, on stderr (stdout keeps the results).

    from benchmarks.progress import progress
    progress("nvme tier: put and get, 5 repeats")

prints `[store +12.3s] nvme tier: put and get, 5 repeats`: which benchmark, how long since it
started, what it does now. One line per phase or step, never per iteration.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

__all__ = ["progress"]

_STARTED = time.monotonic()


def progress(what: str) -> None:
    name = Path(sys.argv[0]).stem if sys.argv and sys.argv[0] else "benchmark"
    print(f"[{name} +{time.monotonic() - _STARTED:.1f}s] {what}", file=sys.stderr, flush=True)
