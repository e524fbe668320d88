"""The OpenAI-compatible HTTP front: requests in, responses out; nothing else.

Routes: `POST /v1/completions`, `POST /v1/chat/completions`, `POST /v1/responses` (streaming
and not; the Responses API is routed, placed and failed over like the others, but never
resumed mid-stream: `router/front/director.py`), `GET /v1/models`, `GET /health`, `GET /metrics`,
and read-only `GET /kvkeep/workers`, `GET /kvkeep/sessions/{id}` for operators and tests.

Per generation request: parse and validate (`router/front/api.py`), admit it for its tenant
(`router/front/admission.py`), hand it to the request director
(`router/front/director.py`: continuation rebuilt, placed by the router core, sent, retried
on another worker while nothing has reached the client, relayed, resumed after a break,
finished, its conversation recorded), and write
what it returns: a unary reply, or a stream it wrote through `_HttpSink` (aiohttp's
`StreamResponse`, opened when the director has the worker's stream).

Response headers say what happened: `X-KVKeep-Worker`, `X-KVKeep-Route` (stateless, new,
sticky, migrated, failover, resumed), `X-KVKeep-Session`, `X-KVKeep-Restore` (a restore hint
was sent), `X-KVKeep-Failover`, `X-KVKeep-Migrated`, and for non-streaming replies
`X-KVKeep-Cached-Tokens` / `X-KVKeep-Recomputed-Tokens` (from the worker's usage: local
prefix-cache hits and tokens the connector loaded both count as cached) and
`X-KVKeep-Restored-Tokens` / `X-KVKeep-Checkpointed-Tokens` (when its connector reports
them). A stream's later events (resumption) are told in SSE comments, which OpenAI clients
ignore.

With API keys (`router/tenants.py`) every `/v1/` and `/kvkeep/` request needs a key, which
names its tenant: the request is admitted for that tenant (`router/front/admission.py`: its cache
salt, the `kv_transfer_params` a client may set), it may use only its own sessions (another
tenant's is a 404, on generation as on `/kvkeep/sessions/{id}`), and `/kvkeep/workers`
(worker addresses and load) is an operator's (`*` key) only. So are `/metrics` (its counters
tell one tenant about another's traffic: the tokenize cache's hits were an exact-prompt oracle,
trust-review M11) and `/health`'s detail (sessions, workers, indexes): without an operator's
key `/health` answers `{"status": "ok"}` alone, which is all a liveness or readiness probe
needs.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from aiohttp import web

from kvstore.keys import SessionId
from router.conversations import CONTINUE_HEADER
from router.errors import (
    Forbidden,
    MethodNotAllowed,
    NotFound,
    PayloadTooLarge,
    RouterError,
    Unauthorized,
)
from router.front.admission import admit
from router.front.api import SESSION_HEADER, Endpoint, parse_request
from router.front.director import Reply, RequestDirector
from router.metrics import CONTENT_TYPE_LATEST
from router.service import RouterService
from router.tenants import DEFAULT_TENANT, OPERATOR, bearer_tenant

__all__ = ["Proxy", "build_app"]

log = logging.getLogger(__name__)

_DUMPS = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode
_TENANT = web.RequestKey("kvkeep.tenant", str)
_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _error_response(exc: RouterError) -> web.Response:
    return web.Response(status=exc.status, body=_DUMPS(exc.body()).encode(),
                        content_type="application/json", headers=exc.headers())


class _HttpSink:
    """The client's stream: an aiohttp `StreamResponse`, opened when the director asks."""

    __slots__ = ("request", "response")

    def __init__(self, request: web.Request) -> None:
        self.request = request
        self.response: web.StreamResponse | None = None

    async def prepare(self, headers: Mapping[str, str]) -> None:
        self.response = web.StreamResponse(status=200, headers=headers)
        await self.response.prepare(self.request)

    async def write(self, data: bytes) -> None:
        assert self.response is not None, "written before prepare"
        await self.response.write(data)

    async def write_eof(self, data: bytes) -> None:
        assert self.response is not None, "ended before prepare"
        await self.response.write_eof(data)


