"""Where control-plane loops get their etcd client, and what happens to it after a failure.

`FreshClients`: a new client per attempt (each dialling the next endpoint), closed after it:
what a watcher wants, so that a broken stream never lingers. `StickyClients`: one client kept
until a failure, then the next endpoint: what a lease keeper wants (a keepalive every TTL/3
should not dial).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, Protocol

from kvstore.etcd import EtcdSpec, etcd_client, etcd_spec

__all__ = ["ClientSource", "FreshClients", "StickyClients"]


class ClientSource(Protocol):
    """Where the watcher gets its etcd client, and what it does with it after a failure."""

    async def acquire(self) -> Any: ...

    async def release(self, client: Any, *, failures: int) -> None:
        """`failures`: how many attempts in a row failed (0: the watch ended cleanly)."""
        ...


class FreshClients:
    """A new client per attempt, each dialling the next endpoint, closed after it."""

    def __init__(self, etcd: EtcdSpec | str, timeout: float = 2.0) -> None:
        self._etcd = etcd_spec(etcd)
        self._timeout = timeout
        self._attempt = 0

    async def acquire(self) -> Any:
        client = etcd_client(self._etcd, self._attempt, timeout=self._timeout)
        self._attempt += 1
        return client

    async def release(self, client: Any, *, failures: int) -> None:
        with contextlib.suppress(Exception):
            async with asyncio.timeout(self._timeout):
                await client.close()


class StickyClients:
    """One client until a failure; after one, the next endpoint's."""

    def __init__(self, etcd: EtcdSpec | str, timeout: float = 2.0) -> None:
        self._etcd = etcd_spec(etcd)
        self._timeout = timeout
        self._dials = 0
        self._client: Any = None

    async def acquire(self) -> Any:
        if self._client is None:
            self._client = etcd_client(self._etcd, self._dials, timeout=self._timeout)
            self._dials += 1
        return self._client

    async def release(self, client: Any, *, failures: int) -> None:
        if failures and client is self._client:
            await self.close()

    async def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(self._timeout):
                    await client.close()
