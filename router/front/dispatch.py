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

What a worker sends back is bounded (`router/limits.py`), and what the client sized is the
client's (trust review H1): a 2xx answer over `max_response_bytes` is the client's 413 (its
`n`, `max_tokens` and `logprobs` made it that large; another worker would make it as large),
the worker left usable; an error body over it is the worker's failure, never read whole.

What is the worker's fault, and how much: a connection it refused or dropped, and a redirect,
fail it hard (suspect at once); a 5xx, or no answer before the deadline (for a stream the
time-to-first-byte deadline, which allows for queueing and long prefills: trust review M8),
soft (counted; suspect after repeated ones). A redirect is never followed (trust review H3:
aiohttp would follow it, turning the POST into a GET of any URL the worker names, and hand
that body to the client), and never relayed.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import aiohttp

from router.core import RouterCore
from router.decision import Placement
from router.errors import PayloadTooLarge, UpstreamError, UpstreamTooLarge
from router.front.api import ClientRequest
from router.front.upstream import RETRYABLE_STATUS, UPSTREAM_ERRORS, upstream_body
from router.hooks import FAILED, Outcome
from router.limits import Limits, read_capped
from router.membership.workers import WorkerId
from router.tokenize.client import PromptTokenizer

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
    first_byte_by: float | None = None
    """The loop time by which a stream's first bytes are due (None: no deadline)."""

    @property
    def worker(self) -> WorkerId:
        return self.placement.worker


class Dispatcher:
    __slots__ = ("core", "first_byte_timeout_s", "http", "idle_timeout_s", "limits",
                 "max_attempts", "stream_timeout", "tokenizer", "unary_timeout")

    def __init__(self, core: RouterCore, http: aiohttp.ClientSession, *, max_attempts: int,
                 stream_timeout: aiohttp.ClientTimeout,
                 unary_timeout: aiohttp.ClientTimeout, limits: Limits | None = None,
                 tokenizer: PromptTokenizer | None = None,
                 first_byte_timeout_s: float | None = None,
                 idle_timeout_s: float | None = None) -> None:
        """`stream_timeout` bounds connecting (its reads are the two deadlines below);
        `first_byte_timeout_s`: a stream's headers and first bytes, from sending it;
        `idle_timeout_s`: a stream's silences after that (`streaming/relay.py`)."""
        self.core = core
        self.http = http
        self.limits = limits or core.limits
        self.max_attempts = max_attempts
        self.stream_timeout = stream_timeout
        self.unary_timeout = unary_timeout
        self.first_byte_timeout_s = first_byte_timeout_s
        self.idle_timeout_s = idle_timeout_s
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
            if stream and self.first_byte_timeout_s is not None:
                attempt.first_byte_by = asyncio.get_running_loop().time() \
                    + self.first_byte_timeout_s
            try:
                async with asyncio.timeout_at(attempt.first_byte_by):
                    resp = await self.http.post(
                        worker.info.url + path, data=_DUMPS(body).encode(), headers=_JSON,
                        timeout=self.stream_timeout if stream else self.unary_timeout,
                        allow_redirects=False)
                    attempt.status, attempt.content_type = resp.status, resp.content_type
                    if 300 <= resp.status < 400:
                        resp.close()  # its body and Location are the worker's: neither used
                    elif stream and resp.status == 200:
                        attempt.resp = resp
                    else:
                        try:
                            attempt.data = await read_capped(
                                resp, self.limits.max_response_bytes,
                                f"the answer of {attempt.worker}")
                        finally:
                            resp.release()
            except UpstreamTooLarge as exc:
                self.core.metrics.upstream_oversize.labels("body").inc()
                if 200 <= attempt.status < 300:
                    self.close(attempt)
                    raise PayloadTooLarge(
                        f"the answer is larger than this router relays ({exc}); ask for less "
                        "(fewer choices `n`, a lower `max_tokens`, fewer `top_logprobs`)"
                    ) from exc
                last = f"{attempt.worker}: {type(exc).__name__}: {exc}"
                self.failed(attempt, tried, hard=True)
                continue
            except UPSTREAM_ERRORS as exc:
                # No answer in time: busy (queued, prefilling, a long generation), not known
                # dead; a refused, dropped or never accepted connection is.
                busy = isinstance(exc, TimeoutError) \
                    and not isinstance(exc, aiohttp.ConnectionTimeoutError)
                last = f"{attempt.worker}: {type(exc).__name__}: {exc}"
                self.failed(attempt, tried, hard=not busy)
                continue
            except BaseException:  # cancelled (the client left): not the worker's failure
                self.close(attempt)
                raise
            if 300 <= attempt.status < 400:
                last = f"{attempt.worker}: HTTP {attempt.status} (a redirect: never followed)"
                self.failed(attempt, tried, hard=True)
                continue
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

    def registered(self, worker: WorkerId) -> Callable[[], bool]:
        """Whether `worker` is still in the registry (its lease live), asked by a silent
        stream's relay: a frozen node's connections stay open, its lease does not."""
        pool = self.core.pool
        return lambda: pool.get(worker) is not None

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
