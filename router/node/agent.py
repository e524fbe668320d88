"""The worker agent: registers one vLLM server in the state backend under a lease and keeps it
registered exactly while the server is healthy.

Why an agent beside each worker rather than the routers probing: the lease is the one fact all
router replicas share. Replicas that probed on their own would disagree for seconds about who
is alive, and two of them could rebind one dead worker's sessions in different directions. With
a lease, death is one etcd event every replica sees (the key's DELETE), whether the whole host
died (nobody refreshes: the lease expires after its TTL) or just vLLM (the agent's probe fails
and it revokes the lease at once). The agent is also where host facts live: NVML's GPU memory
and temperature are read beside the GPU, not across the network.

`kvkeep worker` runs one against etcd; `kvkeep router serve --worker URL` without etcd runs one
per static worker inside the router, against the in-process backend.

Against etcd the lease is the control plane's lease keeper (kvstore/cluster/lease.py): each
keepalive also reads the agent's own key back, and a value someone else wrote there (another
URL, another lease, none) is replaced by the agent's at once. Waits between tries follow the
one retry policy (kvstore/cluster/retry.py), capped at TTL/3.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from dataclasses import dataclass, replace

import aiohttp

from kvstore.cluster.retry import LOOP_RETRY, Backoff
from router.errors import StateUnavailable, UpstreamTooLarge
from router.limits import MODELS_MAX_BYTES, read_capped
from router.membership.workers import WorkerId, WorkerInfo
from router.node.gpu import read_gpu
from router.state.base import StateBackend, WorkerLease

__all__ = ["AgentConfig", "WorkerAgent"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class AgentConfig:
    """`models` None: ask the server's `/v1/models`. `leave_after` failed probes in a row make
    the agent revoke the lease (each probe is TTL/3 apart, so death is published within TTL)."""

    worker_id: WorkerId
    url: str
    ttl_s: float = 3.0
    kv_events: str | None = None
    models: tuple[str, ...] | None = None
    probe_timeout_s: float = 1.0
    leave_after: int = 2
    report_gpu: bool = True


class WorkerAgent:
    __slots__ = ("_backend", "_config", "_draining", "_http", "_lease", "registered")

    def __init__(self, backend: StateBackend, config: AgentConfig,
                 http: aiohttp.ClientSession) -> None:
        self._config = config
        self._backend = backend
        self._http = http
        self._lease: WorkerLease | None = None
        self._draining = False
        self.registered = asyncio.Event()

    async def run(self) -> None:
        """Register while healthy, deregister while not; forever (until cancelled)."""
        backoff = self._backoff()
        try:
            while True:
                info = await self._wait_healthy()
                try:
                    self._lease = await self._backend.register_worker(info, self._config.ttl_s)
                    self.registered.set()
                    backoff.reset()
                    log.info("registered %s (%s) with a %.1fs lease", info.worker_id, info.url,
                             self._config.ttl_s)
                    await self._hold(self._lease, info)
                except StateUnavailable as exc:
                    log.warning("state backend unavailable (%s); re-registering", exc)
                    await backoff.wait()
                finally:
                    self.registered.clear()
        finally:
            await self._release()

    async def drain(self) -> None:
        """Stay registered but take no new sessions (routers' draining filter)."""
        self._draining = True
        if self._lease is not None:
            info = await self._info()
            if info is not None:
                await self._lease.update(info)

    async def _release(self) -> None:
        lease, self._lease = self._lease, None
        if lease is not None:
            with contextlib.suppress(StateUnavailable):
                await lease.revoke()

    async def _hold(self, lease: WorkerLease, info: WorkerInfo) -> None:
        failures = 0
        period = self._config.ttl_s / 3
        while True:
            await asyncio.sleep(period)
            if not await self._healthy():
                failures += 1
                if failures >= self._config.leave_after:
                    log.warning("%s unhealthy; revoking its lease", info.worker_id)
                    await self._release()
                    return
                continue  # no keepalive for a failing server: the lease runs down meanwhile
            failures = 0
            if not await lease.keepalive():
                log.warning("lease of %s had expired; re-registering", info.worker_id)
                return
            fresh = self._with_gpu(replace(info, draining=self._draining))
            if fresh != info:
                await lease.update(fresh)
                info = fresh

    def _backoff(self) -> Backoff:
        return Backoff(LOOP_RETRY.capped(self._config.ttl_s / 3))

    async def _wait_healthy(self) -> WorkerInfo:
        backoff = self._backoff()
        while True:
            info = await self._info() if await self._healthy() else None
            if info is not None:
                return info
            await backoff.wait()

    async def _healthy(self) -> bool:
        try:
            # A redirect is no health (and never followed: the agent fetches nothing else).
            async with self._http.get(f"{self._config.url}/health", allow_redirects=False,
                                      timeout=aiohttp.ClientTimeout(
                                          total=self._config.probe_timeout_s)) as resp:
                return resp.status == 200
        except (TimeoutError, aiohttp.ClientError, OSError):
            return False

    async def _info(self) -> WorkerInfo | None:
        cfg = self._config
        models = cfg.models
        if models is None:
            try:
                async with self._http.get(f"{cfg.url}/v1/models", allow_redirects=False,
                                          timeout=aiohttp.ClientTimeout(
                                              total=cfg.probe_timeout_s)) as resp:
                    if resp.status != 200:
                        return None
                    data = json.loads(await read_capped(resp, MODELS_MAX_BYTES, "/v1/models"))
                models = tuple(str(m["id"]) for m in data.get("data", ()))
            except (TimeoutError, aiohttp.ClientError, OSError, ValueError, KeyError, TypeError,
                    AttributeError, UpstreamTooLarge):
                return None
        info = WorkerInfo(cfg.worker_id, cfg.url.rstrip("/"), models, cfg.kv_events,
                          self._draining)
        return self._with_gpu(info)

    def _with_gpu(self, info: WorkerInfo) -> WorkerInfo:
        if not self._config.report_gpu:
            return info
        reading = read_gpu()
        if reading is None:
            return info
        # Rounded so that noise does not rewrite the etcd key every keepalive.
        return replace(info, gpu_mem_frac=round(reading.mem_frac, 2),
                       gpu_temp_c=round(reading.temp_c))
