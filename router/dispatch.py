"""Sending a request to the workers: the one place / send / classify / release loop that
unary requests, streams and stream continuations all go through.

Per attempt: the router core places the request (a fresh decision that excludes the workers
already tried, its session bound, the pick charged), the body goes to the chosen worker, and
the answer is classified: a worker that cannot be reached, or answers 5xx, has failed (marked
in the pool, excluded, and the request placed again, at most `max_attempts` workers); any
other answer is the worker's, passed on. Every attempt is finished exactly once through the
core's post-response hooks, which release its load.

Why a fresh decision rather than the picker's runner-up: sending and deciding share a process
here, so re-deciding costs microseconds against a failed network round trip, and it sees what
changed meanwhile (the failure just recorded, load charged by concurrent requests, a worker
that left). With nothing changed it picks the runner-up.

A new session's binding is written once a worker accepts its first request (a 2xx), not at
placement (`RouterCore.accepted`): a request that no worker takes leaves nothing in etcd. If
another replica bound the session meanwhile, a stream (nothing relayed yet) is closed and sent
to the winner's worker instead, so replicas never split a session; a finished unary answer is
kept, and the session's next turn goes to the winner.

What a worker sends back is bounded (`router/limits.py`): a non-streaming answer or error
body over `max_response_bytes` is that worker's failure (tried elsewhere), never read whole.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import aiohttp

from router.api import ClientRequest
from router.core import RouterCore
from router.decision import Placement
from router.errors import UpstreamError, UpstreamTooLarge
from router.hooks import FAILED, Outcome
from router.limits import Limits, read_capped
from router.tokenize_client import PromptTokenizer
from router.upstream import RETRYABLE_STATUS, UPSTREAM_ERRORS, upstream_body
from router.workers import WorkerId

__all__ = ["Attempt", "Dispatcher", "BodyFor"]

_JSON = {"Content-Type": "application/json"}
_DUMPS = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode
_KEEP_ALIVE_WAIT_S = 1.0
_KEEP_ALIVE_MAX_BYTES = 4096
_MAX_RACES = 2

BodyFor = Callable[[Placement], tuple[str, dict[str, Any]]]
"""The path and JSON body to send for a placement (the original request, or a continuation)."""


@dataclass(slots=True)
class Attempt:
    """One worker carrying (part of) a request. `resp` is the open response of a stream that
    started; otherwise the worker's whole answer is `status`, `data`, `content_type`."""

    placement: Placement
    resp: aiohttp.ClientResponse | None = None
    status: int = 0
    data: bytes = b""
    content_type: str = ""
    finished: bool = False

    @property
    def worker(self) -> WorkerId:
        return self.placement.worker


