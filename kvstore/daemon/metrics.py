"""A daemon's Prometheus metrics: what its store, its core, its fronts and its repairs did.

One `CollectorRegistry` per daemon (several daemons in one test process never collide), served
by kvstore/daemon/metrics_http.py. Three kinds of series:

- the store's own families (`kvkeep_store_*`, kvstore/metrics.py): hits, misses, corrupt
  blocks, errors, bytes and latency per tier, write-behind drops and queue depth;
- RPCs, counted where both fronts meet the wire: `kvkeep_daemon_requests_total{front, rpc,
  code}` and `kvkeep_daemon_request_seconds{front, rpc}` (front `grpc` or `tcp`; a gRPC Put is
  a stream of blocks, a data plane PUT one block), and `kvkeep_daemon_put_refusals_total
  {front, reason}` for puts refused with a `RefusalReason` (kvstore/net/refusal.py);
- state read at scrape time (`DaemonCollector`): every counter the core keeps
  (`kvkeep_daemon_<name>_total`, whatever fields its `counters()` has: puts not admitted,
  invalid puts, repaired blocks ...), tier bytes, budgets, blocks and evictions, draining,
  pending writes, catalog size, and re-replication: passes, how long blocks have waited for a
  repair since membership changed (`kvkeep_daemon_rereplication_pending_seconds`), and each
  peer's reachability at the last pass (`kvkeep_daemon_peer_up`).

Reading state at scrape time, rather than copying it into gauges as it changes, keeps the hot
paths free of metric calls and the numbers equal to what Stat reports.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvstore.errors import KVKeepError
from kvstore.metrics import LabelledSeries, StoreMetrics
from kvstore.net.refusal import OK, RefusalReason, status_name
from kvstore.tiers.base import TierStats

__all__ = ["DaemonMetrics", "DaemonCollector", "DaemonState", "RepairState", "RpcCall",
           "RPC_BUCKETS", "BLOCK_RPCS"]

# From 100 us (a lookup on the event loop) to 30 s (a Put stream held by back-pressure).
RPC_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0,
               2.5, 5.0, 10.0, 30.0)
BLOCK_RPCS = ("Put", "Get")
"""The calls both fronts serve (the data plane's PUT and GET are named like gRPC's)."""
_CANCELLED = 1  # the client went away mid-call (gRPC's CANCELLED)
_UNKNOWN = 2
_REFUSALS = frozenset(int(reason) for reason in RefusalReason)


@dataclass(slots=True)
class RpcCall:
    """One call being timed; a front sets `code` to the status it answered with."""

    code: int = OK


class DaemonMetrics:
    """The families a daemon updates as it works; the rest is read by `DaemonCollector`."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._series = LabelledSeries()
        reg = self.registry
        self.store = StoreMetrics(reg)
        """Give this to the daemon's `TieredStore`."""
        self.requests = Counter("kvkeep_daemon_requests",
                                "Calls answered, by front (grpc, tcp), call and status code",
                                ["front", "rpc", "code"], registry=reg)
        self.request_seconds = Histogram("kvkeep_daemon_request_seconds",
                                         "Time to answer a call, by front and call",
                                         ["front", "rpc"], buckets=RPC_BUCKETS, registry=reg)
        self.put_refusals = Counter("kvkeep_daemon_put_refusals",
                                    "Puts refused, by front and reason (kvstore/net/refusal.py)",
                                    ["front", "reason"], registry=reg)
        self.etcd_records_ignored = Counter(
            "kvkeep_daemon_etcd_records_ignored",
            "Daemon registrations under the stores prefix that were not believed, by reason "
            "(malformed, no-lease, wrong-key, unproven, duplicate address, ...)",
            ["reason"], registry=reg)
        for front in ("grpc", "tcp"):
            for rpc in BLOCK_RPCS:
                self.requests.labels(front, rpc, "OK")
                self.request_seconds.labels(front, rpc)
            for reason in RefusalReason:
                self.put_refusals.labels(front, reason.name)

    @contextlib.contextmanager
    def timed(self, front: str, rpc: str) -> Iterator[RpcCall]:
        """Time one call; its status is `call.code` as the front left it, CANCELLED if the
        connection broke (OSError) and UNKNOWN on any other exception."""
        call = RpcCall()
        started = time.perf_counter()
        try:
            yield call
        except OSError:
            call.code = _CANCELLED
            raise
        except BaseException:
            if call.code == OK:
                call.code = _UNKNOWN
            raise
        finally:
            self.record(front, rpc, call.code, time.perf_counter() - started)

    def record(self, front: str, rpc: str, code: int, seconds: float) -> None:
        self._series(self.requests, front, rpc, status_name(code)).inc()
        self._series(self.request_seconds, front, rpc).observe(seconds)
        if rpc == "Put" and code in _REFUSALS:
            self.put_refusals.labels(front, RefusalReason(code).name).inc()


@contextlib.contextmanager
def timed_call(metrics: DaemonMetrics | None, front: str, rpc: str) -> Iterator[RpcCall]:
    """`metrics.timed(...)`, or an untimed call where a front runs without metrics."""
    if metrics is None:
        yield RpcCall()
        return
    with metrics.timed(front, rpc) as call:
        yield call


