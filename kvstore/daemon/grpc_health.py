"""The standard gRPC health service (grpc.health.v1.Health) of a daemon: SERVING until it
starts draining. It answers without a token: probes carry none."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc  # type: ignore[import-untyped, unused-ignore]

from kvstore._proto import health_pb2
from kvstore.net.grpc_options import HEALTH_SERVICE, KVSTORE_SERVICE

__all__ = ["HealthService"]

_Serving = health_pb2.HealthCheckResponse.ServingStatus


class HealthService:
    """grpc.health.v1.Health: SERVING until the daemon starts draining."""

    def __init__(self) -> None:
        self._status = _Serving.NOT_SERVING
        self._changed = asyncio.Condition()

    @property
    def serving(self) -> bool:
        return bool(self._status == _Serving.SERVING)

    async def set_serving(self, serving: bool) -> None:
        async with self._changed:
            self._status = _Serving.SERVING if serving else _Serving.NOT_SERVING
            self._changed.notify_all()

    def generic_handler(self) -> Any:
        return grpc.method_handlers_generic_handler(HEALTH_SERVICE, {
            "Check": grpc.unary_unary_rpc_method_handler(
                self.check, request_deserializer=health_pb2.HealthCheckRequest.FromString,
                response_serializer=_serialize),
            "Watch": grpc.unary_stream_rpc_method_handler(
                self.watch, request_deserializer=health_pb2.HealthCheckRequest.FromString,
                response_serializer=_serialize),
        })

    async def check(self, request: health_pb2.HealthCheckRequest, context: Any
                    ) -> health_pb2.HealthCheckResponse:
        if request.service not in ("", KVSTORE_SERVICE):
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service}")
        return health_pb2.HealthCheckResponse(status=self._status)

    async def watch(self, request: health_pb2.HealthCheckRequest, context: Any
                    ) -> AsyncIterator[health_pb2.HealthCheckResponse]:
        if request.service not in ("", KVSTORE_SERVICE):
            yield health_pb2.HealthCheckResponse(status=_Serving.SERVICE_UNKNOWN)
            return
        last = None
        while True:
            async with self._changed:
                if last == self._status:
                    await self._changed.wait()
                last = self._status
            yield health_pb2.HealthCheckResponse(status=last)


def _serialize(message: Any) -> bytes:
    return bytes(message.SerializeToString())
