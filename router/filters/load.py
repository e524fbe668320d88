"""Load filters: saturation (hard: 429 when nobody passes) and the soft filters that keep new
sessions off hot workers (when nobody passes, the least-utilised workers take them instead).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from router.context import DecisionContext
from router.workers import WorkerState

__all__ = ["SaturationFilter", "KVThresholdFilter", "GpuFilter", "QueueThresholdFilter"]


@dataclass(frozen=True, slots=True)
class SaturationFilter:
    """Fewer than `max_waiting` requests queued: beyond that a worker takes nothing new."""

    max_waiting: int = 64
    name: str = "saturation"

    def apply(self, ctx: DecisionContext, candidates: Sequence[WorkerState]
              ) -> list[WorkerState]:
        limit = self.max_waiting
        return [w for w in candidates if w.waiting < limit]


@dataclass(frozen=True, slots=True)
class KVThresholdFilter:
    """KV-cache usage below `threshold` (default 85 %): a new session needs room to grow, and
    placing it on a nearly full cache forces evictions of sessions already there."""

    threshold: float = 0.85
    name: str = "kv-threshold"

    def apply(self, ctx: DecisionContext, candidates: Sequence[WorkerState]
              ) -> list[WorkerState]:
        limit = self.threshold
        return [w for w in candidates if w.kv_usage < limit]


@dataclass(frozen=True, slots=True)
class GpuFilter:
    """GPU below `max_temp_c` and its memory below `max_mem_frac` (NVML, where reported)."""

    max_temp_c: float = 85.0
    max_mem_frac: float = 0.97
    name: str = "gpu"

    def apply(self, ctx: DecisionContext, candidates: Sequence[WorkerState]
              ) -> list[WorkerState]:
        out = []
        for w in candidates:
            temp, mem = w.info.gpu_temp_c, w.info.gpu_mem_frac
            if temp is not None and temp >= self.max_temp_c:
                continue
            if mem is not None and mem >= self.max_mem_frac:
                continue
            out.append(w)
        return out


@dataclass(frozen=True, slots=True)
class QueueThresholdFilter:
    """Fewer than `max_queue` outstanding requests: new sessions avoid queueing behind hot
    workers even when those hold their prefix."""

    max_queue: int = 32
    name: str = "queue-threshold"

    def apply(self, ctx: DecisionContext, candidates: Sequence[WorkerState]
              ) -> list[WorkerState]:
        limit = self.max_queue
        return [w for w in candidates if w.queue < limit]
