"""One router replica: the parts assembled, started and stopped together.

`RouterService.place` is the seam between deciding and sending: it decides, then commits a
changed session binding by compare-and-swap, re-deciding if another replica won the race, and
returns a `Placement` the proxy sends on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any

import aiohttp

from router.agent import AgentConfig, WorkerAgent
from router.api import ClientRequest
from router.bindings import VersionedBinding
from router.config import RouterConfig
from router.decision import Decision, RouteReason, RouteRequest
from router.errors import StateUnavailable
from router.failover import Rebinder
from router.indexer.events import KVBlockIndex
from router.indexer.history import RoutingHistory, SessionBlocks
from router.indexer.keys import text_prefix_keys, token_block_keys
from router.indexer.subscriber import KVEventSubscriber
from router.metrics import RouterMetrics
from router.policy import build_policy
from router.registry import Registry
from router.scheduler import Scheduler
from router.scraper import Scraper
from router.sessions import SessionTable
from router.state.base import StateBackend
from router.state.etcd import EtcdBackend
from router.state.memory import MemoryBackend
from router.workers import WorkerId, WorkerPool

__all__ = ["RouterService", "Placement"]

log = logging.getLogger(__name__)
_MAX_RACES = 3


@dataclass(frozen=True, slots=True)
class Placement:
    """A decision plus the session binding in force after committing it."""

    decision: Decision
    binding: VersionedBinding | None
    route: RouteRequest

    @property
    def worker(self) -> WorkerId:
        return self.decision.worker

    @property
    def restore_from(self) -> WorkerId | None:
        """The worker the session's KV was on, when it has to be restored here."""
        if self.decision.previous is not None:
            return self.decision.previous
        return self.binding.binding.restore_from if self.binding is not None else None

    @property
    def label(self) -> str:
        """What happened, for `X-KVKeep-Route`: a pending restore reports why it moved."""
        if self.decision.reason is RouteReason.STICKY and self.restore_from is not None \
                and self.binding is not None:
            return self.binding.binding.reason
        return self.decision.reason.value


