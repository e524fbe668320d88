"""The endpoint picker's decision for one HTTP request: the router core's, as for the proxy.

Generation requests (`POST /v1/completions`, `/v1/chat/completions`) are parsed as the proxy
parses them (model, session id from `X-Session-Id` or the body, prompt), placed by the core
(session stickiness and migration bound by compare-and-swap, prefix and load scored, the pick
charged) and given ranked fallbacks: the next picks with the ones before excluded (decided,
neither bound nor charged). Their body gains the connector's `kv_transfer_params` (session id,
epoch, restore hint), as the proxy sends it, after the proxy's admission (the tenant's own
`cache_salt`, the client's `kv_transfer_params` filtered). `GET /v1/models` goes to the least
loaded usable worker, without a body.

The paths a worker may be sent are the HTTP front's (`ROUTES`): any other is an immediate 404
(405 for a known path with another method), never forwarded. vLLM serves more on the same port
(`/v1/responses` and `/inference/v1/generate` take `cache_salt` and raw `kv_transfer_params`,
`/metrics` counts prefix-cache hits, `/scale_elastic_ep` is an admin call): forwarding them
would let a tenant set another tenant's salt or reach the workers' admin surface
(trust-review H5). Every request is authenticated on its headers (`authorize`), whatever the
body mode, before anything else.

A data plane's subset hint (`x-gateway-destination-endpoint-subset`) restricts every pick to
the listed endpoints; an empty or ineligible subset is a 503.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, replace

from router.core import RouterCore
from router.decision import Placement, RouteRequest
from router.errors import (
    MethodNotAllowed,
    ModelNotFound,
    NoHealthyWorker,
    NotFound,
    RouterError,
    Unauthorized,
)
from router.extproc.endpoints import EndpointBook
from router.front.admission import admit
from router.front.api import SESSION_HEADER, ClientRequest, Endpoint, parse_request
from router.front.upstream import kv_transfer_params
from router.hooks import FAILED
from router.membership.workers import WorkerId, WorkerState
from router.tenants import ApiKeys, bearer_tenant

__all__ = ["Pick", "EndpointPicker", "ROUTES", "Authorized"]

_DUMPS = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode
ROUTES: dict[str, tuple[str, Endpoint | None]] = {
    Endpoint.COMPLETIONS.value: ("POST", Endpoint.COMPLETIONS),
    Endpoint.CHAT.value: ("POST", Endpoint.CHAT),
    "/v1/models": ("GET", None),
}
"""Path -> (method, generation endpoint or None): what a worker may be sent through Envoy."""


@dataclass(frozen=True, slots=True)
class Authorized:
    """A request that may go on: its tenant and what it asks for."""

    tenant: str
    endpoint: Endpoint | None


@dataclass(frozen=True, slots=True)
class Pick:
    """Where to send a request: `endpoints` in rank order (the first is `placement`'s worker
    when there is a placement), and the body to send instead of the client's (None: as is)."""

    endpoints: tuple[str, ...]
    placement: Placement | None
    creq: ClientRequest | None
    body: bytes | None


class EndpointPicker:
    def __init__(self, core: RouterCore, *, fallbacks: int = 2,
                 api_keys: ApiKeys | None = None) -> None:
        self.api_keys = api_keys
        self.core = core
        self.fallbacks = fallbacks
        self.book = EndpointBook()

    def authorize(self, method: str, path: str, headers: dict[str, str]) -> Authorized:
        """The tenant of a request's headers and its route, or a `RouterError`: 401 without a
        good key, 404 for a path outside `ROUTES`, 405 for another method on one of them.
        Envoy passes the client's headers: the same API keys and tenants as the HTTP front."""
        tenant = bearer_tenant(self.api_keys, _header(headers, "authorization"))
        if tenant is None:
            raise Unauthorized("invalid or missing API key")
        route = path.split("?", 1)[0]
        allowed = ROUTES.get(route)
        if allowed is None:
            raise NotFound(f"no route {route[:200]}")
        if method != allowed[0]:
            raise MethodNotAllowed(f"{method[:16]} not allowed here")
        return Authorized(tenant, allowed[1])

    async def pick(self, method: str, path: str, headers: dict[str, str], body: bytes,
                   subset: Sequence[str] | None) -> Pick:
        """Raises a `RouterError` (its status goes back as an immediate response)."""
        asked = self.authorize(method, path, headers)
        allowed = await self._allowed(subset)
        endpoint = asked.endpoint
        if endpoint is None:
            # A body on GET /v1/models is nobody's business: the worker gets none.
            return Pick(await self._least_loaded(allowed), None, None, b"")
        creq = admit(parse_request(endpoint, body, _header(headers, SESSION_HEADER)),
                     asked.tenant, keys=self.api_keys)
        if creq.model not in self.core.models():
            raise ModelNotFound(f"The model `{creq.model}` does not exist.", param="model")
        exclude = frozenset(w for w in self._ids() if w not in allowed)
        route = replace(self.core.route(creq.features), exclude=exclude)
        placement = await self.core.place(route)
        ranked = [placement.worker, *self._fallbacks(route, placement.worker)]
        endpoints = tuple(e for w in ranked if (e := allowed.get(w)) is not None)
        if not endpoints:  # the worker placed has no address Envoy can dial
            self.core.finish(placement, FAILED)
            raise NoHealthyWorker("no worker of the pool has a dialable address")
        upstream = dict(creq.body)
        params = kv_transfer_params(creq, placement)
        if params is not None:
            upstream["kv_transfer_params"] = params
        return Pick(endpoints, placement, creq, _DUMPS(upstream).encode())

    def _ids(self) -> list[WorkerId]:
        return [s.worker_id for s in self.core.workers()]

    async def _allowed(self, subset: Sequence[str] | None) -> dict[WorkerId, str]:
        """Usable workers (as endpoints) the picks may use."""
        wanted = None if subset is None else {e.strip() for e in subset}
        allowed: dict[WorkerId, str] = {}
        for state in self.core.workers():
            if not self.core.usable(state):
                continue
            endpoint = await self.book.endpoint(state)
            if endpoint is not None and (wanted is None or endpoint in wanted):
                allowed[state.worker_id] = endpoint
        if subset is not None and not allowed:
            raise NoHealthyWorker("no eligible endpoint in the data plane's subset")
        return allowed

    def _fallbacks(self, route: RouteRequest, first: WorkerId) -> list[WorkerId]:
        ranked: list[WorkerId] = []
        tried = {first}
        for _ in range(self.fallbacks):
            try:
                decision = self.core.decide(replace(route, exclude=route.exclude | tried),
                                            migrate=False)
            except RouterError:
                break
            ranked.append(decision.worker)
            tried.add(decision.worker)
        return ranked

    async def _least_loaded(self, allowed: dict[WorkerId, str]) -> tuple[str, ...]:
        states: list[WorkerState] = [s for s in self.core.workers() if s.worker_id in allowed]
        if not states:
            raise NoHealthyWorker("no usable worker")
        states.sort(key=lambda s: (s.queue, s.kv_usage))
        return tuple(allowed[s.worker_id] for s in states[: 1 + self.fallbacks])


def _header(headers: dict[str, str], name: str) -> str | None:
    return headers.get(name.lower())

