"""The router core: everything the router decides, callable without HTTP and without etcd.

One `RouterCore` holds the worker pool (load, in-flight accounting, failure marks), the prefix
indexes (KV events, routing history, sessions' token blocks), the policy's scheduler, the
session table with its stickiness and migration rules, session rebinding when a worker dies,
and the pre-request / post-response hooks (`router/hooks.py`). `kvkeep router serve` wraps one
in HTTP and etcd (`router/service.py`); a simulator or a test drives one directly:

- time comes from `clock` (default `time.monotonic`, and wall time for bindings, which replicas
  share): a simulator passes its own and every age (migration cooldown, suspicion, binding TTL,
  leases) follows it;
- the state backend defaults to the in-memory one, whose calls never wait: `place_now` places
  a request synchronously, and deferred work (binding renewals, rebinding) runs at once;
- workers come and go with `add_worker` / `remove_worker`, their metrics with `set_load`
  (what the scraper sets), their KV events with `apply_kv_events` (what the ZMQ subscriber
  feeds: vLLM's maps or the typed `router.indexer.kv_events`);
- a request is described by `RequestFeatures` (token ids or text, its tenant and cache
  salt), placed (`place`: decided, its session bound by compare-and-swap, the pick charged),
  and `finish`ed once its attempt ends (the load released, the session's tokens remembered, a
  restore hint settled).

Trust and bounds (`router/limits.py`): a session belongs to the tenant that created it
(another tenant's request for it is a 404, `SessionNotFound`); new sessions past
`limits.max_sessions` or `limits.max_sessions_per_tenant` are a 429 (`TooManySessions`); the
indexes are capped. With `bind_on_accept` (what `kvkeep router serve` runs) a new session's
binding is written only once a worker has accepted its first request (`accepted`), so
requests no worker takes create no state; without it (the default, a simulator's) `place`
binds at once. `allow` (None: any) is the worker allow-list registrations must match
(`router/membership/allowlist.py`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from kvstore.keys import SessionId
from router.decision import Decision, Placement, RequestFeatures, RouteRequest
from router.errors import SessionNotFound, StateUnavailable, TooManySessions
from router.hooks import (
    BindingSettler,
    Defer,
    HistoryRecorder,
    LoadAccounting,
    Outcome,
    PostResponse,
    PreRequest,
    SessionTokens,
)
from router.indexer.events import KVBlockIndex
from router.indexer.history import RoutingHistory, SessionBlocks, session_scope
from router.indexer.keys import salt_root, text_prefix_keys, token_block_keys
from router.indexer.kv_events import KVEvent
from router.limits import Limits
from router.membership.allowlist import WorkerAllowList
from router.membership.failover import Rebinder
from router.membership.registry import Registry
from router.membership.workers import WorkerId, WorkerInfo, WorkerLoad, WorkerPool, WorkerState
from router.metrics import RouterMetrics
from router.policy import Policy
from router.scheduler import Scheduler
from router.state.base import StateBackend
from router.state.bindings import VersionedBinding
from router.state.memory import MemoryBackend
from router.state.sessions import SessionTable
from router.tasks import run_now, run_now_discarding

__all__ = ["RouterCore", "CoreStatus"]

log = logging.getLogger(__name__)
_MAX_RACES = 3


@dataclass(frozen=True, slots=True)
class CoreStatus:
    workers: int
    usable_workers: int
    sessions: int
    kv_index_blocks: int
    kv_events_applied: int


class RouterCore:
    """See the module docstring. `defer` runs deferred work: None runs it at once in the caller
    (right for the in-memory backend; with a backend that does I/O, pass
    `router.tasks.BackgroundTasks()`)."""

    def __init__(self, policy: Policy, *, backend: StateBackend | None = None,
                 block_size: int = 32, session_ttl_s: float = 3600.0,
                 clock: Callable[[], float] | None = None, defer: Defer | None = None,
                 limits: Limits | None = None, allow: WorkerAllowList | None = None,
                 bind_on_accept: bool = False) -> None:
        self.clock: Callable[[], float] = clock or time.monotonic
        self.block_size = block_size
        self.limits = limits = limits or Limits()
        self.bind_on_accept = bind_on_accept
        self._pending: dict[SessionId, str] = {}
        """New sessions placed but not yet accepted by a worker (this replica's): their
        tenant, counted against the session limits meanwhile."""
        self._pending_by_tenant: dict[str, int] = {}
        self.defer: Defer = defer if defer is not None else run_now_discarding
        self._own_state: MemoryBackend | None = None
        if backend is None:
            backend = self._own_state = MemoryBackend(clock=self.clock)
        self.backend: StateBackend = backend
        self.pool = WorkerPool(clock=self.clock)
        self.history = RoutingHistory(limits.history_keys)
        self.blocks = KVBlockIndex(block_size, limits.shared_kv_blocks,
                                   limits.kv_blocks_per_worker)
        self.session_blocks = SessionBlocks(max_keys=limits.session_block_keys)
        self.scheduler = Scheduler(self.pool, policy, history=self.history, blocks=self.blocks,
                                   clock=self.clock)
        # Bindings are compared across replicas and restarts: wall time, unless simulated.
        self.sessions = SessionTable(self.backend, session_ttl_s, clock=clock or time.time)
        if self._own_state is not None:  # no watch task to feed the table: fed directly
            self._own_state.attach_bindings(self.sessions)
        self.metrics = RouterMetrics(
            workers=lambda: float(len(self.pool)),
            usable_workers=lambda: float(self.status().usable_workers),
            sessions=lambda: float(len(self.sessions)),
        )
        self.rebinder = Rebinder(self.scheduler, self.sessions, self.metrics,
                                 yield_every=None if defer is None else 256)
        self.blocks.on_over_cap = self.metrics.kv_events_dropped.labels("index-cap").inc
        self.registry = Registry(self.pool, self._worker_gone, history=self.history,
                                 blocks=self.blocks, allow=allow,
                                 max_workers=limits.max_workers,
                                 on_refused=lambda why: self.metrics.registrations_refused
                                 .labels(why).inc())
        accounting = LoadAccounting(self.pool)
        self.pre_request: list[PreRequest] = [accounting, HistoryRecorder(self.history)]
        """Run on every placement, in order; append your own."""
        self.post_response: list[PostResponse] = [
            accounting, SessionTokens(self.session_blocks, block_size),
            BindingSettler(self.sessions, self.defer)]
        """Run once when each placement's attempt ends, in order; append your own."""

    # --- policy ----------------------------------------------------------------------------
    @property
    def policy(self) -> Policy:
        return self.scheduler.policy

    @policy.setter
    def policy(self, policy: Policy) -> None:
        self.scheduler.policy = policy

    # --- workers, their load and their KV events -----------------------------------------
    def add_worker(self, info: WorkerInfo) -> None:
        """Register a worker (or update its registration), as the backend's watch does."""
        self.registry.put_worker(info)

    def remove_worker(self, worker: WorkerId) -> None:
        """A worker is gone: its caches are forgotten and its sessions rebound (deferred)."""
        self.registry.delete_worker(worker)

    def set_load(self, worker: WorkerId, *, running: int, waiting: int, kv_usage: float
                 ) -> None:
        """A fresh metrics reading, as the scraper sets it (it supersedes the optimistic
        charges made since the last one)."""
        self.pool.update_load(worker, WorkerLoad(running, waiting, kv_usage, self.clock()))

    def apply_kv_events(self, worker: WorkerId,
                        events: Iterable[Mapping[str, Any] | KVEvent]) -> None:
        for event in events:
            self.blocks.apply(worker, event)

    def workers(self) -> list[WorkerState]:
        return self.pool.states()

    def usable(self, state: WorkerState) -> bool:
        return state.usable(self.clock())

    def models(self) -> frozenset[str]:
        return self.pool.models()

    def session(self, session_id: SessionId) -> VersionedBinding | None:
        return self.sessions.get(session_id)

    def expire(self) -> None:
        """Forget the bindings unused for the session TTL, on `clock` (the core's own
        in-memory state; another backend expires them itself and its watch tells the core)."""
        if self._own_state is not None:
            self._own_state.reap()

    def status(self) -> CoreStatus:
        now = self.clock()
        return CoreStatus(len(self.pool), sum(1 for w in self.pool if w.usable(now)),
                          len(self.sessions), len(self.blocks), self.blocks.events_applied)

    # --- requests --------------------------------------------------------------------------
    def route(self, features: RequestFeatures, exclude: frozenset[WorkerId] = frozenset()
              ) -> RouteRequest:
        """The pipeline's view of a request: its prefix keys computed once."""
        root = salt_root(features.cache_salt)
        if features.prompt_tokens is not None:
            block_keys = token_block_keys(features.prompt_tokens, self.block_size, root)
        elif features.session_id is not None:
            block_keys = self.session_blocks.get(session_scope(features.tenant,
                                                               features.session_id))
        else:
            block_keys = ()
        return RouteRequest(features.model, features.session_id,
                            text_prefix_keys(features.text, root=root), block_keys,
                            features.estimated_tokens, exclude, features.tenant, root)

    def decide(self, route: RouteRequest, bound: WorkerId | None = None, *,
               migrate: bool = True) -> Decision:
        """The decision alone (no binding, no hooks): `Scheduler.decide`."""
        return self.scheduler.decide(route, bound, migrate=migrate)

    async def place(self, route: RouteRequest) -> Placement:
        """Decide, commit the session binding (CAS; on a lost race, follow the winner), then
        run the pre-request hooks. Raises `NoHealthyWorker` (503), `Saturated` (429),
        `TooManySessions` (429) or `SessionNotFound` (404). With `bind_on_accept`, a new
        session is not bound yet: the placement is `pending` until `accepted`."""
        sid = route.session_id
        current = self.sessions.get(sid) if sid is not None else None
        if current is not None and current.binding.owner != route.tenant:
            raise SessionNotFound("no such session", param="session_id")
        decision: Decision | None = None
        lost_race = False
        pending = False
        cooldown = self.scheduler.policy.thresholds.migrate_cooldown_s
        for _ in range(_MAX_RACES):
            young = current is not None and \
                self.sessions.clock() - current.binding.updated < cooldown
            started = time.perf_counter()
            decision = self.scheduler.decide(route, current.worker_id if current else None,
                                             migrate=not (lost_race or young))
            self.metrics.decision_seconds.observe(time.perf_counter() - started)
            if sid is None or (current is not None and decision.worker == current.worker_id):
                break
            if current is None:
                self._check_session_limits(route.tenant)
                if self.bind_on_accept:
                    pending = True
                    break
            try:
                won, now = await self.sessions.bind(
                    sid, decision.worker, route.model, expected=current,
                    reason=decision.reason.value, restore_from=decision.previous,
                    owner=route.tenant)
            except StateUnavailable as exc:
                # Route anyway: the session stays where this decision put it, unrecorded.
                log.warning("binding %s not recorded: %s", sid, exc)
                break
            if won:
                current = now
                if decision.previous is not None:
                    self.metrics.rebinds.labels(decision.reason.value).inc()
                break
            self.metrics.cas_conflicts.inc()
            current, lost_race = now, True  # another replica bound it first: follow theirs
            if current is not None and current.binding.owner != route.tenant:
                raise SessionNotFound("no such session", param="session_id")
        assert decision is not None
        self.metrics.decisions.labels(decision.reason.value).inc()
        placement = Placement(decision, current, route, pending=pending)
        if pending:
            assert sid is not None
            self._hold_pending(sid, route.tenant)
        self.admit(placement)
        return placement

    async def accepted(self, placement: Placement) -> tuple[bool, Placement]:
        """The worker accepted `placement`'s request (a 2xx): a pending new session is bound
        now. Returns (kept, placement): kept False when another replica bound the session
        first, with the placement now naming the winner's binding (a stream not yet relayed
        should follow it; a finished answer stays, and the next turn goes to the winner)."""
        if not placement.pending:
            return True, placement
        sid = placement.route.session_id
        assert sid is not None
        self._release_pending(sid)
        decision = placement.decision
        try:
            won, now = await self.sessions.bind(
                sid, decision.worker, placement.route.model, expected=None,
                reason=decision.reason.value, restore_from=decision.previous,
                owner=placement.route.tenant)
        except StateUnavailable as exc:
            log.warning("binding %s not recorded: %s", sid, exc)
            return True, replace(placement, pending=False)
        if not won:
            self.metrics.cas_conflicts.inc()
        return won, replace(placement, binding=now, pending=False)

    def place_now(self, route: RouteRequest) -> Placement:
        """`place`, synchronously: for a backend whose calls never wait (the in-memory one)."""
        return run_now(self.place(route))

    def admit(self, placement: Placement) -> None:
        """The pre-request hooks (`place` runs them)."""
        for hook in self.pre_request:
            hook.pre_request(placement)

    def finish(self, placement: Placement, outcome: Outcome) -> None:
        """The post-response hooks: call exactly once per placement, when its attempt ends."""
        if placement.pending and placement.route.session_id is not None:
            self._release_pending(placement.route.session_id)
        for hook in self.post_response:
            hook.post_response(placement, outcome)

    # --- private ---------------------------------------------------------------------------
    def _check_session_limits(self, tenant: str) -> None:
        limits = self.limits
        total = len(self.sessions) + len(self._pending)
        if total >= limits.max_sessions:
            self.metrics.sessions_refused.labels("total").inc()
            raise TooManySessions(
                f"the router holds {total} sessions, its limit (max_sessions "
                f"{limits.max_sessions}): reuse a session or retry once idle ones expire")
        owned = self.sessions.owned_by(tenant) + self._pending_by_tenant.get(tenant, 0)
        if owned >= limits.sessions_per_tenant:
            self.metrics.sessions_refused.labels("tenant").inc()
            raise TooManySessions(
                f"tenant {tenant!r} holds {owned} sessions, its limit (max_sessions_per_tenant "
                f"{limits.sessions_per_tenant}): reuse a session or retry once idle ones "
                "expire")

    def _hold_pending(self, sid: SessionId, tenant: str) -> None:
        if sid not in self._pending:
            self._pending[sid] = tenant
            self._pending_by_tenant[tenant] = self._pending_by_tenant.get(tenant, 0) + 1

    def _release_pending(self, sid: SessionId) -> None:
        tenant = self._pending.pop(sid, None)
        if tenant is not None:
            left = self._pending_by_tenant[tenant] - 1
            if left:
                self._pending_by_tenant[tenant] = left
            else:
                del self._pending_by_tenant[tenant]

    def _worker_gone(self, worker: WorkerId) -> None:
        self.metrics.worker_departures.labels(worker).inc()
        self.defer(self.rebinder.rebind(worker))
