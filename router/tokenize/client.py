"""Asks a worker's vLLM `/tokenize` for a text prompt's ids, through the router's cache.

`PromptTokenizer.features(creq)` is what the dispatcher routes with: the request's features
with `prompt_tokens` filled in when the ids are known (cached, or tokenized now within
`timeout_s`), the request's own features otherwise. Concurrent requests with the same prompt
share one round trip. The worker asked is the least loaded usable one serving the model (any
of them renders the same ids); one that fails or times out is left alone for
`retry_after_s`, so a sick worker costs one timeout, not one per request.

Counted in the router's metrics: `kvkeep_router_tokenize_total{outcome}` (cached, tokenized,
timeout, error, no_worker) and `kvkeep_router_tokenize_seconds` (round trips).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from dataclasses import replace

import aiohttp
from prometheus_client import CollectorRegistry, Counter, Histogram

from router.decision import RequestFeatures
from router.errors import UpstreamTooLarge
from router.front.api import ClientRequest
from router.limits import TOKENIZE_MAX_BYTES, read_capped
from router.membership.workers import WorkerId, WorkerPool, WorkerState
from router.tokenize.cache import TokenCache
from router.tokenize.prompts import TokenizeInput, TokenizeSpec, tokenize_input

__all__ = ["PromptTokenizer"]

log = logging.getLogger(__name__)

_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
_Tokens = tuple[int, ...] | None


class PromptTokenizer:
    def __init__(self, spec: TokenizeSpec, pool: WorkerPool, http: aiohttp.ClientSession, *,
                 registry: CollectorRegistry | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.spec = spec
        self.pool = pool
        self.http = http
        self.clock = clock
        self.cache = TokenCache(spec.cache_tokens)
        self._inflight: dict[bytes, asyncio.Task[_Tokens]] = {}
        self._resting: dict[WorkerId, float] = {}
        registry = registry or CollectorRegistry()
        self.outcomes = Counter("kvkeep_router_tokenize", "Text prompts the router tokenized "
                                "or could not, by outcome", ["outcome"], registry=registry)
        self.seconds = Histogram("kvkeep_router_tokenize_seconds",
                                 "Round trips to a worker's /tokenize", buckets=_BUCKETS,
                                 registry=registry)

    async def features(self, creq: ClientRequest) -> RequestFeatures:
        """`creq`'s routing features, with its prompt's token ids where they can be known."""
        features = creq.features
        if not self.spec.enabled:
            return features
        given = tokenize_input(creq)
        if given is None:
            return features
        tokens = self.cache.get(given.key)
        if tokens is not None:
            self.outcomes.labels("cached").inc()
        else:
            tokens = await self.tokenize(given, creq.model)
        return features if tokens is None else replace(features, prompt_tokens=tokens)

    async def tokenize(self, given: TokenizeInput, model: str) -> _Tokens:
        """The ids of `given`, asked of a worker (one round trip shared by concurrent asks);
        None when no worker answered in time."""
        task = self._inflight.get(given.key)
        if task is None:
            task = asyncio.get_running_loop().create_task(self._ask(given, model))
            self._inflight[given.key] = task
            task.add_done_callback(lambda _: self._inflight.pop(given.key, None))
        # Shielded: a client that leaves does not cancel the round trip others wait for.
        return await asyncio.shield(task)

    # --- private ---------------------------------------------------------------------------
    async def _ask(self, given: TokenizeInput, model: str) -> _Tokens:
        worker = self._pick(model)
        if worker is None:
            self.outcomes.labels("no_worker").inc()
            return None
        started = time.perf_counter()
        try:
            async with asyncio.timeout(self.spec.timeout_s):
                async with self.http.post(worker.info.url + "/tokenize", json=given.body,
                                          allow_redirects=False) as resp:
                    # Capped: a hostile worker's endless answer costs a bounded read.
                    data = json.loads(await read_capped(
                        resp, TOKENIZE_MAX_BYTES, "/tokenize answer")) \
                        if resp.status == 200 else None
                    status = resp.status
        except TimeoutError:
            self._rest(worker.worker_id, "timed out")
            self.outcomes.labels("timeout").inc()
            return None
        except (aiohttp.ClientError, OSError, ValueError, UpstreamTooLarge) as exc:
            self._rest(worker.worker_id, f"{type(exc).__name__}: {exc}")
            self.outcomes.labels("error").inc()
            return None
        self.seconds.observe(time.perf_counter() - started)
        tokens = data.get("tokens") if isinstance(data, dict) else None
        if not isinstance(tokens, list) or not tokens or \
                not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            # 404 (an old vLLM, or the endpoint disabled), 400 (the worker refuses this
            # rendering: its chat completion will say why) or a malformed answer
            if status != 400:
                self._rest(worker.worker_id, f"HTTP {status}")
            self.outcomes.labels("error").inc()
            return None
        ids = tuple(tokens)
        self.cache.put(given.key, ids)
        self.outcomes.labels("tokenized").inc()
        return ids

    def _pick(self, model: str) -> WorkerState | None:
        now = self.clock()
        candidates = [w for w in self.pool if w.usable(now) and model in w.info.models
                      and self._resting.get(w.worker_id, 0.0) <= now]
        return min(candidates, key=lambda w: w.queue, default=None)

    def _rest(self, worker: WorkerId, why: str) -> None:
        if self._resting.get(worker, 0.0) <= self.clock():
            log.info("not tokenizing on %s for %.0f s: /tokenize %s", worker,
                     self.spec.retry_after_s, why)
        self._resting[worker] = self.clock() + self.spec.retry_after_s
