"""Load filters: saturation (hard: 429 when nobody passes) and the soft filters that keep new
sessions off hot workers (when nobody passes, the least-utilised workers take them instead).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from router.context import DecisionContext
from router.membership.workers import WorkerState

__all__ = ["SaturationFilter", "KVThresholdFilter", "GpuFilter", "QueueThresholdFilter",
           "BoundedLoadFilter"]


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


@dataclass(frozen=True, slots=True)
class BoundedLoadFilter:
    """Consistent hashing with bounded loads (Mirrokni, Thorup and Zadimoghaddam, SODA 2018;
    HAProxy's `hash-balance-factor`): a worker takes the request only if, with it, its
    outstanding requests stay within `factor` times the mean, ceil(factor x (total + 1) / n).

    Prefix locality is what makes a worker attractive, and with nothing to bound it a worker
    holding popular prefixes keeps taking them however long its queue grows (a prefix score
    outweighs any load score once the gap between holders and the rest exceeds the load
    weights). The bound lets locality decide among workers near the mean and spills the rest
    to the next-best worker, where kvkeep's store turns the prefix into a restore. When loads
    are even, as on saturated workers, nobody is over it and locality decides alone. The
    least-loaded worker always passes (it is at or below the mean), so the filter never
    leaves nobody.
    """

    factor: float = 1.25
    name: str = "bounded-load"

    def apply(self, ctx: DecisionContext, candidates: Sequence[WorkerState]
              ) -> list[WorkerState]:
        if len(candidates) < 2:
            return list(candidates)
        queues = [w.queue for w in candidates]
        cap = math.ceil(self.factor * (sum(queues) + 1) / len(candidates))
        return [w for w, q in zip(candidates, queues, strict=True) if q + 1 <= cap]
