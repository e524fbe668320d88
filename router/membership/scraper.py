"""Reads each worker's vLLM `/metrics`: requests running and waiting, KV-cache usage.

Parsed by line prefix rather than with prometheus_client's parser: the three gauges are all the
router needs and a 64-worker scrape round then costs well under a millisecond of CPU. A scrape
that fails counts as a connection failure, so a dead worker turns suspect after a few rounds,
often before its lease expires.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp

from router.errors import UpstreamTooLarge
from router.limits import METRICS_MAX_BYTES, read_capped
from router.membership.workers import WorkerLoad, WorkerPool, WorkerState

__all__ = ["parse_vllm_metrics", "Scraper"]

log = logging.getLogger(__name__)

_RUNNING = "vllm:num_requests_running"
_WAITING = "vllm:num_requests_waiting"
# vLLM renamed the gauge; older servers publish the GPU-named one.
_KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")


def parse_vllm_metrics(text: str, now: float | None = None) -> WorkerLoad:
    """Sum the running/waiting gauges over engines; KV usage is the max over engines (0..1)."""
    running = waiting = 0.0
    kv = 0.0
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        name, _, rest = line.partition("{")
        if not rest:
            name, _, value_text = line.partition(" ")
        else:
            value_text = rest.rpartition("}")[2]
        try:
            value = float(value_text.split()[0])
        except (ValueError, IndexError):
            continue
        if name == _RUNNING:
            running += value
        elif name == _WAITING:
            waiting += value
        elif name in _KV_USAGE:
            kv = max(kv, value)
    return WorkerLoad(int(running), int(waiting), min(1.0, max(0.0, kv)),
                      time.monotonic() if now is None else now)


@dataclass(slots=True)
class Scraper:
    pool: WorkerPool
    http: aiohttp.ClientSession
    interval_s: float = 0.5
    timeout_s: float = 1.0
    clock: Callable[[], float] = field(default=time.monotonic, repr=False)

    async def run(self) -> None:
        while True:
            states = [s for s in self.pool if s.alive]
            if states:
                await asyncio.gather(*(self._scrape(s) for s in states))
            await asyncio.sleep(self.interval_s)

    async def _scrape(self, state: WorkerState) -> None:
        url = f"{state.info.url}/metrics"
        try:
            async with self.http.get(url, timeout=aiohttp.ClientTimeout(total=self.timeout_s),
                                     allow_redirects=False) as resp:
                if resp.status != 200:
                    raise aiohttp.ClientResponseError(resp.request_info, (), status=resp.status)
                raw = await read_capped(resp, METRICS_MAX_BYTES, f"{url}")
            text = raw.decode("utf-8", "replace")
        except TimeoutError:
            # Slow is not dead: a worker busy with a big batch can answer /metrics late. Its
            # lease and the proxy's own connection failures decide death; keep the old load.
            return
        except (aiohttp.ClientError, OSError, UpstreamTooLarge) as exc:
            if self.pool.record_failure(state.worker_id):
                log.info("worker %s unreachable (%s); suspect", state.worker_id, exc)
            return
        self.pool.update_load(state.worker_id, parse_vllm_metrics(text, self.clock()))
        self.pool.record_success(state.worker_id)
