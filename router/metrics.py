"""The router's Prometheus metrics, in a registry of its own (several routers can share a
process in tests without colliding in the global registry)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

__all__ = ["RouterMetrics", "CONTENT_TYPE_LATEST"]

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_DECISION_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 5e-3)


class RouterMetrics:
    __slots__ = (
        "cas_conflicts",
        "decision_seconds",
        "decisions",
        "kv_event_blocks",
        "kv_events_dropped",
        "rebinds",
        "registrations_refused",
        "registry",
        "request_seconds",
        "requests",
        "resumptions",
        "sessions",
        "sessions_refused",
        "upstream_failures",
        "upstream_oversize",
        "worker_departures",
        "workers",
    )

    def __init__(self, *, workers: Callable[[], float], usable_workers: Callable[[], float],
                 sessions: Callable[[], float]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("kvkeep_router_requests", "Requests by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.request_seconds = Histogram("kvkeep_router_request_seconds",
                                         "Time to the last byte, by endpoint and streaming",
                                         ["endpoint", "stream"], buckets=_LATENCY_BUCKETS,
                                         registry=r)
        self.decisions = Counter("kvkeep_router_decisions", "Routing decisions by reason",
                                 ["reason"], registry=r)
        self.decision_seconds = Histogram("kvkeep_router_decision_seconds",
                                          "Time to decide (filters, scorers, picker)",
                                          buckets=_DECISION_BUCKETS, registry=r)
        self.upstream_failures = Counter("kvkeep_router_upstream_failures",
                                         "Requests or streams a worker failed", ["worker"],
                                         registry=r)
        self.resumptions = Counter("kvkeep_router_stream_resumptions",
                                   "Broken streams resumed on another worker, by outcome",
                                   ["outcome"], registry=r)
        self.rebinds = Counter("kvkeep_router_session_rebinds",
                               "Sessions moved to another worker, by reason", ["reason"],
                               registry=r)
        self.cas_conflicts = Counter("kvkeep_router_binding_conflicts",
                                     "Session binding writes lost to another replica",
                                     registry=r)
        self.registrations_refused = Counter(
            "kvkeep_router_worker_registrations_refused",
            "Worker registrations ignored (url: not in the allow-list; events: KV-event "
            "endpoint not allowed, not subscribed; capacity: over the worker limit)",
            ["reason"], registry=r)
        self.kv_event_blocks = Counter(
            "kvkeep_router_kv_event_blocks",
            "Blocks named by the workers' KV events and applied to the prefix index (stored "
            "and removed); flat under traffic means no event arrives", registry=r)
        self.kv_events_dropped = Counter(
            "kvkeep_router_kv_events_dropped",
            "KV events dropped, in blocks (bytes: a message over a worker's byte budget, "
            "counted 1; rate: over its block budget; index-cap: over its index entries)",
            ["reason"], registry=r)
        self.sessions_refused = Counter(
            "kvkeep_router_sessions_refused",
            "New sessions refused at a limit (tenant, total)", ["limit"], registry=r)
        self.upstream_oversize = Counter(
            "kvkeep_router_upstream_oversize",
            "Worker answers over a size limit (body, event, tokens)",
            ["what"], registry=r)
        self.worker_departures = Counter(
            "kvkeep_router_worker_departures",
            "Workers that left (lease expired or revoked), by worker: one leaving again and "
            "again is flapping", ["worker"], registry=r)
        self.workers = Gauge("kvkeep_router_workers", "Workers known and usable", ["state"],
                             registry=r)
        self.workers.labels("registered").set_function(workers)
        self.workers.labels("usable").set_function(usable_workers)
        self.sessions = Gauge("kvkeep_router_sessions", "Session bindings cached", registry=r)
        self.sessions.set_function(sessions)

    def render(self) -> bytes:
        return generate_latest(self.registry)
