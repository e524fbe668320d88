"""The connector's metrics on vLLM's own `/metrics`, through vLLM's KV-connector stats.

Why this path: vLLM 0.32 carries a connector's stats from the worker and the scheduler to the
API server with each step's output (`get_kv_connector_stats` -> `KVConnectorOutput` ->
`SchedulerStats` -> the API server's `PrometheusStatLogger`, which asks the connector class
for its Prometheus families with `build_prom_metrics`). That works unchanged whether the
engine core runs inside the API server (`VLLM_ENABLE_V1_MULTIPROCESSING=0`) or in its own
process (the default), and with several API servers (vLLM's multiprocess registry): the series
are served where vLLM's are, on the port operators already scrape, labelled with vLLM's
`model_name` and `engine`. A port of our own would need a second scrape target per worker
and, in multiprocess mode, a registry that only the engine process sees.

So each half reports *deltas* since its last report (`StatsReporter`), a `KVKeepStats` payload
of plain dicts (it crosses a process boundary as msgpack): counters, histogram observations
and gauges, each family a map from joined label values to a number. The API server's
`KVKeepPromMetrics` adds them up. Only the worker half reports its store's families (the
scheduler half may share that store object: it would count twice).

Families (all `kvkeep_connector_*`, labels `model_name`, `engine`, and those shown):

    restored_tokens_total, recomputed_tokens_total   tokens the store gave vLLM / promised but
                                                     failed to (vLLM recomputed them)
    restore_seconds                                  per load job, start to last block
    save_lag_seconds                                 per block, its step's start to stored
    store_copy_lag_seconds{tier}                     per block and tier, its computation to
                                                     the tier's acknowledgement (remote: the
                                                     R-th daemon's): the recovery point
    load_failures_total{cause}                       missing, corrupt, mismatch, late, error
    saved_blocks_total, save_failures_total{cause}   failed, backpressure, load_error
    events_total{event}                              every counter of connectors.vllm.stats
    restore_decisions_total{decision}                lookups with a hit, by the restore-or-
                                                     recompute decision: restore, recompute,
                                                     partial (connectors.vllm.restore_cost)
    restore_decision_tokens_total{action}            stored tokens it chose to load (restore)
                                                     or to compute instead (recompute)
    store_<family>_total{...}                        the worker's `TieredStore` counters
                                                     (kvstore/metrics.py): hits, tier_misses
                                                     and corrupt_blocks by tier, misses,
                                                     errors by tier and op, write-behind drops
                                                     by reason ...
    store_write_queue_depth                          background writes pending
    unprotected_tokens, unprotected_tokens_max       tokens computed in complete blocks and
                                                     not yet stored (all requests; the worst
                                                     one): the recovery point in tokens, from
                                                     the scheduler half
    daemon_breaker{daemon, state}                    1 for each remote daemon's breaker state
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from connectors.vllm.stats import Count, Counts
from connectors.vllm.telemetry import Telemetry
from kvstore.metrics import COPY_LAG_BUCKETS, DROP_REASONS, StoreMetrics
from kvstore.store import TieredStore
from kvstore.tiers.remote.tier import RemoteTier

if TYPE_CHECKING:
    from vllm.config import VllmConfig

__all__ = ["KVKeepStats", "KVKeepPromMetrics", "StatsReporter", "PREFIX", "STORE_COUNTERS",
           "RESTORE_BUCKETS", "SAVE_LAG_BUCKETS", "LOAD_CAUSES"]

PREFIX = "kvkeep_connector_"
_SEP = "\x1f"  # joins label values into one msgpack-safe string key

LOAD_CAUSES: Mapping[Count, str] = {
    Count.LOAD_MISSING: "missing", Count.LOAD_CORRUPT: "corrupt",
    Count.LOAD_MISMATCH: "mismatch", Count.LOAD_LATE: "late", Count.LOAD_ERRORS: "error"}
_SAVE_CAUSES: Mapping[Count, str] = {
    Count.SAVE_FAILED: "failed", Count.SAVE_BACKPRESSURE: "backpressure",
    Count.SAVE_DROPPED_AFTER_LOAD_ERROR: "load_error"}
_DECISIONS: Mapping[Count, str] = {
    Count.DECIDED_RESTORE: "restore", Count.DECIDED_RECOMPUTE: "recompute",
    Count.DECIDED_PARTIAL: "partial"}
_DECISION_TOKENS: Mapping[Count, str] = {
    Count.DECIDED_RESTORE_TOKENS: "restore", Count.DECIDED_RECOMPUTE_TOKENS: "recompute"}
STORE_COUNTERS: Mapping[str, tuple[str, ...]] = {
    "hits": ("tier",), "tier_misses": ("tier",), "misses": (), "corrupt": ("tier",),
    "errors": ("tier", "op"), "deadline_misses": (), "read_bytes": ("tier",),
    "written_bytes": ("tier",), "rejected_puts": ("tier",), "promotions": ("tier",),
    "write_behind_dropped": ("reason",)}
"""`StoreMetrics` counter attributes and their labels (a test checks this covers them all)."""
_BREAKER_STATES = ("closed", "half_open", "open")
# A restore from RAM takes milliseconds, from a remote daemon up to its deadline (seconds).
RESTORE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
SAVE_LAG_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


def _store_family(metrics: StoreMetrics, attr: str) -> str:
    """`kvkeep_store_hits` -> `kvkeep_connector_store_hits`."""
    counter: Counter = getattr(metrics, attr)
    name = next(iter(counter.describe())).name
    return PREFIX + name.removeprefix("kvkeep_")


_FAMILY_OF = {attr: _store_family(StoreMetrics(), attr) for attr in STORE_COUNTERS}


@dataclass
class KVKeepStats(KVConnectorStats):
    """One report: {"counters"|"gauges": {family: {labels: value}}, "observations": {family:
    [seconds]}} (families without the prefix; labels joined by \\x1f; a labelled histogram's
    observations under its family and labels joined so)."""

    def __post_init__(self) -> None:
        for part in ("counters", "gauges", "observations"):
            self.data.setdefault(part, {})

    def reset(self) -> None:
        self.data = {"counters": {}, "gauges": {}, "observations": {}}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        """Counts add up, observations join, the latest gauges win (the workers of one
        engine, or the scheduler and the worker of one step)."""
        theirs = other.data
        for family, series in theirs.get("counters", {}).items():
            mine = self.data["counters"].setdefault(family, {})
            for labels, value in series.items():
                mine[labels] = mine.get(labels, 0) + value
        for family, values in theirs.get("observations", {}).items():
            self.data["observations"].setdefault(family, []).extend(values)
        for family, series in theirs.get("gauges", {}).items():
            self.data["gauges"].setdefault(family, {}).update(series)
        return self

    def reduce(self) -> dict[str, int | float]:
        """What vLLM's periodic log line shows: the counters and the observation counts."""
        out: dict[str, int | float] = {}
        for family, series in self.data["counters"].items():
            out[family] = sum(series.values())
        for family, values in self.data["observations"].items():
            name = f"{family.split(_SEP)[0]}_count"
            out[name] = out.get(name, 0) + len(values)
        return out

    def is_empty(self) -> bool:
        return not any(self.data.get(part) for part in ("counters", "gauges", "observations"))


