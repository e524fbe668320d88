"""Timings the worker half records as it works: how long restores take, how far saves trail.

Counters say how often (`connectors.vllm.stats`); these say how long, one observation per
event, kept until `connectors.vllm.prometheus` takes them for vLLM's stats (then they become
histograms on vLLM's `/metrics`):

restores      per load job (a step's synchronous loads together, or one asynchronous request):
              seconds from the job's start to its last block scattered (or to its failure),
              and how many blocks it promised and how many vLLM got (vLLM recomputes from a
              failed block on, so blocks after one count as not restored)
save lags     per block stored: seconds from the step that computed it (or the flush of its
              finished request) to its put returning (written through to the first tier)
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

__all__ = ["Telemetry", "RestoreTiming", "TelemetryBatch"]

# A worker that nobody asks for stats (vLLM with stats logging off) must not grow forever.
_MAX_PENDING = 4096


@dataclass(frozen=True, slots=True)
class RestoreTiming:
    seconds: float
    blocks: int
    """Blocks the job was to restore (the scheduler promised them to vLLM)."""
    restored: int
    """Blocks vLLM got (before the first failure of each request)."""


@dataclass(frozen=True, slots=True)
class TelemetryBatch:
    restores: tuple[RestoreTiming, ...] = ()
    save_lags: tuple[float, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.restores or self.save_lags)


@dataclass(slots=True)
class Telemetry:
    """Thread-safe: the loader and saver threads record, the engine's thread takes."""

    _lock: threading.Lock = field(default_factory=threading.Lock)
    _restores: list[RestoreTiming] = field(default_factory=list)
    _save_lags: list[float] = field(default_factory=list)

    def restore(self, seconds: float, *, blocks: int, restored: int) -> None:
        with self._lock:
            if len(self._restores) < _MAX_PENDING:
                self._restores.append(RestoreTiming(seconds, blocks, restored))

    def saved(self, lag_seconds: float) -> None:
        with self._lock:
            if len(self._save_lags) < _MAX_PENDING:
                self._save_lags.append(lag_seconds)

    def take(self) -> TelemetryBatch:
        """Everything recorded since the last `take`."""
        with self._lock:
            batch = TelemetryBatch(tuple(self._restores), tuple(self._save_lags))
            self._restores.clear()
            self._save_lags.clear()
        return batch
