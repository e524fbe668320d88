"""The router's side of worker membership: applies the backend's worker watch to the pool, the
KV-event subscriptions and the indexes, and reports deaths to the failover logic.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from router.indexer.history import RoutingHistory
from router.indexer.subscriber import KVEventSubscriber
from router.workers import WorkerId, WorkerInfo, WorkerPool

__all__ = ["Registry"]

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Registry:
    """A `WorkerSink`: keeps `pool` equal to the registered workers."""

    pool: WorkerPool
    on_gone: Callable[[WorkerId], None]
    subscriber: KVEventSubscriber | None = None
    history: RoutingHistory | None = None

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
        if self.subscriber is not None:
            self.subscriber.follow(info.worker_id, info.kv_events)

    def delete_worker(self, worker_id: WorkerId) -> None:
        if self.pool.remove(worker_id) is None:
            return
        log.warning("worker %s left (lease expired or revoked)", worker_id)
        if self.subscriber is not None:
            self.subscriber.unfollow(worker_id)
        if self.history is not None:
            self.history.forget_worker(worker_id)
        self.on_gone(worker_id)
