"""The ext_proc gRPC server: `envoy.service.ext_proc.v3.ExternalProcessor` over the router
core, plus the standard health service under the names the protocol gives (`liveness`,
`readiness`, the ext_proc service's own name, and "").

Started by `kvkeep router serve --extproc-listen HOST:PORT` beside the HTTP front, on the same
core: the same sessions (etcd, compare-and-swap), prefix indexes and load. Needs the
`gateway` extra (`xds-protos`).

The listener itself authenticates nobody (Envoy is its client; the requests' API keys are
checked per request). Whoever reaches it can claim which endpoint served or that a worker
answered 200, so without API keys it binds loopback only, as the HTTP front does: a
non-loopback address without keys is refused (trust-review H5). Across hosts, put it on a
network only the gateway reaches (deploy/gateway/networkpolicy.yaml).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc  # type: ignore[import-untyped, unused-ignore]
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

from kvstore._proto import health_pb2
from kvstore.errors import ConfigError
from kvstore.net.addresses import is_loopback
from router.core import RouterCore
from router.extproc.picker import EndpointPicker
from router.extproc.stream import RequestStream
from router.tenants import ApiKeys

__all__ = ["ExtProcServer", "EXTPROC_SERVICE", "HEALTH_NAMES", "check_listen"]

log = logging.getLogger(__name__)

EXTPROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
HEALTH_NAMES = frozenset({"", "liveness", "readiness", EXTPROC_SERVICE})
_Serving = health_pb2.HealthCheckResponse.ServingStatus


class _Processor(ep_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    def __init__(self, picker: EndpointPicker, max_body_bytes: int) -> None:
        self.picker = picker
        self.max_body_bytes = max_body_bytes

    async def Process(self, request_iterator: AsyncIterator[ep.ProcessingRequest],
                      context: Any) -> AsyncIterator[ep.ProcessingResponse]:
        stream = RequestStream(self.picker, max_body_bytes=self.max_body_bytes)
        async for response in stream.run(request_iterator):
            yield response


def check_listen(address: str, api_keys: ApiKeys | None) -> None:
    """ConfigError for a non-loopback ext_proc `address` (HOST:PORT) without API keys."""
    host = address.rpartition(":")[0].strip("[]")
    if not api_keys and not is_loopback(host):
        raise ConfigError(
            f"refusing to serve ext_proc on {address}: without --api-keys the endpoint picker "
            "listens on loopback only (give an API key file to serve a network)")


class ExtProcServer:
    """Listens on `address` (HOST:PORT) until `stop`."""

    def __init__(self, core: RouterCore, address: str, *, fallbacks: int = 2,
                 max_body_bytes: int = 8 << 20, api_keys: ApiKeys | None = None) -> None:
        check_listen(address, api_keys)
        self.address = address
        self.picker = EndpointPicker(core, fallbacks=fallbacks, api_keys=api_keys)
        self._processor = _Processor(self.picker, max_body_bytes)
        self._server: Any = None
        self.port = 0

    async def start(self) -> None:
        server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 << 20),
                                          ("grpc.max_send_message_length", 64 << 20)])
        ep_grpc.add_ExternalProcessorServicer_to_server(self._processor, server)
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
            "grpc.health.v1.Health", {"Check": grpc.unary_unary_rpc_method_handler(
                self._check, request_deserializer=health_pb2.HealthCheckRequest.FromString,
                response_serializer=health_pb2.HealthCheckResponse.SerializeToString)})])
        self.port = server.add_insecure_port(self.address)
        await server.start()
        self._server = server
        log.info("ext_proc endpoint picker listening on %s", self.address)

    async def stop(self, grace: float = 1.0) -> None:
        if self._server is not None:
            server, self._server = self._server, None
            await server.stop(grace)

    async def _check(self, request: health_pb2.HealthCheckRequest, context: Any
                     ) -> health_pb2.HealthCheckResponse:
        if request.service not in HEALTH_NAMES:
            await context.abort(grpc.StatusCode.NOT_FOUND, "unknown service")
        ready = request.service == "liveness" or self.picker.core.status().usable_workers > 0
        return health_pb2.HealthCheckResponse(
            status=_Serving.SERVING if ready else _Serving.NOT_SERVING)
