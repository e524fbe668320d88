"""Prometheus metrics of the tiered store: hits, misses, corruption, errors, bytes, latency.

They are the store's one record of what happened: `TieredStore.stats()` is computed from these
same counters (`total`), never counted twice.

Every metric lives in a `CollectorRegistry` the caller passes in (the daemon passes the one it
exposes); by default each `StoreMetrics` gets a private registry, so tests and several stores in
one process never collide on metric names. Per-tier series carry a `tier` label with the tier's
name, so adding a tier to the store's configuration adds series, not code.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence
from typing import TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics import MetricWrapperBase

_Family = TypeVar("_Family", bound=MetricWrapperBase)

__all__ = ["StoreMetrics", "RecentObservations", "LabelledSeries", "LATENCY_BUCKETS",
           "COPY_LAG_BUCKETS", "DROP_REASONS", "total"]

DROP_REASONS = ("queue_full", "source_gone", "closed", "error")
"""Why a background write is given up (`write_behind_dropped`'s `reason` label)."""

# From 50 us (a host hit) to 2.5 s (a remote tier past any sensible deadline).
LATENCY_BUCKETS = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25,
                   0.5, 1.0, 2.5)
# From 0.5 ms (a synchronous copy on loopback) to 30 s (a write-behind queue far behind).
COPY_LAG_BUCKETS = (5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                    10.0, 30.0)


class LabelledSeries:
    """The series of metric families by label values, each looked up once.

    prometheus_client's `labels()` validates its arguments and takes a lock on every call
    (1.5-2 us more than updating the series it returns, measured here), and a daemon's request
    path makes several such calls per block. A series, once made, is the same object for as long
    as its family lives (nothing in kvkeep removes series), so it is kept. Bounded by the label
    sets in use: tier names, operations, fronts, calls, status codes.
    """

    __slots__ = ("_series",)

    def __init__(self) -> None:
        self._series: dict[tuple[MetricWrapperBase, tuple[str, ...]], MetricWrapperBase] = {}

    def __call__(self, family: _Family, *labels: str) -> _Family:
        key = (family, labels)
        series = self._series.get(key)
        if series is None:  # a racing first lookup stores the same series again: harmless
            series = self._series[key] = family.labels(*labels)
        return series  # type: ignore[return-value]  # labels() returns the family's own type


class RecentObservations:
    """The latest observations of a labelled histogram, for one reader that exports them again
    elsewhere (the vLLM connector, on vLLM's `/metrics`): a histogram's own samples are bucket
    counts, from which the values (and so an exact sum) cannot be recovered. Bounded: with no
    reader, only the newest `maxlen` are kept."""

    def __init__(self, maxlen: int = 4096) -> None:
        self._lock = threading.Lock()
        self._items: deque[tuple[str, float]] = deque(maxlen=maxlen)

    def add(self, label: str, value: float) -> None:
        with self._lock:
            self._items.append((label, value))

    def take(self) -> list[tuple[str, float]]:
        """Every (label, value) added since the last `take`, oldest first."""
        with self._lock:
            items = list(self._items)
            self._items.clear()
        return items


class StoreMetrics:
    """The store's metric families; thread-safe (prometheus_client locks each series)."""

    def __init__(self, registry: CollectorRegistry | None = None, *,
                 prefix: str = "kvkeep_store") -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        reg = self.registry
        self.hits = Counter(f"{prefix}_hits", "Block reads served, by the tier that served them",
                            ["tier"], registry=reg)
        self.tier_misses = Counter(f"{prefix}_tier_misses", "Block reads a tier did not hold",
                                   ["tier"], registry=reg)
        self.misses = Counter(f"{prefix}_misses",
                              "Block reads no tier could serve (the caller recomputes)",
                              registry=reg)
        self.corrupt = Counter(f"{prefix}_corrupt_blocks",
                               "Blocks that failed verification and were deleted", ["tier"],
                               registry=reg)
        self.errors = Counter(f"{prefix}_errors",
                              "Tier operations that raised; the tier counted as empty",
                              ["tier", "op"], registry=reg)
        self.deadline_misses = Counter(f"{prefix}_deadline_misses",
                                       "Reads and lookups cut short by their deadline",
                                       registry=reg)
        self.read_bytes = Counter(f"{prefix}_read_bytes", "Verified payload bytes read",
                                  ["tier"], registry=reg)
        self.written_bytes = Counter(f"{prefix}_written_bytes", "Frame bytes written",
                                     ["tier"], registry=reg)
        self.rejected_puts = Counter(f"{prefix}_rejected_puts",
                                     "Puts a tier did not admit (budget, disk full)", ["tier"],
                                     registry=reg)
        self.promotions = Counter(f"{prefix}_promotions",
                                  "Blocks copied up into a tier after a hit below it", ["tier"],
                                  registry=reg)
        self.write_behind_dropped = Counter(
            f"{prefix}_write_behind_dropped",
            "Background writes given up: queue_full (never blocks the caller), "
            "source_gone (evicted before it was copied down), closed (store shut down), "
            "error (the batch failed in the store itself: a bug, logged)",
            ["reason"], registry=reg)
        self.write_queue_depth = Gauge(f"{prefix}_write_queue_depth",
                                       "Background writes (write-behind, promotion) pending",
                                       registry=reg)
        self.latency = Histogram(f"{prefix}_latency_seconds", "Tier operation latency",
                                 ["tier", "op"], buckets=LATENCY_BUCKETS, registry=reg)
        # The recovery point: how much KV a node that dies now could take with it.
        self.copy_lag = Histogram(
            f"{prefix}_copy_lag_seconds",
            "From a block's computation (the put's computed_at, else the put) until a tier "
            "acknowledged its copy; for a remote tier, until its R-th daemon did",
            ["tier"], buckets=COPY_LAG_BUCKETS, registry=reg)
        self.recent_copy_lags = RecentObservations()
        """`copy_lag`'s observations as (tier, seconds), for the connector to export."""
        for reason in DROP_REASONS:
            self.write_behind_dropped.labels(reason)

    def declare_tiers(self, names: Sequence[str]) -> None:
        """Create every per-tier series at 0, so that a scrape shows the tiers before anything
        happened to them (a series that appears only on its first corrupt block would read as
        "no data", not as 0, and `rate()` over it would miss that first one)."""
        for name in names:
            for family in (self.hits, self.tier_misses, self.corrupt, self.read_bytes,
                           self.written_bytes, self.rejected_puts, self.promotions):
                family.labels(name)


def total(counter: Counter, **labels: str) -> int:
    """A counter's value summed over its series (those matching `labels`, when given)."""
    value = 0.0
    for metric in counter.collect():
        for sample in metric.samples:
            if sample.name.endswith("_total") and all(
                    sample.labels.get(k) == v for k, v in labels.items()):
                value += sample.value
    return int(value)