class StatsReporter:
    """One connector half's deltas since its last report (None when nothing changed).

    The store's families are read at most every `store_interval_s` (walking its metrics costs
    tens of microseconds, a step can be a millisecond), and always with a restore or a save
    to report, so a step that did something carries everything up to it.
    """

    def __init__(self, counters: Counts, *, block_size: int, store: TieredStore | None = None,
                 telemetry: Telemetry | None = None, store_interval_s: float = 0.5,
                 unprotected: Callable[[], tuple[int, int]] | None = None) -> None:
        """`unprotected`: the scheduler half's (all, worst request's) unsaved tokens."""
        self._counters = counters
        self._unprotected = unprotected
        self._last_unprotected: tuple[int, int] | None = None
        self._unprotected_at = -math.inf
        self._block_size = block_size
        self._store = store
        self._telemetry = telemetry
        self._interval = store_interval_s
        self._last_events: dict[str, int] = {}
        self._last_store: dict[tuple[str, str], float] = {}
        self._store_read_at = 0.0

    def take(self) -> KVKeepStats | None:
        stats = KVKeepStats()
        counters: dict[str, dict[str, float]] = stats.data["counters"]
        self._events(counters)
        batch = self._telemetry.take() if self._telemetry is not None else None
        if batch:
            bs = self._block_size
            restored = sum(r.restored for r in batch.restores)
            promised = sum(r.blocks for r in batch.restores)
            _add(counters, "restored_tokens", "", restored * bs)
            _add(counters, "recomputed_tokens", "", (promised - restored) * bs)
            observations = stats.data["observations"]
            if batch.restores:
                observations["restore_seconds"] = [r.seconds for r in batch.restores]
            if batch.save_lags:
                observations["save_lag_seconds"] = list(batch.save_lags)
        now = time.monotonic()
        # A walk over the requests being served: on the scheduler's step, so at most every
        # `store_interval_s`, like the store's families.
        if self._unprotected is not None and now - self._unprotected_at >= self._interval:
            self._unprotected_at = now
            current = self._unprotected()
            if current != self._last_unprotected:  # a gauge: sent when it changes
                self._last_unprotected = current
                stats.data["gauges"]["unprotected_tokens"] = {"": float(current[0])}
                stats.data["gauges"]["unprotected_tokens_max"] = {"": float(current[1])}
        if self._store is not None and (batch or now - self._store_read_at >= self._interval):
            self._store_read_at = now
            self._store_families(counters, stats.data["gauges"])
            self._copy_lags(stats.data["observations"])
        return None if stats.is_empty() else stats

    def _events(self, counters: dict[str, dict[str, float]]) -> None:
        snapshot = self._counters.snapshot().as_dict()
        for name, value in snapshot.items():
            delta = value - self._last_events.get(name, 0)
            if not delta:
                continue
            self._last_events[name] = value
            _add(counters, "events", name, delta)
            try:
                event = Count(name)
            except ValueError:
                continue
            if event in LOAD_CAUSES:
                _add(counters, "load_failures", LOAD_CAUSES[event], delta)
            elif event in _SAVE_CAUSES:
                _add(counters, "save_failures", _SAVE_CAUSES[event], delta)
            elif event == Count.SAVED_BLOCKS:
                _add(counters, "saved_blocks", "", delta)
            elif event in _DECISIONS:
                _add(counters, "restore_decisions", _DECISIONS[event], delta)
            elif event in _DECISION_TOKENS:
                _add(counters, "restore_decision_tokens", _DECISION_TOKENS[event], delta)

    def _store_families(self, counters: dict[str, dict[str, float]],
                        gauges: dict[str, dict[str, float]]) -> None:
        assert self._store is not None
        metrics = self._store.metrics
        for attr, labels in STORE_COUNTERS.items():
            family = _FAMILY_OF[attr].removeprefix(PREFIX)
            counter: Counter = getattr(metrics, attr)
            for metric in counter.collect():
                for sample in metric.samples:
                    if not sample.name.endswith("_total"):
                        continue
                    key = _SEP.join(sample.labels.get(label, "") for label in labels)
                    last = self._last_store.get((family, key), 0.0)
                    if sample.value != last:
                        self._last_store[(family, key)] = sample.value
                        _add(counters, family, key, sample.value - last)
        gauges["store_write_queue_depth"] = {"": float(self._store.pending_writes)}
        breakers: dict[str, float] = {}
        for tier in self._store.tiers:
            if isinstance(tier, RemoteTier):
                for daemon, state in tier.breaker_states().items():
                    for candidate in _BREAKER_STATES:
                        breakers[daemon + _SEP + candidate] = float(candidate == state)
        if breakers:
            gauges["daemon_breaker"] = breakers


    def _copy_lags(self, observations: dict[str, list[float]]) -> None:
        assert self._store is not None
        for tier, seconds in self._store.metrics.recent_copy_lags.take():
            observations.setdefault(f"store_copy_lag_seconds{_SEP}{tier}", []).append(seconds)


