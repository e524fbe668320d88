"""`StoreStats`: a snapshot of a store, read off its Prometheus counters and its tiers.

Not a second count: every number here is the sum of a `kvstore.metrics.StoreMetrics` family
over its labels, so `/metrics` and `stats()` can never disagree. (A metrics object shared by
several stores sums them all, as its series do.)
"""

from __future__ import annotations

from dataclasses import dataclass

from kvstore.metrics import StoreMetrics, total
from kvstore.tiers.base import TierStats

__all__ = ["StoreStats"]


@dataclass(frozen=True, slots=True)
class StoreStats:
    tiers: tuple[TierStats, ...]
    pending_writes: int
    hits: int
    misses: int
    corrupt: int
    errors: int
    write_behind_dropped: int

    @classmethod
    def of(cls, metrics: StoreMetrics, tiers: tuple[TierStats, ...], pending_writes: int
           ) -> StoreStats:
        return cls(tiers, pending_writes, hits=total(metrics.hits), misses=total(metrics.misses),
                   corrupt=total(metrics.corrupt), errors=total(metrics.errors),
                   write_behind_dropped=total(metrics.write_behind_dropped))
