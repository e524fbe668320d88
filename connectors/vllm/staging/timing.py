"""Where a pipeline's host threads spend their time (benchmarks read it; nothing decides on
it)."""

from __future__ import annotations

import threading

__all__ = ["StageTimes"]


class StageTimes:
    """Seconds per named step, summed over threads (so they can exceed wall time)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seconds: dict[str, float] = {}

    def add(self, step: str, seconds: float) -> None:
        with self._lock:
            self._seconds[step] = self._seconds.get(step, 0.0) + seconds

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return dict(self._seconds)

    def reset(self) -> None:
        with self._lock:
            self._seconds.clear()
