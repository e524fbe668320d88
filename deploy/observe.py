"""Where the numbers of a run come from: vLLM's `/metrics` and the kvstore daemons' Stat.

"Was this KV restored or recomputed?" is answered from the outside by two independent
sources (the connector's own counters reach vLLM's /metrics only with engine steps):

- vLLM counts, per engine, prompt tokens found in its local prefix cache
  (`vllm:prefix_cache_hits`) and tokens a KV connector claimed to hold
  (`vllm:external_prefix_cache_hits`). Both are counted when a request is admitted; a block
  that then fails to load is recomputed without moving them back.
- The daemons count the blocks they served (`gets`, `hits`, `get_bytes_sent`): KV that really
  travelled from the store. A restore after a worker died can only be served from there (the
  dead worker's RAM tier died with it).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import httpx

from kvstore.errors import KVKeepError

if TYPE_CHECKING:
    from kvstore.net.daemon_client import ClientTLS

__all__ = ["EngineCache", "StoreTraffic", "scrape_engine", "scrape_stores"]


@dataclass(frozen=True, slots=True)
class EngineCache:
    """One vLLM engine's prefix-cache counters, in tokens."""

    queries: float = 0.0
    local_hits: float = 0.0
    external_queries: float = 0.0
    external_hits: float = 0.0
    prefetched_blocks: float = 0.0
    """Blocks the kvkeep connector pulled into host RAM on failover hints (its `events`
    counter `prefetch_blocks`; vLLM publishes connector stats with an engine step, so a
    prefetch shows once the engine has run one since)."""

    def __sub__(self, before: EngineCache) -> EngineCache:
        return EngineCache(self.queries - before.queries, self.local_hits - before.local_hits,
                           self.external_queries - before.external_queries,
                           self.external_hits - before.external_hits,
                           self.prefetched_blocks - before.prefetched_blocks)


@dataclass(frozen=True, slots=True)
class StoreTraffic:
    """Summed over daemons: blocks stored and served since they started."""

    blocks: int = 0
    puts: int = 0
    gets: int = 0
    hits: int = 0
    get_bytes: int = 0
    reachable: int = 0

    def __sub__(self, before: StoreTraffic) -> StoreTraffic:
        return StoreTraffic(self.blocks - before.blocks, self.puts - before.puts,
                            self.gets - before.gets, self.hits - before.hits,
                            self.get_bytes - before.get_bytes, self.reachable)


_ENGINE_METRICS = {
    "vllm:prefix_cache_queries": "queries",
    "vllm:prefix_cache_hits": "local_hits",
    "vllm:external_prefix_cache_queries": "external_queries",
    "vllm:external_prefix_cache_hits": "external_hits",
}


def scrape_engine(worker_url: str, timeout_s: float = 5.0) -> EngineCache | None:
    """The engine's counters now; None when it cannot be reached (a dead worker)."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        resp = httpx.get(f"{worker_url}/metrics", timeout=timeout_s)
        resp.raise_for_status()
    except httpx.HTTPError:
        return None
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(resp.text):
        if family.name == "kvkeep_connector_events":
            values["prefetched_blocks"] = sum(
                s.value for s in family.samples
                if s.name.endswith("_total") and s.labels.get("event") == "prefetch_blocks")
            continue
        key = _ENGINE_METRICS.get(family.name)
        if key is None:
            continue
        values[key] = sum(s.value for s in family.samples if s.name.endswith("_total"))
    return EngineCache(**values)


def scrape_stores(daemons: Iterable[tuple[str, str]], timeout_s: float = 2.0,
                  tls: ClientTLS | None = None) -> StoreTraffic:
    """Sum of the Stat counters of `(node_id, host:port)` daemons (over mTLS with `tls`);
    unreachable ones skipped."""
    from kvstore.net.daemon_client import DaemonClient

    total = StoreTraffic()
    for node_id, address in daemons:
        client = DaemonClient(node_id, address, data_plane=False, tls=tls)
        try:
            s = client.stat(timeout=timeout_s)
        except KVKeepError:
            continue
        finally:
            client.close()
        total = StoreTraffic(total.blocks + s.blocks, total.puts + s.puts, total.gets + s.gets,
                             total.hits + s.hits, total.get_bytes + s.get_bytes_sent,
                             total.reachable + 1)
    return total
