"""One lease keeper: a key under a lease its holder refreshes (aetcd has no background
keepalive), whose value the keeper also checks on every refresh.

What it guards against: etcd restored from a snapshot (or an operator) dropping the key while
the lease lives; and anyone with write access overwriting the key with a value of their own,
under another lease or none (a forged registration pointing the id elsewhere). Either way the
keeper writes its own value back under its own lease, and counts it (`rewrites`). A lease that
is gone (etcd lost it, or a pause let it expire) is reported, and `run` registers again with a
new one.

The value may depend on the lease (`encode(lease_id)`: a signature covers it), so it is
computed after the grant and put under that lease. Timeouts use `asyncio.timeout`, not
`wait_for`: on Python 3.11 `wait_for` can swallow a cancellation that races with its inner call
finishing, which would make a drain hang.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable
from typing import Any

from kvstore.cluster.clients import ClientSource
from kvstore.cluster.retry import LOOP_RETRY, Backoff, RetryPolicy

__all__ = ["LeaseKeeper"]

_log = logging.getLogger(__name__)


class LeaseKeeper:
    """Keeps `key` -> `encode(lease)` registered under a lease of `ttl_s`."""

    def __init__(self, key: bytes, encode: Callable[[int], bytes], ttl_s: float, *,
                 timeout: float = 2.0, what: str = "registration") -> None:
        self.key = key
        self._encode = encode
        self.ttl_s = max(float(ttl_s), 1.0)
        self._timeout = timeout
        self._what = what
        self.lease_id: int | None = None
        self._value: bytes | None = None
        self.registered = asyncio.Event()
        self.registrations = 0
        """How many times the key was registered under a new lease (1 normally)."""
        self.rewrites = 0
        """How many times the key was found changed or gone under a live lease and rewritten."""

    async def register(self, client: Any) -> None:
        """Grant a lease and put the value under it."""
        async with asyncio.timeout(self._timeout):
            lease = await client.lease(max(1, math.ceil(self.ttl_s)))
            lease_id = int(lease.id)
            value = self._encode(lease_id)
            await client.put(self.key, value, lease=lease_id)
        self.lease_id, self._value = lease_id, value
        self.registrations += 1
        self.registered.set()

    async def replace(self, client: Any, encode: Callable[[int], bytes]) -> None:
        """Put a new value under the same lease (draining, fresh GPU figures)."""
        self._encode = encode
        if self.lease_id is None:
            return
        value = encode(self.lease_id)
        async with asyncio.timeout(self._timeout):
            await client.put(self.key, value, lease=self.lease_id)
        self._value = value

    async def refresh(self, client: Any) -> bool:
        """Keep the lease alive and the key ours; False when the lease is gone (register
        again)."""
        if self.lease_id is None:
            return False
        async with asyncio.timeout(self._timeout):
            reply = await client.refresh_lease(self.lease_id)
        if reply is None or int(reply.TTL) <= 0:
            self.lease_id = None
            self.registered.clear()
            return False
        async with asyncio.timeout(self._timeout):
            current = await client.get(self.key)
        if (current is not None and int(current.lease) == self.lease_id
                and bytes(current.value) == self._value):
            return True
        value = self._encode(self.lease_id)
        _log.warning("etcd %s %r was %s; writing it back", self._what, self.key,
                     "gone" if current is None else "changed by someone else")
        async with asyncio.timeout(self._timeout):
            await client.put(self.key, value, lease=self.lease_id)
        self._value = value
        self.rewrites += 1
        return True

    async def revoke(self, client: Any) -> None:
        """Revoke the lease (deleting the key with it)."""
        lease_id, self.lease_id = self.lease_id, None
        self.registered.clear()
        if lease_id is not None:
            async with asyncio.timeout(self._timeout):
                await client.revoke_lease(lease_id)

    def forget(self) -> None:
        """The lease is lost (an error): register anew on the next round."""
        self.lease_id = None
        self.registered.clear()

    async def run(self, clients: ClientSource, retry: RetryPolicy = LOOP_RETRY) -> None:
        """Register, then refresh every TTL/3 until cancelled; register again after any
        failure, backing off (never longer than TTL/3 between tries)."""
        backoff = Backoff(retry.capped(self.ttl_s / 3))
        while True:
            client = await clients.acquire()
            try:
                if self.lease_id is None:
                    await self.register(client)
                    _log.info("registered %r in etcd (lease %x, ttl %.0fs)", self.key,
                              self.lease_id or 0, self.ttl_s)
                backoff.reset()
                await asyncio.sleep(self.ttl_s / 3)
                if not await self.refresh(client):
                    _log.warning("etcd lease of %r is gone; registering again", self.key)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # aetcd and grpc errors alike: etcd is down or restarting
                _log.warning("etcd %s of %r failed (%s); retrying", self._what, self.key, exc)
                self.forget()
                await clients.release(client, failures=backoff.failures + 1)
                await backoff.wait()