@dataclass(frozen=True, slots=True)
class RepairState:
    """Where re-replication stands (kvstore/daemon/replication.py)."""

    passes: int
    pending_seconds: float
    """How long since membership changed without a complete repair pass (0: up to date)."""
    last_pass_seconds: float
    blocks_checked: int
    peers: tuple[str, ...]
    failed_peers: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class DaemonState:
    """What a scrape reads: the core's counters, the store's tiers, and the rest."""

    counters: object
    """The core's counters: a dataclass of ints (kvstore/daemon/core.py `counters()`)."""
    tiers: tuple[TierStats, ...]
    pending_writes: int
    draining: bool
    catalog_keys: int
    repair: RepairState | None


class _StateSource(Protocol):
    def __call__(self) -> DaemonState: ...


class DaemonCollector(Collector):
    """Turns a `DaemonState` into metric families at each scrape."""

    def __init__(self, node_id: str, state: _StateSource) -> None:
        self._node_id = node_id
        self._state = state

    def describe(self) -> Iterable[Metric]:
        return ()  # families depend on the counters the core has: not known up front

    def collect(self) -> Iterable[Metric]:
        try:
            state = self._state()
        except KVKeepError:
            return []  # the store is closing: nothing to say rather than a failed scrape
        families: list[Metric] = [self._info()]
        families.extend(_counter_families(state.counters))
        families.extend(_tier_families(state.tiers))
        families.append(_gauge("kvkeep_daemon_pending_writes",
                               "Blocks waiting to be written behind (RAM to disk)",
                               state.pending_writes))
        families.append(_gauge("kvkeep_daemon_draining", "1 while the daemon drains",
                               int(state.draining)))
        families.append(_gauge("kvkeep_daemon_catalog_keys",
                               "Block keys the daemon knows it stores (for re-replication)",
                               state.catalog_keys))
        if state.repair is not None:
            families.extend(_repair_families(state.repair))
        return families

    def _info(self) -> Metric:
        info = GaugeMetricFamily("kvkeep_daemon_info", "This daemon (always 1)",
                                 labels=["node_id"])
        info.add_metric([self._node_id], 1)
        return info


def _gauge(name: str, doc: str, value: float) -> Metric:
    return GaugeMetricFamily(name, doc, value=value)


def _counter_families(counters: object) -> Iterator[Metric]:
    if not dataclasses.is_dataclass(counters) or isinstance(counters, type):
        return
    for field in dataclasses.fields(counters):
        value = getattr(counters, field.name)
        if isinstance(value, int):
            doc = (field.metadata.get("doc") if field.metadata else None) or \
                f"The daemon's {field.name.replace('_', ' ')} (both fronts)"
            yield CounterMetricFamily(f"kvkeep_daemon_{field.name}", doc, value=value)


def _tier_families(tiers: tuple[TierStats, ...]) -> Iterator[Metric]:
    specs: tuple[tuple[str, str, Callable[[TierStats], int], bool], ...] = (
        ("kvkeep_daemon_tier_bytes", "Bytes a tier holds", lambda t: t.bytes_used, False),
        ("kvkeep_daemon_tier_budget_bytes", "Bytes a tier may hold", lambda t: t.bytes_budget,
         False),
        ("kvkeep_daemon_tier_blocks", "Blocks a tier holds", lambda t: t.blocks, False),
        ("kvkeep_daemon_tier_evicted_blocks", "Blocks a tier evicted to make room (LRU)",
         lambda t: t.evictions, True))
    for name, doc, value, is_counter in specs:
        family: CounterMetricFamily | GaugeMetricFamily = (
            CounterMetricFamily(name, doc, labels=["tier"]) if is_counter
            else GaugeMetricFamily(name, doc, labels=["tier"]))
        for tier in tiers:
            family.add_metric([tier.name], value(tier))
        yield family


def _repair_families(repair: RepairState) -> Iterator[Metric]:
    yield CounterMetricFamily("kvkeep_daemon_rereplication_passes",
                              "Re-replication passes run", value=repair.passes)
    yield _gauge("kvkeep_daemon_rereplication_pending_seconds",
                 "Seconds since membership changed without a complete re-replication pass "
                 "(blocks may have fewer than R copies meanwhile); 0 when up to date",
                 repair.pending_seconds)
    yield _gauge("kvkeep_daemon_rereplication_last_pass_seconds",
                 "How long the last re-replication pass took", repair.last_pass_seconds)
    yield _gauge("kvkeep_daemon_rereplication_checked_blocks",
                 "Blocks the last re-replication pass checked", repair.blocks_checked)
    peers = GaugeMetricFamily("kvkeep_daemon_peer_up",
                              "Peers in etcd: 1 unless the last re-replication pass failed to "
                              "reach it", labels=["peer"])
    failed = set(repair.failed_peers)
    for peer in repair.peers:
        peers.add_metric([peer], 0 if peer in failed else 1)
    yield peers
