"""The router's side of worker membership: applies the backend's worker watch (or a caller's
own adds and removes) to the pool, the KV-event feeds and the indexes, and reports deaths to
the failover logic.

A registration is a claim: the backend believes it only under a live lease and under the key
its id names (router/state/etcd.py); then, with an allow-list
(`router/membership/allowlist.py`), only one whose URL matches (the entries bound to its id,
where it has any) becomes a worker, and its KV-event endpoint is followed only if that matches
too. A refused one is ignored, counted by reason and logged once; a known worker re-registered
with a refused URL leaves (its sessions are rebound). Past `max_workers`, new workers are
refused.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Protocol

from router.indexer.events import KVBlockIndex
from router.indexer.history import RoutingHistory
from router.membership.allowlist import WorkerAllowList
from router.membership.workers import WorkerId, WorkerInfo, WorkerPool

__all__ = ["Registry", "EventFeeds"]

log = logging.getLogger(__name__)
_LOGGED_REFUSALS = 4096


class EventFeeds(Protocol):
    """Whatever brings each worker's KV events to the index (the ZMQ `KVEventSubscriber`)."""

    def follow(self, worker: WorkerId, endpoint: str | None) -> None: ...

    def unfollow(self, worker: WorkerId) -> None: ...


@dataclass(slots=True)
class Registry:
    """A `WorkerSink`: keeps `pool` equal to the registered workers."""

    pool: WorkerPool
    on_gone: Callable[[WorkerId], None]
    feeds: EventFeeds | None = None
    history: RoutingHistory | None = None
    blocks: KVBlockIndex | None = None
    allow: WorkerAllowList | None = None
    max_workers: int | None = None
    on_refused: Callable[[str], None] | None = None
    refused: int = 0
    _logged: set[tuple[str, str]] = field(default_factory=set)

    def reset_workers(self, infos: Iterable[WorkerInfo]) -> None:
        fresh = {i.worker_id: i for i in infos}
        for state in self.pool.states():
            if state.worker_id not in fresh:
                self.delete_worker(state.worker_id)
        for info in fresh.values():
            self.put_worker(info)

    def put_worker(self, info: WorkerInfo) -> None:
        known = info.worker_id in self.pool
        if self.allow is not None:
            why = self.allow.url_refusal(info.url, info.worker_id)
            if why is not None:
                self._refuse("url", info, why)
                if known:
                    self.delete_worker(info.worker_id)
                return
            if info.kv_events is not None:
                why = self.allow.events_refusal(info.kv_events, info.worker_id)
                if why is not None:
                    self._refuse("events", info, why)
                    info = replace(info, kv_events=None)
        if not known and self.max_workers is not None and len(self.pool) >= self.max_workers:
            self._refuse("capacity", info, f"the router already has {len(self.pool)} workers "
                         f"(max_workers {self.max_workers})")
            return
        self.pool.upsert(info)
        if not known:
            log.info("worker %s joined (%s, models %s)", info.worker_id, info.url,
                     ",".join(info.models))
        if self.feeds is not None:
            self.feeds.follow(info.worker_id, info.kv_events)

    def _refuse(self, reason: str, info: WorkerInfo, why: str) -> None:
        self.refused += 1
        if self.on_refused is not None:
            self.on_refused(reason)
        key = (info.worker_id, f"{reason}:{info.url}:{info.kv_events}")
        if key in self._logged:
            return
        if len(self._logged) < _LOGGED_REFUSALS:
            self._logged.add(key)
            what = "KV events of" if reason == "events" else "registration of"
            log.warning("ignoring the %s worker %r: %s", what, info.worker_id, why)
        elif len(self._logged) == _LOGGED_REFUSALS:
            self._logged.add(("", ""))
            log.warning("more refused worker registrations: counted, no longer logged")

    def delete_worker(self, worker_id: WorkerId) -> None:
        if self.pool.remove(worker_id) is None:
            return
        log.warning("worker %s left (lease expired or revoked)", worker_id)
        if self.feeds is not None:
            self.feeds.unfollow(worker_id)
        # Its caches died with it (a store's shared blocks are not its: they stay).
        if self.blocks is not None:
            self.blocks.forget_worker(worker_id)
        if self.history is not None:
            self.history.forget_worker(worker_id)
        self.on_gone(worker_id)