class Dispatcher:
    __slots__ = ("core", "http", "limits", "max_attempts", "stream_timeout", "tokenizer",
                 "unary_timeout")

    def __init__(self, core: RouterCore, http: aiohttp.ClientSession, *, max_attempts: int,
                 stream_timeout: aiohttp.ClientTimeout,
                 unary_timeout: aiohttp.ClientTimeout, limits: Limits | None = None,
                 tokenizer: PromptTokenizer | None = None) -> None:
        self.core = core
        self.http = http
        self.limits = limits or core.limits
        self.max_attempts = max_attempts
        self.stream_timeout = stream_timeout
        self.unary_timeout = unary_timeout
        self.tokenizer = tokenizer
        """Gives text prompts their token ids for the precise prefix (None: text keys only)."""

    async def send(self, creq: ClientRequest, tried: set[WorkerId], *, stream: bool,
                   body_for: BodyFor | None = None) -> Attempt:
        """Place `creq` and send it until a worker answers (see the module docstring).

        Returns the attempt that answered, still charged: the caller `finish`es it (or
        `close`s an open stream). `stream`: a 200 leaves the response open to relay.
        Raises what placing raises (`Saturated`, `NoHealthyWorker`) or `UpstreamError` when
        no worker answered. `tried` gains every worker that failed.
        """
        build = body_for or (lambda p: (creq.endpoint.value, upstream_body(creq, p)))
        features = creq.features if self.tokenizer is None \
            else await self.tokenizer.features(creq)
        route = self.core.route(features)
        last = "no attempt"
        races = 0
        attempt_no = 0
        while attempt_no < self.max_attempts:
            attempt_no += 1
            attempt = Attempt(await self.core.place(replace(route, exclude=frozenset(tried))))
            worker = self.core.pool.get(attempt.worker)
            if worker is None:  # it left between the decision and now
                tried.add(attempt.worker)
                self.finish(attempt)
                continue
            path, body = build(attempt.placement)
            try:
                resp = await self.http.post(
                    worker.info.url + path, data=_DUMPS(body).encode(), headers=_JSON,
                    timeout=self.stream_timeout if stream else self.unary_timeout)
                attempt.status, attempt.content_type = resp.status, resp.content_type
                if stream and resp.status == 200:
                    attempt.resp = resp
                else:
                    try:
                        attempt.data = await read_capped(resp, self.limits.max_response_bytes,
                                                         f"the answer of {attempt.worker}")
                    finally:
                        resp.release()
            except (*UPSTREAM_ERRORS, UpstreamTooLarge) as exc:
                if isinstance(exc, UpstreamTooLarge):
                    self.core.metrics.upstream_oversize.labels("body").inc()
                last = f"{attempt.worker}: {type(exc).__name__}: {exc}"
                self.failed(attempt, tried, hard=True)
                continue
            except BaseException:  # cancelled (the client left): not the worker's failure
                self.close(attempt)
                raise
            if attempt.status in RETRYABLE_STATUS:
                last = f"{attempt.worker}: HTTP {attempt.status}"
                if attempt_no < self.max_attempts:
                    self.failed(attempt, tried, hard=False)
                    continue
                self._count_failure(attempt.worker, hard=False)  # the last: passed on as is
            else:
                self.core.pool.record_success(attempt.worker)
            if 200 <= attempt.status < 300 and attempt.placement.pending:
                try:
                    kept, attempt.placement = await self.core.accepted(attempt.placement)
                except BaseException:
                    self.close(attempt)
                    raise
                if not kept and attempt.resp is not None and races < _MAX_RACES:
                    # Another replica bound the session first: nothing has reached the
                    # client, so the stream goes where the session lives (not a failure).
                    races += 1
                    attempt_no -= 1
                    self.close(attempt)
                    continue
            return attempt
        raise UpstreamError(f"no worker could serve the request ({last})")

    def finish(self, attempt: Attempt, outcome: Outcome = FAILED) -> None:
        """End the attempt's placement (the core's post-response hooks), once."""
        if not attempt.finished:
            attempt.finished = True
            self.core.finish(attempt.placement, outcome)

    def failed(self, attempt: Attempt, tried: set[WorkerId], *, hard: bool) -> None:
        """The worker failed the attempt: excluded from the request, marked in the pool."""
        tried.add(attempt.worker)
        self.close(attempt)
        self._count_failure(attempt.worker, hard=hard)

    def close(self, attempt: Attempt, *, reuse: bool = False) -> None:
        """Close the attempt's response and finish it, if not done yet. With `reuse` (the
        worker sent its [DONE]), its connection goes back to the pool once it ends."""
        resp, attempt.resp = attempt.resp, None
        if resp is not None:
            if reuse and resp.connection is not None:
                self.core.defer(_keep_alive(resp))
            else:
                resp.close()
        self.finish(attempt)

    def _count_failure(self, worker: WorkerId, *, hard: bool) -> None:
        self.core.pool.record_failure(worker, hard=hard)
        self.core.metrics.upstream_failures.labels(worker).inc()


async def _keep_alive(resp: aiohttp.ClientResponse) -> None:
    """Read a finished stream's last bytes (the chunked terminator that follows `[DONE]`) so
    that its connection returns to the pool: closing it instead would cost the worker's next
    request a new TCP connection. A worker that sends more, or nothing, loses the connection."""
    try:
        async with asyncio.timeout(_KEEP_ALIVE_WAIT_S):
            left = _KEEP_ALIVE_MAX_BYTES
            while left > 0 and (data := await resp.content.readany()):
                left -= len(data)
    except UPSTREAM_ERRORS:
        pass
    finally:
        if resp.content.at_eof():
            resp.release()
        else:
            resp.close()