class Proxy:
    __slots__ = ("_director", "service")

    def __init__(self, service: RouterService) -> None:
        self.service = service
        self._director: RequestDirector | None = None

    # --- application -----------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.service.config.max_body_bytes,
                              middlewares=[self._errors, self._auth])
        app.router.add_post(Endpoint.COMPLETIONS.value, self.completions)
        app.router.add_post(Endpoint.CHAT.value, self.chat)
        app.router.add_post(Endpoint.RESPONSES.value, self.responses)
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
        tenant = DEFAULT_TENANT
        if keys and (request.path.startswith(("/v1/", "/kvkeep/")) or request.path == "/metrics"):
            found = bearer_tenant(keys, request.headers.get("Authorization"))
            if found is None:
                raise Unauthorized("invalid or missing API key")
            tenant = found
        elif keys and request.path == "/health":
            # Open to probes, in detail for operators only: "" is nobody's tenant.
            tenant = bearer_tenant(keys, request.headers.get("Authorization")) or ""
        request[_TENANT] = tenant
        return await handler(request)

    # --- simple endpoints ------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        if self.service.config.api_keys and request[_TENANT] != OPERATOR:
            return web.json_response({"status": "ok"})
        status = self.service.core.status()
        return web.json_response({
            "status": "ok", "state": self.service.backend.name,
            "replica": self.service.config.replica_id,
            "workers": {"registered": status.workers, "usable": status.usable_workers},
            "sessions": status.sessions, "kv_index_blocks": status.kv_index_blocks,
            "kv_events_applied": status.kv_events_applied})

    async def metrics(self, request: web.Request) -> web.Response:
        if self.service.config.api_keys and request[_TENANT] != OPERATOR:
            raise Forbidden("the router's metrics are for operator keys")
        return web.Response(body=self.service.metrics.render(),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def models(self, request: web.Request) -> web.Response:
        created = int(time.time())
        data = [{"id": m, "object": "model", "created": created, "owned_by": "kvkeep"}
                for m in sorted(self.service.core.models())]
        return web.json_response({"object": "list", "data": data})

    async def workers(self, request: web.Request) -> web.Response:
        if self.service.config.api_keys and request[_TENANT] != OPERATOR:
            raise Forbidden("the worker list is for operator keys")
        core = self.service.core
        return web.json_response([{
            "id": w.worker_id, "url": w.info.url, "models": list(w.info.models),
            "usable": core.usable(w), "draining": w.info.draining, "queue": w.queue,
            "waiting": w.waiting, "kv_usage": w.kv_usage, "inflight": w.inflight,
            "gpu_mem_frac": w.info.gpu_mem_frac, "gpu_temp_c": w.info.gpu_temp_c,
        } for w in core.workers()])

    async def session(self, request: web.Request) -> web.Response:
        vb = self.service.core.session(SessionId(request.match_info["session_id"]))
        tenant = request[_TENANT]
        if vb is None or tenant not in (OPERATOR, vb.binding.owner):
            raise NotFound("no such session")
        b = vb.binding
        return web.json_response({"session_id": b.session_id, "worker": b.worker_id,
                                  "model": b.model, "epoch": b.epoch,
                                  "restore_from": b.restore_from, "reason": b.reason,
                                  "owner": b.owner, "revision": vb.revision})

    # --- generation ------------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, Endpoint.COMPLETIONS)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, Endpoint.CHAT)

    async def responses(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, Endpoint.RESPONSES)

    async def _generate(self, request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
        limit = self.service.config.max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            raise PayloadTooLarge(f"request body exceeds {limit} bytes")
        raw = await request.read()
        creq = admit(parse_request(endpoint, raw, request.headers.get(SESSION_HEADER)),
                     request[_TENANT], keys=self.service.config.api_keys)
        sink = _HttpSink(request)
        reply = await self.director().generate(
            creq, sink, continue_header=request.headers.get(CONTINUE_HEADER))
        if reply is None:
            assert sink.response is not None, "the director streamed without opening the sink"
            return sink.response
        return _response(reply)

    def director(self) -> RequestDirector:
        """The director over the service's dispatcher (made when the service starts: one
        director per start)."""
        dispatcher = self.service.dispatcher
        director = self._director
        if director is None or director.dispatcher is not dispatcher:
            director = self._director = RequestDirector(
                dispatcher, self.service.continuations,
                max_resumes=self.service.config.max_resumes)
        return director


def _response(reply: Reply) -> web.Response:
    return web.Response(status=reply.status, body=reply.body, content_type=reply.content_type,
                        headers=reply.headers)


def build_app(service: RouterService) -> web.Application:
    """The aiohttp application of `service`, starting and stopping it with the app."""
    app = Proxy(service).app()

    async def lifecycle(_: web.Application) -> Any:
        await service.start()
        yield
        await service.stop()

    app.cleanup_ctx.append(lifecycle)
    return app
