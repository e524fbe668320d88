"""The OpenAI-compatible HTTP front: aiohttp server in, aiohttp client session out.

Routes: `POST /v1/completions`, `POST /v1/chat/completions` (streaming and not), `GET
/v1/models`, `GET /health`, `GET /metrics`, and read-only `GET /kvkeep/workers`,
`GET /kvkeep/sessions/{id}` for operators and tests.

Per request: parse and validate, decide and commit the binding (`RouterService.place`), then
send. Before a response has started, a worker that cannot be reached or answers 5xx is
excluded and the request placed again (at most `max_attempts` workers). After a stream has
started, a break is resumed on another worker from the tokens already delivered.

Response headers say what happened: `X-KVKeep-Worker`, `X-KVKeep-Route` (stateless, new,
sticky, migrated, failover, resumed), `X-KVKeep-Session`, `X-KVKeep-Restore` (a restore hint
was sent), `X-KVKeep-Failover`, `X-KVKeep-Migrated`, and for non-streaming replies
`X-KVKeep-Cached-Tokens` / `X-KVKeep-Recomputed-Tokens` (from the worker's usage: local
prefix-cache hits and tokens the connector loaded both count as cached) and
`X-KVKeep-Restored-Tokens` / `X-KVKeep-Checkpointed-Tokens` (when its connector reports
them). A stream's later events (resumption) are told in SSE comments, which OpenAI clients
ignore.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

from router.api import SESSION_HEADER, ClientRequest, Endpoint, parse_request
from router.errors import (
    MethodNotAllowed,
    ModelNotFound,
    NoHealthyWorker,
    NotFound,
    PayloadTooLarge,
    RouterError,
    Unauthorized,
    UpstreamError,
)
from router.failover import resume_body
from router.metrics import CONTENT_TYPE_LATEST
from router.service import Placement, RouterService
from router.streaming import UPSTREAM_ERRORS, StreamBroken, StreamState, pump, sse
from router.workers import WorkerId

__all__ = ["Proxy", "build_app"]

log = logging.getLogger(__name__)

_JSON = {"Content-Type": "application/json"}
_DUMPS = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode
_RETRYABLE_STATUS = frozenset({500, 502, 503, 504})
_KEEP_ALIVE_WAIT_S = 1.0
_KEEP_ALIVE_MAX_BYTES = 4096
_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _error_response(exc: RouterError) -> web.Response:
    return web.Response(status=exc.status, body=_DUMPS(exc.body()).encode(),
                        content_type="application/json", headers=exc.headers())


@dataclass(slots=True)
class _Attempt:
    """One worker carrying (part of) a request: released exactly once."""

    placement: Placement
    resp: aiohttp.ClientResponse | None = None
    released: bool = False


class Proxy:
    __slots__ = ("service",)

    def __init__(self, service: RouterService) -> None:
        self.service = service

    # --- application -----------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.service.config.max_body_bytes,
                              middlewares=[self._errors, self._auth])
        app.router.add_post(Endpoint.COMPLETIONS.value, self.completions)
        app.router.add_post(Endpoint.CHAT.value, self.chat)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/kvkeep/workers", self.workers)
        app.router.add_get("/kvkeep/sessions/{session_id}", self.session)
        return app

    @web.middleware
    async def _errors(self, request: web.Request, handler: _Handler) -> web.StreamResponse:
        endpoint = request.match_info.route.resource.canonical \
            if request.match_info.route.resource is not None else "other"
        try:
            resp = await handler(request)
        except RouterError as exc:
            resp = _error_response(exc)
        except web.HTTPRequestEntityTooLarge:
            resp = _error_response(PayloadTooLarge(
                f"request body exceeds {self.service.config.max_body_bytes} bytes"))
        except web.HTTPMethodNotAllowed:
            resp = _error_response(MethodNotAllowed(f"{request.method} not allowed here"))
        except web.HTTPNotFound:
            resp = _error_response(NotFound(f"no route {request.path}"))
        except web.HTTPException as exc:
            resp = web.Response(status=exc.status, body=_DUMPS({"error": {
                "message": exc.reason, "type": "invalid_request_error", "param": None,
                "code": exc.status}}).encode(), content_type="application/json")
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception:
            log.exception("unhandled error on %s %s", request.method, request.path)
            resp = _error_response(RouterError("internal router error"))
        self.service.metrics.requests.labels(endpoint, str(resp.status)).inc()
        return resp

    @web.middleware
    async def _auth(self, request: web.Request, handler: _Handler) -> web.StreamResponse:
        keys = self.service.config.api_keys
        if keys and request.path.startswith(("/v1/", "/kvkeep/")):
            given = request.headers.get("Authorization", "")
            token = given[7:] if given.startswith("Bearer ") else ""
            # Constant-time comparison against every key: no timing hint of a near miss.
            if not any(hmac.compare_digest(token.encode(), k.encode()) for k in keys):
                raise Unauthorized("invalid or missing API key")
        return await handler(request)

    # --- simple endpoints ------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        svc = self.service
        now = time.monotonic()
        usable = sum(1 for w in svc.pool if w.usable(now))
        return web.json_response({
            "status": "ok", "state": svc.backend.name, "replica": svc.config.replica_id,
            "workers": {"registered": len(svc.pool), "usable": usable},
            "sessions": len(svc.sessions), "kv_index_blocks": len(svc.blocks),
            "kv_events_applied": svc.blocks.events_applied})

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.service.metrics.render(),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def models(self, request: web.Request) -> web.Response:
        created = int(time.time())
        data = [{"id": m, "object": "model", "created": created, "owned_by": "kvkeep"}
                for m in sorted(self.service.pool.models())]
        return web.json_response({"object": "list", "data": data})

    async def workers(self, request: web.Request) -> web.Response:
        now = time.monotonic()
        return web.json_response([{
            "id": w.worker_id, "url": w.info.url, "models": list(w.info.models),
            "usable": w.usable(now), "draining": w.info.draining, "queue": w.queue,
            "waiting": w.waiting, "kv_usage": w.kv_usage, "inflight": w.inflight,
            "gpu_mem_frac": w.info.gpu_mem_frac, "gpu_temp_c": w.info.gpu_temp_c,
        } for w in self.service.pool])

    async def session(self, request: web.Request) -> web.Response:
        vb = self.service.sessions.get(request.match_info["session_id"])  # type: ignore[arg-type]
        if vb is None:
            raise NotFound("no such session")
        b = vb.binding
        return web.json_response({"session_id": b.session_id, "worker": b.worker_id,
                                  "model": b.model, "epoch": b.epoch,
                                  "restore_from": b.restore_from, "reason": b.reason,
                                  "revision": vb.revision})

    # --- generation ------------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, Endpoint.COMPLETIONS)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, Endpoint.CHAT)

    async def _generate(self, request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
        limit = self.service.config.max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            raise PayloadTooLarge(f"request body exceeds {limit} bytes")
        raw = await request.read()
        creq = parse_request(endpoint, raw, request.headers.get(SESSION_HEADER))
        if creq.model not in self.service.pool.models():
            raise ModelNotFound(f"The model `{creq.model}` does not exist.", param="model")
        started = time.perf_counter()
        try:
            if creq.stream:
                return await self._stream(request, creq)
            return await self._unary(creq)
        finally:
            self.service.metrics.request_seconds.labels(
                endpoint.value, str(creq.stream).lower()).observe(time.perf_counter() - started)

    # --- non-streaming ---------------------------------------------------------------------
    async def _unary(self, creq: ClientRequest) -> web.Response:
        svc = self.service
        tried: set[WorkerId] = set()
        last = "no attempt"
        for attempt_no in range(svc.config.max_attempts):
            attempt = await self._place(creq, tried)
            url = self._url(attempt.placement.worker, creq.endpoint.value)
            if url is None:
                tried.add(attempt.placement.worker)
                self._release(attempt)
                continue
            body = self._upstream_body(creq, attempt.placement)
            try:
                async with svc.http_session.post(url, data=_DUMPS(body).encode(),
                                                 headers=_JSON,
                                                 timeout=svc.unary_timeout) as resp:
                    status, data = resp.status, await resp.read()
                    ctype = resp.content_type
            except UPSTREAM_ERRORS as exc:
                last = f"{attempt.placement.worker}: {type(exc).__name__}: {exc}"
                self._failed(attempt, tried, hard=True)
                continue
            finally:
                self._release(attempt)
            if status in _RETRYABLE_STATUS and attempt_no + 1 < svc.config.max_attempts:
                last = f"{attempt.placement.worker}: HTTP {status}"
                self._failed(attempt, tried, hard=False)
                continue
            svc.pool.record_success(attempt.placement.worker)
            return self._unary_response(creq, attempt.placement, status, data, ctype,
                                        failover=bool(tried))
        raise UpstreamError(f"no worker could serve the request ({last})")

    def _unary_response(self, creq: ClientRequest, placement: Placement, status: int,
                        data: bytes, ctype: str, *, failover: bool) -> web.Response:
        headers = self._headers(creq, placement, failover=failover)
        if status == 200 and ctype == "application/json":
            try:
                obj = json.loads(data)
            except ValueError:
                obj = None
            if isinstance(obj, dict):
                self._absorb_unary(creq, obj, headers)
                data = _DUMPS(obj).encode()
            self.service.settle(placement)
        return web.Response(status=status, body=data, content_type=ctype or "application/json",
                            headers=headers)

    def _absorb_unary(self, creq: ClientRequest, obj: dict[str, Any],
                      headers: dict[str, str]) -> None:
        keep = creq.wants_token_ids
        choices = obj.get("choices") or []
        prompt = obj.get("prompt_token_ids") if keep else obj.pop("prompt_token_ids", None)
        output: list[int] | None = None
        for i, choice in enumerate(choices):
            if not isinstance(choice, dict):
                continue
            p = choice.get("prompt_token_ids") if keep else choice.pop("prompt_token_ids", None)
            ids = choice.get("token_ids") if keep else choice.pop("token_ids", None)
            if i == 0:
                prompt, output = p if p is not None else prompt, ids
        self.service.remember_tokens(creq.session_id, prompt, output)
        usage = obj.get("usage")
        if isinstance(usage, dict):
            details = usage.get("prompt_tokens_details") or {}
            cached = details.get("cached_tokens") if isinstance(details, dict) else None
            prompt_tokens = usage.get("prompt_tokens")
            if isinstance(cached, int) and isinstance(prompt_tokens, int):
                headers["X-KVKeep-Cached-Tokens"] = str(cached)
                headers["X-KVKeep-Recomputed-Tokens"] = str(max(0, prompt_tokens - cached))
        returned = obj.get("kv_transfer_params")
        if isinstance(returned, dict):  # what the kvkeep connector reports back
            for field, header in (("restored_tokens", "X-KVKeep-Restored-Tokens"),
                                  ("checkpointed_tokens", "X-KVKeep-Checkpointed-Tokens")):
                if isinstance(returned.get(field), int):
                    headers[header] = str(returned[field])

    # --- streaming -------------------------------------------------------------------------
    async def _stream(self, request: web.Request, creq: ClientRequest) -> web.StreamResponse:
        svc = self.service
        tried: set[WorkerId] = set()
        state = StreamState(creq)
        opened = await self._open(creq, tried, state)
        if isinstance(opened, web.Response):
            return opened
        attempt = opened
        headers = self._headers(creq, attempt.placement, failover=bool(tried))
        headers.update({"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        out = web.StreamResponse(status=200, headers=headers)
        await out.prepare(request)
        resumed_on: list[str] = []
        failed: str | None = None
        end: list[bytes] = []  # the stream's last bytes, sent with its end in one write
        try:
            while True:
                assert attempt.resp is not None
                try:
                    end.append(await pump(attempt.resp, out, state))
                    break
                except StreamBroken as exc:
                    log.warning("stream from %s broke after %d tokens: %s",
                                attempt.placement.worker, len(state.generated), exc)
                    self._failed(attempt, tried, hard=True)
                    if state.finish_reason is not None:
                        break  # only the end was lost: finish it here
                    if not creq.resumable or len(resumed_on) >= svc.config.max_resumes:
                        failed = f"worker failed mid-stream: {exc}"
                        svc.metrics.resumptions.labels("refused").inc()
                        break
                    nxt = await self._open(creq, tried, state,
                                           broken=attempt.placement.worker)
                    if isinstance(nxt, web.Response):
                        failed = f"worker failed mid-stream and no other could resume: {exc}"
                        svc.metrics.resumptions.labels("failed").inc()
                        break
                    attempt = nxt
                    resumed_on.append(attempt.placement.worker)
                    svc.metrics.resumptions.labels("resumed").inc()
                    note = {"resumed_on": attempt.placement.worker,
                            "after_tokens": len(state.generated)}
                    await out.write(b": kvkeep " + _DUMPS(note).encode() + b"\n\n")
            if failed is not None:
                end.append(sse({"error": {"message": failed, "type": "upstream_error",
                                          "param": None, "code": 502}}))
            else:
                if creq.include_usage and not state.usage_sent and state.chunk_id is not None:
                    end.append(sse(state.usage_chunk()))
                summary = {"worker": attempt.placement.worker, "route": attempt.placement.label,
                           "resumed_on": resumed_on, "failover": bool(tried),
                           "completion_tokens": len(state.generated)}
                end.append(b": kvkeep " + _DUMPS(summary).encode() + b"\n\n")
                svc.remember_tokens(creq.session_id, state.prompt_ids, state.generated)
                svc.settle(attempt.placement)
            end.append(b"data: [DONE]\n\n")
            # One write (and one wake-up of the client) for the summary, [DONE] and the
            # chunked-encoding terminator; the client's last byte is the stream's end.
            await out.write_eof(b"".join(end))
        except (ConnectionResetError, asyncio.CancelledError):
            log.info("client left a stream from %s", attempt.placement.worker)
            raise
        finally:
            self._release(attempt, reuse=state.done)
        return out

    async def _open(self, creq: ClientRequest, tried: set[WorkerId], state: StreamState,
                    broken: WorkerId | None = None) -> _Attempt | web.Response:
        """Place and open a stream (the original, or a continuation of `state`). Returns the
        open attempt, or the response to give the client when no worker can take it."""
        svc = self.service
        last = "no attempt"
        continuing = state.prompt_ids is not None
        for attempt_no in range(svc.config.max_attempts):
            try:
                attempt = await self._place(creq, tried)
            except RouterError as exc:
                if not tried:
                    raise
                return _error_response(exc if isinstance(exc, NoHealthyWorker)
                                       else UpstreamError(str(exc)))
            placement = attempt.placement
            if continuing:
                path = Endpoint.COMPLETIONS.value
                body = resume_body(state, svc.kv_transfer_params(
                    creq, placement, resumed_from=broken))
            else:
                path = creq.endpoint.value
                body = self._upstream_body(creq, placement)
            url = self._url(placement.worker, path)
            if url is None:
                tried.add(placement.worker)
                self._release(attempt)
                continue
            try:
                resp = await svc.http_session.post(url, data=_DUMPS(body).encode(),
                                                   headers=_JSON, timeout=svc.stream_timeout)
            except UPSTREAM_ERRORS as exc:
                last = f"{placement.worker}: {type(exc).__name__}: {exc}"
                self._failed(attempt, tried, hard=True)
                self._release(attempt)
                continue
            if resp.status == 200:
                attempt.resp = resp
                if continuing:
                    state.continue_here()
                svc.pool.record_success(placement.worker)
                return attempt
            data = await resp.read()
            resp.release()
            self._release(attempt)
            if resp.status in _RETRYABLE_STATUS and attempt_no + 1 < svc.config.max_attempts:
                last = f"{placement.worker}: HTTP {resp.status}"
                self._failed(attempt, tried, hard=False)
                continue
            # The worker's own verdict on the request (400 and the like): pass it through.
            return web.Response(status=resp.status, body=data,
                                content_type=resp.content_type or "application/json",
                                headers=self._headers(creq, placement, failover=bool(tried)))
        return _error_response(UpstreamError(f"no worker could serve the request ({last})"))

    # --- helpers ---------------------------------------------------------------------------
    async def _place(self, creq: ClientRequest, tried: set[WorkerId]) -> _Attempt:
        svc = self.service
        route = svc.route_request(creq, frozenset(tried))
        placement = await svc.place(creq, route)
        svc.scheduler.commit(route, placement.decision)
        return _Attempt(placement)

    def _release(self, attempt: _Attempt, *, reuse: bool = False) -> None:
        """Free the worker's share of the load; close the worker's response, or with `reuse`
        (it sent its [DONE]) let its connection go back to the pool once the response ends."""
        resp = attempt.resp
        if resp is not None:
            if reuse and resp.connection is not None:
                attempt.resp = None
                self.service.background(_keep_alive(resp))
            else:
                resp.close()
        if not attempt.released:
            attempt.released = True
            self.service.pool.release(attempt.placement.worker, attempt.placement.route.tokens)

    def _failed(self, attempt: _Attempt, tried: set[WorkerId], *, hard: bool) -> None:
        worker = attempt.placement.worker
        tried.add(worker)
        self._release(attempt)
        self.service.pool.record_failure(worker, hard=hard)
        self.service.metrics.upstream_failures.labels(worker).inc()

    def _url(self, worker: WorkerId, path: str) -> str | None:
        state = self.service.pool.get(worker)
        return None if state is None else state.info.url + path

    def _upstream_body(self, creq: ClientRequest, placement: Placement) -> dict[str, Any]:
        body = dict(creq.body)
        if creq.resumable or creq.session_id is not None:
            # Token ids let a broken stream resume exactly and give the next turn a precise
            # prefix; they are stripped from the reply unless the client asked.
            body["return_token_ids"] = True
        params = self.service.kv_transfer_params(creq, placement)
        if params is not None:
            body["kv_transfer_params"] = params
        return body

    @staticmethod
    def _headers(creq: ClientRequest, placement: Placement, *, failover: bool
                 ) -> dict[str, str]:
        label = placement.label
        headers = {
            "X-KVKeep-Worker": placement.worker,
            "X-KVKeep-Route": label,
            "X-KVKeep-Restore": "1" if placement.restore_from is not None else "0",
            "X-KVKeep-Failover": "1" if failover or label in ("failover", "resumed") else "0",
            "X-KVKeep-Migrated": "1" if label == "migrated" else "0",
        }
        if creq.session_id is not None:
            headers["X-KVKeep-Session"] = creq.session_id
        return headers


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


def build_app(service: RouterService) -> web.Application:
    """The aiohttp application of `service`, starting and stopping it with the app."""
    app = Proxy(service).app()

    async def lifecycle(_: web.Application) -> Any:
        await service.start()
        yield
        await service.stop()

    app.cleanup_ctx.append(lifecycle)
    return app
