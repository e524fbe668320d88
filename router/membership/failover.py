"""Failover of sessions: rebinding a dead worker's sessions to the survivors.

Rebinding runs when the worker's registration disappears (lease expired or revoked). Every
replica sees that DELETE and tries to move each session the dead worker held; the
compare-and-swap on each binding lets exactly one move win, and the others adopt it through
their watch. Moved bindings carry `restore_from`, so the session's next request (on any
replica) tells the new worker's connector to restore the KV from the store. The winning write
also leaves a prefetch hint for the new worker (kvstore/cluster/hints.py): its connector pulls
the session's blocks into host RAM before that request arrives.

Sessions are spread over the survivors with the same scheduler that routes requests, each
placement charged as if a request had gone there, so a hundred orphaned sessions do not all
land on the single least-loaded worker.

(A stream broken mid-generation is the other failover; its continuation lives with streaming,
`router/streaming/resume.py`.)
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

from router.decision import RouteReason, RouteRequest
from router.errors import RouterError
from router.membership.workers import WorkerId
from router.metrics import RouterMetrics
from router.scheduler import Scheduler
from router.state.sessions import SessionTable

__all__ = ["Rebinder"]

log = logging.getLogger(__name__)


def _no_salt(tenant: str) -> str | None:
    return None


@dataclass(slots=True)
class Rebinder:
    """`yield_every`: give the event loop a turn after this many sessions, so requests keep
    being served during a big rebind; None never yields (a caller that runs the rebind to
    completion at once, without a loop: a simulator)."""

    scheduler: Scheduler
    sessions: SessionTable
    metrics: RouterMetrics
    yield_every: int | None = 256
    salt_of: Callable[[str], str | None] = _no_salt
    """The cache salt of a tenant's requests (the router's API keys set one per tenant), for
    the prefetch hint: the new worker's connector finds the session's blocks under it."""

    async def rebind(self, worker: WorkerId) -> int:
        """Move every session bound to `worker`; returns how many this replica moved."""
        moved = 0
        charged: list[WorkerId] = []
        pool = self.scheduler.pool
        every = self.yield_every
        try:
            for i, sid in enumerate(self.sessions.bound_to(worker)):
                if every is not None and i % every == every - 1:
                    await asyncio.sleep(0)
                current = self.sessions.get(sid)
                if current is None or current.worker_id != worker:
                    continue  # expired, or another replica already moved it
                request = RouteRequest(model=current.binding.model, session_id=sid)
                try:
                    decision = self.scheduler.decide(request, worker)
                except RouterError as exc:
                    log.warning("cannot rebind sessions of %s: %s", worker, exc)
                    break
                pool.charge(decision.worker, 0)
                charged.append(decision.worker)
                try:
                    won, _ = await self.sessions.bind(
                        sid, decision.worker, current.binding.model, expected=current,
                        reason=RouteReason.FAILOVER.value, restore_from=worker,
                        prefetch=True, salt=self.salt_of(current.binding.owner))
                except RouterError as exc:
                    log.warning("rebinding %s failed: %s", sid, exc)
                    continue
                if won:
                    moved += 1
                    self.metrics.rebinds.labels(RouteReason.FAILOVER.value).inc()
                else:
                    self.metrics.cas_conflicts.inc()
        finally:
            for w in charged:
                pool.release(w, 0)
        if moved:
            log.warning("rebound %d sessions of dead worker %s", moved, worker)
        return moved
