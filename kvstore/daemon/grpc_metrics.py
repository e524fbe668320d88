"""Times and counts the gRPC front's calls (kvstore/daemon/metrics.py) from outside it.

A server interceptor wraps each KVStore method's handler: the status a call ended with is the
one its context holds when the handler returns or aborts (a `Refusal` becomes an abort with the
reason's code, kvstore/daemon/grpc_front.py), so nothing in the front itself changes. The
health service is not timed: its Watch is a stream that lasts as long as the client.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc  # type: ignore[import-untyped, unused-ignore]

from kvstore.daemon.metrics import DaemonMetrics
from kvstore.net.grpc_options import KVSTORE_SERVICE
from kvstore.net.refusal import OK

__all__ = ["RpcMetricsInterceptor"]

_PREFIX = f"/{KVSTORE_SERVICE}/"
_CANCELLED = 1
_UNKNOWN = 2


def _code(context: Any, failed: bool) -> int:
    """The status a call ended with: the context's code if one was set, else OK (or UNKNOWN
    when the handler raised without setting one, and CANCELLED when the client went away)."""
    code = context.code()
    if code is not None:
        value = code.value[0] if isinstance(code, grpc.StatusCode) else int(code)
        return int(value)
    if context.cancelled():
        return _CANCELLED
    return _UNKNOWN if failed else OK


class RpcMetricsInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    def __init__(self, metrics: DaemonMetrics) -> None:
        self._metrics = metrics

    async def intercept_service(self, continuation: Callable[[Any], Awaitable[Any]],
                                details: Any) -> Any:
        handler = await continuation(details)
        method: str = details.method
        if handler is None or not method.startswith(_PREFIX):
            return handler
        rpc = method[len(_PREFIX):]
        if handler.unary_unary is not None:
            return handler._replace(unary_unary=self._unary(rpc, handler.unary_unary))
        if handler.stream_unary is not None:
            return handler._replace(stream_unary=self._unary(rpc, handler.stream_unary))
        if handler.unary_stream is not None:
            return handler._replace(unary_stream=self._streaming(rpc, handler.unary_stream))
        return handler

    def _unary(self, rpc: str, behavior: Callable[[Any, Any], Awaitable[Any]]
               ) -> Callable[[Any, Any], Awaitable[Any]]:
        metrics = self._metrics

        async def timed(request: Any, context: Any) -> Any:
            started = time.perf_counter()
            failed = True
            try:
                reply = await behavior(request, context)
                failed = False
                return reply
            finally:
                metrics.record("grpc", rpc, _code(context, failed), time.perf_counter() - started)
        return timed

    def _streaming(self, rpc: str, behavior: Callable[[Any, Any], AsyncIterator[Any]]
                   ) -> Callable[[Any, Any], AsyncIterator[Any]]:
        metrics = self._metrics

        async def timed(request: Any, context: Any) -> AsyncIterator[Any]:
            started = time.perf_counter()
            failed = True
            try:
                async for message in behavior(request, context):
                    yield message
                failed = False
            finally:
                metrics.record("grpc", rpc, _code(context, failed), time.perf_counter() - started)
        return timed
