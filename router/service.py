"""One router replica: the router core wired to its state backend, the workers' metrics and KV
events, and an HTTP client to send on; started and stopped together.

The core (`router/core.py`) decides; this module only connects it: the backend's worker watch
feeds the core's registry, its binding watch the core's session table, the scraper the pool's
load, the ZMQ subscriber the KV-event index, and `dispatcher` sends what the core places.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import aiohttp

from kvstore.cluster.supervisor import supervise
from router.config import RouterConfig
from router.conversations import Continuations, ConversationRecords, StoreRecords
from router.core import RouterCore
from router.front.dispatch import Dispatcher
from router.indexer.subscriber import KVEventSubscriber
from router.membership.scraper import Scraper
from router.metrics import RouterMetrics
from router.node.agent import AgentConfig, WorkerAgent
from router.state.base import StateBackend
from router.state.etcd import EtcdBackend
from router.state.memory import MemoryBackend
from router.tasks import BackgroundTasks, cancel_and_wait
from router.tokenize.client import PromptTokenizer

__all__ = ["RouterService"]

log = logging.getLogger(__name__)


class RouterService:
    def __init__(self, config: RouterConfig, backend: StateBackend | None = None, *,
                 records: ConversationRecords | None = None) -> None:
        """`records`: where stateful continuation keeps conversations (default: the store
        `config.continuation` names; neither: continuation is off)."""
        self.config = config
        self._records = records
        self.backend: StateBackend = backend if backend is not None else (
            EtcdBackend(config.etcd_url, config.etcd_prefix) if config.etcd_url
            else MemoryBackend())
        self.background = BackgroundTasks()
        self.allow = config.allow_list()
        self.core = RouterCore(config.policy.build(), backend=self.backend,
                               block_size=config.block_size, session_ttl_s=config.session_ttl_s,
                               defer=self.background, limits=config.limits, allow=self.allow,
                               bind_on_accept=True)
        if config.api_keys:  # each tenant's salt, which the failover's prefetch hints carry
            self.core.rebinder.salt_of = config.api_keys.cache_salt
        self.subscriber: KVEventSubscriber | None = None
        self.http: aiohttp.ClientSession | None = None
        self._dispatcher: Dispatcher | None = None
        self.continuations: Continuations | None = None
        self.extproc: Any = None
        """The ext_proc endpoint picker (`router.extproc.server.ExtProcServer`) when on."""
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def metrics(self) -> RouterMetrics:
        return self.core.metrics

    @property
    def dispatcher(self) -> Dispatcher:
        if self._dispatcher is None:
            raise RuntimeError("router service not started")
        return self._dispatcher

    # --- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        cfg = self.config
        if not self.backend.shared:
            log.warning("no --etcd: in-process state, one router replica only (sessions and "
                        "workers are not shared and do not survive a restart)")
        if self.allow.configured:
            log.info("workers: allow-list %s", self.allow.describe())
        else:
            log.warning("workers: no allow-list, loopback workers only (give --allow-workers "
                        "or workers.allow in the config file to route to a network)")
        await self.backend.start()
        # Workers' cookies are not kept: one jar shared by every client would replay one
        # client's cookies for all (and filtering it costs every request).
        self.http = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=60),
            auto_decompress=False, cookie_jar=aiohttp.DummyCookieJar(),
        )
        # A stream may run for as long as it keeps producing; only silence breaks it: before
        # its first bytes the long time-to-first-byte deadline (queueing, long prefills), then
        # the idle timeout (both kept by the dispatcher and the relay, so aiohttp's own read
        # timeout is off for streams). A unary request is silent until its whole answer is
        # ready, so it gets a total bound instead.
        # Text prompts are tokenized by a worker when the policy matches token blocks.
        policy = cfg.policy
        tokenizer = PromptTokenizer(policy.tokenize, self.core.pool, self.http,
                                    registry=self.core.metrics.registry, clock=self.core.clock) \
            if policy.reads_token_blocks and policy.tokenize.enabled else None
        self._dispatcher = Dispatcher(
            self.core, self.http, max_attempts=cfg.max_attempts, limits=cfg.limits,
            tokenizer=tokenizer,
            first_byte_timeout_s=cfg.first_byte_timeout_s,
            idle_timeout_s=cfg.stream_idle_timeout_s,
            stream_timeout=aiohttp.ClientTimeout(
                total=None, connect=cfg.connect_timeout_s, sock_read=None),
            unary_timeout=aiohttp.ClientTimeout(
                total=cfg.request_timeout_s, connect=cfg.connect_timeout_s))
        records = self._records
        if records is None and cfg.continuation is not None:
            records = StoreRecords(cfg.continuation.remote_spec(), cfg.continuation.tenant,
                                   key=cfg.continuation.record_key)
        if records is not None:
            self.continuations = Continuations(records, self.core, self.http)
        dropped = self.metrics.kv_events_dropped
        self.subscriber = KVEventSubscriber(
            self.core.blocks, cfg.limits,
            on_drop=lambda reason, n: dropped.labels(reason).inc(n),
            on_apply=self.metrics.kv_event_blocks.inc)
        self.core.registry.feeds = self.subscriber
        # Supervised (kvstore/cluster/supervisor.py): a watch that died would freeze
        # membership or bindings for good.
        if isinstance(self.backend, EtcdBackend):
            self.backend.export_metrics(self.metrics.registry)
        self._spawn(supervise("follow-workers",
                              lambda: self.backend.follow_workers(self.core.registry)),
                    "follow-workers")
        self._spawn(supervise("follow-bindings",
                              lambda: self.backend.follow_bindings(self.core.sessions)),
                    "follow-bindings")
        self._spawn(Scraper(self.core.pool, self.http, cfg.scrape_interval_s,
                            clock=self.core.clock).run(), "scraper")
        if cfg.extproc_listen is not None:
            from router.extproc.server import ExtProcServer  # the optional gateway extra

            self.extproc = ExtProcServer(self.core, cfg.extproc_listen,
                                         fallbacks=cfg.extproc_fallbacks,
                                         max_body_bytes=cfg.max_body_bytes,
                                         api_keys=cfg.api_keys)
            await self.extproc.start()
        for static in cfg.static_workers:
            agent = WorkerAgent(self.backend, AgentConfig(
                static.worker_id, static.url, cfg.static_ttl_s, static.kv_events,
                report_gpu=False), self.http)
            self._spawn(agent.run(), f"agent-{static.worker_id}")

    async def stop(self) -> None:
        if self.extproc is not None:
            await self.extproc.stop()
        await cancel_and_wait(self._tasks)
        self._tasks.clear()
        await self.background.close()
        if self.continuations is not None:
            await self.continuations.close()
        if self.subscriber is not None:
            await self.subscriber.close()
        if self.http is not None:
            await self.http.close()
        await self.backend.close()

    # --- private ---------------------------------------------------------------------------
    def _spawn(self, coro: Any, name: str) -> None:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        task.add_done_callback(self._crashed)
        self._tasks.append(task)

    @staticmethod
    def _crashed(task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("router task %s died", task.get_name(), exc_info=task.exception())
