"""The router's side of worker membership: applies the backend's worker watch (or a caller's
own adds and removes) to the pool, the KV-event feeds and the indexes, and reports deaths to
the failover logic.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

from router.indexer.events import KVBlockIndex
from router.indexer.history import RoutingHistory
from router.workers import WorkerId, WorkerInfo, WorkerPool

__all__ = ["Registry", "EventFeeds"]

log = logging.getLogger(__name__)


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

    def reset_workers(self, infos: Iterable[WorkerInfo]) -> None:
        fresh = {i.worker_id: i for i in infos}
        for state in self.pool.states():
            if state.worker_id not in fresh:
                self.delete_worker(state.worker_id)
        for info in fresh.values():
            self.put_worker(info)

    def put_worker(self, info: WorkerInfo) -> None:
        known = info.worker_id in self.pool
        self.pool.upsert(info)
        if not known:
            log.info("worker %s joined (%s, models %s)", info.worker_id, info.url,
                     ",".join(info.models))
        if self.feeds is not None:
            self.feeds.follow(info.worker_id, info.kv_events)

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