def _add(families: dict[str, dict[str, float]], family: str, labels: str, value: float) -> None:
    series = families.setdefault(family, {})
    series[labels] = series.get(labels, 0) + value


class KVKeepPromMetrics(KVConnectorPromMetrics):
    """Registers the families in the API server's registry and adds each report to them."""

    def __init__(self, vllm_config: VllmConfig, metric_types: dict[type[Any], type[Any]],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]],
                 tier_names: Sequence[str] = ()) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        # vLLM hands in its own classes (multiprocess-aware ones where it needs them).
        self._counter_type = cast("type[Counter]", metric_types[Counter])
        self._gauge_type = cast("type[Gauge]", metric_types[Gauge])
        self._histogram_type = cast("type[Histogram]", metric_types[Histogram])
        self._counters: dict[str, tuple[Counter, int]] = {}
        self._histograms: dict[str, tuple[Histogram, int]] = {}
        self._gauges: dict[str, tuple[Gauge, int]] = {}
        self._breakers: dict[int, set[str]] = {}
        self._counter("restored_tokens", "Prompt tokens restored from the kvkeep store", ())
        self._counter("recomputed_tokens", "Tokens the store was to restore but vLLM "
                      "recomputed (a block missing, corrupt, late ... and every one after it)",
                      ())
        self._counter("load_failures", "Blocks that failed to restore, by cause", ("cause",))
        self._counter("saved_blocks", "Blocks checkpointed into the store", ())
        self._counter("save_failures", "Blocks not saved, by cause", ("cause",))
        self._counter("events", "Every counter of the connector (connectors.vllm.stats)",
                      ("event",))
        self._counter("restore_decisions", "Lookups with a hit, by what the restore-or-"
                      "recompute decision made of it (restore all, recompute, partial)",
                      ("decision",))
        self._counter("restore_decision_tokens", "Stored tokens the restore-or-recompute "
                      "decision chose to load (restore) or to compute instead (recompute)",
                      ("action",))
        for attr, labels in STORE_COUNTERS.items():
            family = _FAMILY_OF[attr].removeprefix(PREFIX)
            self._counter(family, f"The connector's store: {attr.replace('_', ' ')}", labels)
        self._histogram("restore_seconds", "Time to restore a load job (a step's loads, or an "
                        "asynchronous request), first block read to last scattered",
                        RESTORE_BUCKETS)
        self._histogram("save_lag_seconds", "Time from the step that computed a block to its "
                        "checkpoint being stored", SAVE_LAG_BUCKETS)
        self._histogram("store_copy_lag_seconds", "Time from a block's computation until a tier "
                        "of the connector's store acknowledged its copy (remote: the R-th "
                        "daemon): how much KV a node that dies takes along",
                        COPY_LAG_BUCKETS, ("tier",))
        self._gauge("store_write_queue_depth",
                    "Background writes (write-behind, promotions) the store has pending", ())
        self._gauge("daemon_breaker", "1 for the state each remote daemon's circuit breaker is "
                    "in (closed, half_open, open)", ("daemon", "state"))
        self._gauge("unprotected_tokens", "Tokens in complete blocks computed and not yet held "
                    "by the store, over the requests being served: what a node's death now "
                    "would lose", ())
        self._gauge("unprotected_tokens_max", "The most such tokens of one request (its "
                    "recovery point, in tokens)", ())
        # Every series that can be known up front exists from the start at 0: a first failure
        # must read as a rise, not as a series appearing.
        for values in per_engine_labelvalues.values():
            for counter, arity in self._counters.values():
                if arity == 0:
                    counter.labels(*values)
            for cause in LOAD_CAUSES.values():
                self._counters["load_failures"][0].labels(*values, cause)
            for cause in _SAVE_CAUSES.values():
                self._counters["save_failures"][0].labels(*values, cause)
            for decision in _DECISIONS.values():
                self._counters["restore_decisions"][0].labels(*values, decision)
            for action in _DECISION_TOKENS.values():
                self._counters["restore_decision_tokens"][0].labels(*values, action)
            for event in Count:
                self._counters["events"][0].labels(*values, event.value)
            for reason in DROP_REASONS:
                self._counters["store_write_behind_dropped"][0].labels(*values, reason)
            for attr, labels in STORE_COUNTERS.items():
                if labels == ("tier",):
                    tiered = self._counters[_FAMILY_OF[attr].removeprefix(PREFIX)][0]
                    for tier in tier_names:
                        tiered.labels(*values, tier)
            for histogram, arity in self._histograms.values():
                if arity == 0:
                    histogram.labels(*values)
            for tier in tier_names:
                self._histograms["store_copy_lag_seconds"][0].labels(*values, tier)
            self._gauges["store_write_queue_depth"][0].labels(*values).set(0)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        values = self.per_engine_labelvalues.get(engine_idx)
        if values is None:
            return
        for family, series in transfer_stats_data.get("counters", {}).items():
            known = self._counters.get(family)
            if known is None:
                continue  # a family a newer worker sends: skipped, never a crash
            counter, arity = known
            for labels, value in series.items():
                if value > 0:
                    counter.labels(*values, *_split(labels, arity)).inc(value)
        for key, observed in transfer_stats_data.get("observations", {}).items():
            family, _, labels = key.partition(_SEP)
            known_histogram = self._histograms.get(family)
            if known_histogram is not None:
                histogram, arity = known_histogram
                child = histogram.labels(*values, *_split(labels, arity))
                for seconds in observed:
                    child.observe(seconds)
        for family, series in transfer_stats_data.get("gauges", {}).items():
            known_gauge = self._gauges.get(family)
            if known_gauge is None:
                continue
            gauge, arity = known_gauge
            if family == "daemon_breaker":
                self._forget_gone_daemons(gauge, values, engine_idx, series.keys())
            for labels, value in series.items():
                gauge.labels(*values, *_split(labels, arity)).set(value)

    # -- private --------------------------------------------------------------------------------

    def _counter(self, family: str, doc: str, labels: Iterable[str]) -> None:
        names = list(labels)
        self._counters[family] = (self._counter_type(
            name=_fresh(PREFIX + family), documentation=doc,
            labelnames=[*self._labelnames, *names]), len(names))

    def _histogram(self, family: str, doc: str, buckets: Sequence[float],
                   labels: Iterable[str] = ()) -> None:
        names = list(labels)
        self._histograms[family] = (self._histogram_type(
            name=_fresh(PREFIX + family), documentation=doc,
            labelnames=[*self._labelnames, *names], buckets=list(buckets)), len(names))

    def _gauge(self, family: str, doc: str, labels: Iterable[str]) -> None:
        names = list(labels)
        self._gauges[family] = (self._gauge_type(
            name=_fresh(PREFIX + family), documentation=doc,
            labelnames=[*self._labelnames, *names], multiprocess_mode="mostrecent"), len(names))

    def _forget_gone_daemons(self, gauge: Gauge, values: list[object], engine_idx: int,
                             keys: Iterable[str]) -> None:
        """Drop the series of daemons that left (a breaker map lists every known one)."""
        now = {key.split(_SEP)[0] for key in keys}
        for daemon in self._breakers.get(engine_idx, set()) - now:
            for state in _BREAKER_STATES:
                with contextlib.suppress(KeyError):
                    gauge.remove(*values, daemon, state)
        self._breakers[engine_idx] = now


def _split(labels: str, arity: int) -> list[str]:
    parts = labels.split(_SEP) if arity else []
    return (parts + [""] * arity)[:arity]


def _fresh(name: str) -> str:
    """`name`, after unregistering whatever holds it in the default registry: vLLM builds its
    stat loggers anew for every engine a process starts (tests, restarts), and unregisters
    only its own `vllm:` families before doing so."""
    collector = REGISTRY._names_to_collectors.get(name)  # as vLLM's unregister_vllm_metrics
    if collector is not None:
        REGISTRY.unregister(collector)
    return name
