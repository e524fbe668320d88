"""What the workers and the daemons counted during a run, summed across their restarts.

Workers and daemons that are killed come back with counters at zero, so a run's totals are
kept as Prometheus' `increase()` keeps them: each poll adds what grew since the last one, and a
counter found lower than before (a restart) adds its whole new value. Sources are polled once a
second, and once more just before a fault kills them, so little is lost with a dead process.

- Workers: vLLM's `/metrics` (`deploy.observe.scrape_engine`): prompt tokens found in the local
  prefix cache, tokens the kvkeep connector loaded from the store (`external` hits), and the
  prompt tokens queried. Restored = external hits; recomputed = queried - local - external.
- Daemons: their Stat (gRPC, with the cluster's all-tenant token when they check tokens): puts,
  rejected puts, gets, hits, misses, and per tier the blocks that failed verification
  (`corrupt`, deleted when found) — read from the reply directly, since the client's
  `DaemonStat` leaves the per-tier counters out.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping

from deploy.observe import scrape_engine

__all__ = ["CounterTally", "engine_counters", "daemon_counters", "daemon_refusals", "Poller"]


class CounterTally:
    """Increases of named counters per source, across resets (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last: dict[tuple[str, str], float] = {}
        self._total: dict[str, float] = {}
        self._by_source: dict[str, dict[str, float]] = {}

    def observe(self, source: str, values: Mapping[str, float]) -> None:
        with self._lock:
            mine = self._by_source.setdefault(source, {})
            for name, value in values.items():
                last = self._last.get((source, name))
                grew = value if last is None or value < last else value - last
                if last is None:
                    grew = 0.0  # the first poll is the baseline
                self._last[(source, name)] = value
                self._total[name] = self._total.get(name, 0.0) + grew
                mine[name] = mine.get(name, 0.0) + grew

    def total(self, name: str) -> int:
        with self._lock:
            return int(self._total.get(name, 0.0))

    def by_source(self, name: str) -> dict[str, int]:
        with self._lock:
            return {s: int(v.get(name, 0.0)) for s, v in self._by_source.items()}


def engine_counters(url: str) -> dict[str, float] | None:
    cache = scrape_engine(url, timeout_s=2.0)
    if cache is None:
        return None
    return {"prompt_tokens": cache.queries, "local_hit_tokens": cache.local_hits,
            "restored_tokens": cache.external_hits,
            "recomputed_tokens": cache.queries - cache.local_hits - cache.external_hits}


def daemon_counters(address: str, token: str | None, timeout_s: float = 2.0
                    ) -> dict[str, float] | None:
    """A daemon's Stat counters; None when it does not answer in time."""
    import grpc  # type: ignore[import-untyped, unused-ignore]

    from kvstore._proto import kvstore_pb2 as pb
    from kvstore.net.grpc_options import KVSTORE_SERVICE

    metadata = (("authorization", f"Bearer {token}"),) if token else ()
    channel = grpc.insecure_channel(address)
    try:
        stat = channel.unary_unary(f"/{KVSTORE_SERVICE}/Stat",
                                   request_serializer=pb.StatRequest.SerializeToString,
                                   response_deserializer=pb.StatReply.FromString)
        reply = stat(pb.StatRequest(), timeout=timeout_s, metadata=metadata)
    except grpc.RpcError:
        return None
    finally:
        channel.close()
    values: dict[str, float] = {
        "puts": reply.puts, "rejected_puts": reply.rejected_puts,
        "invalid_puts": reply.invalid_puts, "gets": reply.gets, "hits": reply.hits,
        "misses": reply.misses, "corrupt_blocks": sum(t.corrupt for t in reply.tiers),
        "tier_errors": sum(t.errors for t in reply.tiers)}
    for t in reply.tiers:
        values[f"{t.name}_puts"] = t.puts
        values[f"{t.name}_rejected_puts"] = t.rejected_puts
        values[f"{t.name}_corrupt"] = t.corrupt
    return values


def daemon_refusals(metrics_url: str, reason: str, timeout_s: float = 2.0) -> float | None:
    """Puts a daemon refused with `reason` (its /metrics' kvkeep_daemon_put_refusals_total, all
    fronts); None when it does not answer. A full disk is refused at admission, before any
    tier sees the put, so the tiers' own counters do not show it."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    try:
        resp = httpx.get(f"{metrics_url}/metrics", timeout=timeout_s)
        resp.raise_for_status()
    except httpx.HTTPError:
        return None
    return sum(s.value for family in text_string_to_metric_families(resp.text)
               if family.name == "kvkeep_daemon_put_refusals"
               for s in family.samples
               if s.name.endswith("_total") and s.labels.get("reason") == reason)


_Read = Callable[[], Mapping[str, float] | None]


class Poller:
    """Polls every source into its tally once a second on a thread, and on demand."""

    def __init__(self, sources: Callable[[], Mapping[str, _Read]], tally: CounterTally,
                 period_s: float = 1.0) -> None:
        self._sources = sources
        self.tally = tally
        self._period = period_s
        self._stop = threading.Event()
        self._polling = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="chaos-poller", daemon=True)

    def start(self) -> None:
        self.poll()
        self._thread.start()

    def poll(self, only: str | None = None) -> None:
        # One poll at a time: two interleaved reads of a source would look like a reset.
        with self._polling:
            for name, read in self._sources().items():
                if only is not None and name != only:
                    continue
                values = read()
                if values is not None:
                    self.tally.observe(name, values)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self.poll()

    def _run(self) -> None:
        while not self._stop.wait(self._period):
            self.poll()
