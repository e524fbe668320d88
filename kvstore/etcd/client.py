"""The one place an etcd client is built: `etcd_client(spec, ...)`, for every component.

aetcd 1.0 always dials plaintext (`grpc.aio.insecure_channel`), whatever the URL said, and
authenticates once per connection: after etcd restarts (simple tokens live in its memory), or
after any user or role change (the token's auth revision is then old), every call fails until
the client is rebuilt. `EtcdClient` keeps aetcd's API and replaces how it connects:

- https endpoints get a TLS channel verified against the spec's CA, with its client
  certificate when given; http endpoints a plaintext one (the spec refuses TLS files there);
- with user auth, an interceptor puts the current token on every call and, when etcd says the
  token is stale, authenticates again and retries the call once (what etcd's own Go client
  does; a stale token is never an error the caller sees).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import aetcd  # type: ignore[import-untyped, unused-ignore]
import aetcd.rpc  # type: ignore[import-untyped, unused-ignore]
import aetcd.watcher  # type: ignore[import-untyped, unused-ignore]
import grpc  # type: ignore[import-untyped, unused-ignore]

from kvstore.etcd.spec import EtcdSpec, etcd_spec

__all__ = ["EtcdClient", "etcd_client"]

_AUTHENTICATE = "/etcdserverpb.Auth/Authenticate"
# How long close waits for aetcd's watcher to shut down when the client has no call timeout.
_WATCHER_SHUTDOWN_S = 2.0
# What etcd answers a token it no longer accepts (etcd's rpctypes, and clientv3's list of
# errors that make it re-authenticate).
_STALE_TOKEN = ("invalid auth token", "revision of auth store is old", "user name is empty")


def _stale(exc: grpc.aio.AioRpcError) -> bool:
    details = exc.details() or ""
    return any(text in details for text in _STALE_TOKEN)


def _method(details: Any) -> str:
    method = details.method
    return method.decode() if isinstance(method, bytes) else str(method)


class _TokenAuth:
    """etcd's simple/JWT token for one user, fetched on first use and on staleness."""

    def __init__(self, user: str, password: Callable[[], str | None], timeout: float | None
                 ) -> None:
        self._user = user
        self._password = password
        self._timeout = timeout
        self._token: str | None = None
        self._stub: Any = None
        self._lock: asyncio.Lock | None = None
        self.authentications = 0
        """How many tokens were fetched (1 normally; more after etcd restarts or auth edits)."""

    def bind(self, channel: Any) -> None:
        self._stub = aetcd.rpc.AuthStub(channel)
        self._token = None

    async def token(self) -> str:
        token = self._token
        return token if token is not None else await self.refresh(None)

    async def refresh(self, stale: str | None) -> str:
        """A fresh token, unless another call already replaced `stale` meanwhile."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self._token is not None and self._token != stale:
                return self._token
            reply = await self._stub.Authenticate(
                aetcd.rpc.AuthenticateRequest(name=self._user, password=self._password() or ""),
                timeout=self._timeout)
            self._token = str(reply.token)
            self.authentications += 1
            return self._token


def _with_token(details: Any, token: str) -> Any:
    metadata = grpc.aio.Metadata(*(details.metadata or ()))
    metadata.set_all("token", [token])
    return grpc.aio.ClientCallDetails(details.method, details.timeout, metadata,
                                      details.credentials, details.wait_for_ready)


class _UnaryAuth(grpc.aio.UnaryUnaryClientInterceptor):  # type: ignore[misc, unused-ignore]
    def __init__(self, auth: _TokenAuth) -> None:
        self._auth = auth

    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any
                                    ) -> Any:
        if _method(details) == _AUTHENTICATE:
            return await continuation(details, request)
        token = await self._auth.token()
        try:
            return await (await continuation(_with_token(details, token), request))
        except grpc.aio.AioRpcError as exc:
            if not _stale(exc):
                raise
        token = await self._auth.refresh(token)
        return await (await continuation(_with_token(details, token), request))


class _StreamAuth(grpc.aio.StreamStreamClientInterceptor):  # type: ignore[misc, unused-ignore]
    """Watches and lease keepalives carry the token too; a stream that fails on a stale one
    is re-opened by its owner, whose next unary call refreshes it."""

    def __init__(self, auth: _TokenAuth) -> None:
        self._auth = auth

    async def intercept_stream_stream(self, continuation: Any, details: Any,
                                      request_iterator: Any) -> Any:
        token = await self._auth.token()
        return await continuation(_with_token(details, token), request_iterator)


class EtcdClient(aetcd.Client):  # type: ignore[misc]
    """aetcd's client over the channel `spec` asks for (module docstring)."""

    def __init__(self, spec: EtcdSpec, endpoint: int = 0, *, timeout: float | None = None,
                 options: dict[str, Any] | None = None) -> None:
        host, port = spec.endpoints[endpoint % len(spec.endpoints)]
        # No username to aetcd: it would authenticate once and never again; we do it per call.
        super().__init__(host=host, port=port, timeout=timeout, options=options)
        self.spec = spec
        self.target = f"{host}:{port}"
        """The endpoint this client dials (for log lines)."""
        self._credentials = spec.channel_credentials()
        self.auth = (None if spec.user is None
                     else _TokenAuth(spec.user, spec.password, timeout))

    async def connect(self) -> None:
        if self._connected.is_set():
            return
        if self._is_connecting:  # type: ignore[has-type]  # another task is connecting: wait
            await asyncio.wait_for(self._connected.wait(), self._connect_wait_timeout)
            return
        try:
            self._is_connecting = True
            target = f"{self._host}:{self._port}"
            interceptors = (None if self.auth is None
                            else [_UnaryAuth(self.auth), _StreamAuth(self.auth)])
            options = list(self._options.items())
            if self._credentials is None:
                self.channel = grpc.aio.insecure_channel(target, options=options,
                                                         interceptors=interceptors)
            else:
                self.channel = grpc.aio.secure_channel(target, self._credentials,
                                                       options=options,
                                                       interceptors=interceptors)
            if self.auth is not None:
                self.auth.bind(self.channel)
            self.metadata = None
            self.kvstub = aetcd.rpc.KVStub(self.channel)
            self.clusterstub = aetcd.rpc.ClusterStub(self.channel)
            self.leasestub = aetcd.rpc.LeaseStub(self.channel)
            self.maintenancestub = aetcd.rpc.MaintenanceStub(self.channel)
            self._watcher = aetcd.watcher.Watcher(aetcd.rpc.WatchStub(self.channel),
                                                  timeout=self._timeout, metadata=None)
            self._connected.set()
        finally:
            self._is_connecting = False

    async def close(self) -> None:
        """aetcd's close, except that the channel always closes.

        aetcd shuts its watcher down first, awaiting the cancelled watch stream; against a dead
        or stopping server that await can outlast the caller's timeout (or be cancelled), and
        aetcd then never reached `channel.close()`: the channel stayed open on its loop, and
        once that loop closed, grpc's shared completion queue raised on the channel's late
        events and dropped other loops' events with them (a hang elsewhere; see
        tests/grpc_leaks.py). `channel.close()` itself cancels the calls without waiting.
        """
        channel, watcher = self.channel, self._watcher
        try:
            if watcher is not None:
                async with asyncio.timeout(self._timeout or _WATCHER_SHUTDOWN_S):
                    await watcher.shutdown()
        except TimeoutError:
            pass
        finally:
            self._init_channel_attrs()
            self._connected.clear()
            if channel is not None:
                await channel.close()


def etcd_client(spec: EtcdSpec | str, endpoint: int = 0, *, timeout: float | None = None
                ) -> EtcdClient:
    """A client of endpoint `endpoint` (modulo their number) of `spec`; connects on first use."""
    return EtcdClient(etcd_spec(spec), endpoint, timeout=timeout)