class RouterService:
    def __init__(self, config: RouterConfig, backend: StateBackend | None = None) -> None:
        self.config = config
        self.backend: StateBackend = backend if backend is not None else (
            EtcdBackend(config.etcd_url, config.etcd_prefix) if config.etcd_url
            else MemoryBackend())
        self.pool = WorkerPool()
        self.history = RoutingHistory()
        self.blocks = KVBlockIndex(config.block_size)
        self.session_blocks = SessionBlocks()
        policy = build_policy(config.policy, weights=dict(config.weights),
                              thresholds=config.thresholds)
        self.scheduler = Scheduler(self.pool, policy, history=self.history, blocks=self.blocks)
        self.sessions = SessionTable(self.backend, config.session_ttl_s)
        now = time.monotonic
        self.metrics = RouterMetrics(
            workers=lambda: float(len(self.pool)),
            usable_workers=lambda: float(sum(1 for w in self.pool if w.usable(now()))),
            sessions=lambda: float(len(self.sessions)),
        )
        self.rebinder = Rebinder(self.scheduler, self.sessions, self.metrics)
        self.subscriber: KVEventSubscriber | None = None
        self.http: aiohttp.ClientSession | None = None
        self.stream_timeout = aiohttp.ClientTimeout()
        self.unary_timeout = aiohttp.ClientTimeout()
        self._tasks: list[asyncio.Task[None]] = []
        self._background: set[asyncio.Task[Any]] = set()

    # --- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        cfg = self.config
        if not self.backend.shared:
            log.warning("no --etcd: in-process state, one router replica only (sessions and "
                        "workers are not shared and do not survive a restart)")
        await self.backend.start()
        # Workers' cookies are not kept: one jar shared by every client would replay one
        # client's cookies for all (and filtering it costs every request).
        self.http = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=60),
            auto_decompress=False, cookie_jar=aiohttp.DummyCookieJar(),
        )
        # A stream may run for as long as it keeps producing; only silence breaks it. A unary
        # request is silent until its whole answer is ready, so it gets a total bound instead.
        self.stream_timeout = aiohttp.ClientTimeout(
            total=None, connect=cfg.connect_timeout_s, sock_read=cfg.stream_idle_timeout_s)
        self.unary_timeout = aiohttp.ClientTimeout(
            total=cfg.request_timeout_s, connect=cfg.connect_timeout_s)
        self.subscriber = KVEventSubscriber(self.blocks)
        registry = Registry(self.pool, self.rebinder.worker_gone, self.subscriber, self.history)
        self._spawn(self.backend.follow_workers(registry), "follow-workers")
        self._spawn(self.backend.follow_bindings(self.sessions), "follow-bindings")
        self._spawn(Scraper(self.pool, self.http, cfg.scrape_interval_s).run(), "scraper")
        for static in cfg.static_workers:
            agent = WorkerAgent(self.backend, AgentConfig(
                static.worker_id, static.url, cfg.static_ttl_s, static.kv_events,
                report_gpu=False), self.http)
            self._spawn(agent.run(), f"agent-{static.worker_id}")

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks.clear()
        await self.rebinder.close()
        for task in list(self._background):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(task, 2.0)
        if self.subscriber is not None:
            await self.subscriber.close()
        if self.http is not None:
            await self.http.close()
        await self.backend.close()

    @property
    def http_session(self) -> aiohttp.ClientSession:
        if self.http is None:
            raise RuntimeError("router service not started")
        return self.http

    def background(self, coro: Any) -> None:
        """Run `coro` after the response (binding renewals); failures are logged only."""
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._done)

    # --- routing ---------------------------------------------------------------------------
    def route_request(self, creq: ClientRequest, exclude: frozenset[WorkerId] = frozenset()
                      ) -> RouteRequest:
        if creq.prompt_tokens is not None:
            block_keys = token_block_keys(creq.prompt_tokens, self.config.block_size)
        elif creq.session_id is not None:
            block_keys = self.session_blocks.get(creq.session_id)
        else:
            block_keys = ()
        return RouteRequest(creq.model, creq.session_id, text_prefix_keys(creq.prompt_text),
                            block_keys, creq.estimated_tokens, exclude)

    async def place(self, creq: ClientRequest, route: RouteRequest) -> Placement:
        """Decide, then commit the session binding (CAS); on a lost race, follow the winner."""
        sid = creq.session_id
        current = self.sessions.get(sid) if sid is not None else None
        decision: Decision | None = None
        lost_race = False
        cooldown = self.config.thresholds.migrate_cooldown_s
        for _ in range(_MAX_RACES):
            young = current is not None and time.time() - current.binding.updated < cooldown
            started = time.perf_counter()
            decision = self.scheduler.decide(route, current.worker_id if current else None,
                                             migrate=not (lost_race or young))
            self.metrics.decision_seconds.observe(time.perf_counter() - started)
            if sid is None or (current is not None and decision.worker == current.worker_id):
                break
            try:
                won, now = await self.sessions.bind(
                    sid, decision.worker, creq.model, expected=current,
                    reason=decision.reason.value, restore_from=decision.previous)
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
        assert decision is not None
        self.metrics.decisions.labels(decision.reason.value).inc()
        return Placement(decision, current, route)

    def kv_transfer_params(self, creq: ClientRequest, placement: Placement, *,
                           resumed_from: WorkerId | None = None) -> dict[str, Any] | None:
        """What the worker's KV connector gets (`connectors/vllm/params.py` is the contract).

        `{"session_id", "restore": "auto", "session_epoch"}`, plus, when the session's KV is
        elsewhere (migrated, failed over, resumed), `"restore_reason"` and
        `"previous_worker"`: the restore hint. "auto" lets the connector restore whatever
        prefix the store holds, so it is right for sticky requests too (it loads only what the
        local cache misses). A client's own fields, `restore` included, are kept.
        """
        given = creq.body.get("kv_transfer_params")
        params: dict[str, Any] = dict(given) if isinstance(given, dict) else {}
        restore_from = resumed_from or placement.restore_from
        if creq.session_id is not None:
            params["session_id"] = creq.session_id
        elif resumed_from is None:
            return params or None
        params.setdefault("restore", "auto")
        if restore_from is not None:
            params["restore_reason"] = "resumed" if resumed_from else placement.label
            params["previous_worker"] = restore_from
        if placement.binding is not None:
            params["session_epoch"] = placement.binding.binding.epoch
        return params

    def remember_tokens(self, session_id: str | None, prompt: list[int] | None,
                        output: list[int] | None) -> None:
        """Keep a session's token-block keys for the precise prefix match of its next turn."""
        if session_id is None or not prompt:
            return
        tokens = prompt + (output or [])
        self.session_blocks.put(session_id, token_block_keys(tokens, self.config.block_size))

    def settle(self, placement: Placement) -> None:
        """After a successful request: clear a pending restore hint, renew the TTL if due."""
        binding = placement.binding
        if binding is not None and binding.worker_id == placement.worker and \
                self.sessions.needs_touch(binding, settle=True):
            self.background(self.sessions.touch(binding, settle=True))

    # --- private ---------------------------------------------------------------------------
    def _spawn(self, coro: Any, name: str) -> None:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        task.add_done_callback(self._crashed)
        self._tasks.append(task)

    @staticmethod
    def _crashed(task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("router task %s died", task.get_name(), exc_info=task.exception())

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("background task failed: %s", task.exception())

