"""The daemon's registration in etcd: a key under a lease that its own task keeps alive.

aetcd has no background keepalive, so `Registrar.run` refreshes the lease every TTL/3.
Timeouts use `asyncio.timeout`, not `asyncio.wait_for`: on Python 3.11 `wait_for` can swallow a
cancellation that races with its inner call finishing, which would make a drain hang. When a
refresh fails or finds the lease gone (etcd restarted and lost it, or a long pause let it
expire), it grants a new lease and writes the key again, retrying with backoff until etcd answers:
clients may briefly see the daemon disappear while etcd is down, never a stale address. On a
clean stop the lease is revoked, so clients see the daemon leave at once instead of after a TTL.

With a `RegistrationSigner` the value is signed over the key, the lease and every field
(kvstore/tiers/daemon_trust.py): the lease is granted first, then the signed value is put.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from kvstore.etcd import EtcdSpec, etcd_client, etcd_spec
from kvstore.tiers.daemon_trust import RegistrationSigner
from kvstore.tiers.discovery import DEFAULT_PREFIX, DaemonInfo

__all__ = ["Registrar"]

_log = logging.getLogger(__name__)


class Registrar:
    """Keeps `<prefix><node_id>` -> DaemonInfo registered while `run()` runs."""

    def __init__(self, etcd: EtcdSpec | str, info: DaemonInfo, *, prefix: str = DEFAULT_PREFIX,
                 ttl: int = 5, request_timeout: float = 2.0,
                 signer: RegistrationSigner | None = None) -> None:
        self._etcd = etcd_spec(etcd)
        self._info = info
        self._signer = signer
        self._key = f"{prefix}{info.node_id}".encode()
        self._ttl = max(int(ttl), 1)
        self._timeout = request_timeout
        self._client: Any = None
        self._dials = 0
        self._lease_id: int | None = None
        self.registered = asyncio.Event()
        self.registrations = 0
        """How many times the key was (re)written: 1 normally, more after etcd trouble."""

    @property
    def key(self) -> bytes:
        return self._key

    async def run(self) -> None:
        """Register, then refresh every TTL/3 until cancelled; re-register after any failure."""
        attempt = 0
        while True:
            try:
                if self._lease_id is None:
                    await self._register()
                    attempt = 0
                await asyncio.sleep(self._ttl / 3)
                if not await self._refresh():
                    _log.warning("etcd lease of %s is gone; registering again", self._info.node_id)
                    self._lease_id = None
                    self.registered.clear()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # aetcd and grpc errors alike: etcd is down or restarting
                attempt += 1
                _log.warning("etcd registration of %s failed (%s); retrying",
                             self._info.node_id, exc)
                self._lease_id = None
                self.registered.clear()
                await self._reset_client()
                await asyncio.sleep(min(0.1 * 2 ** min(attempt, 5), self._ttl / 3))

    async def deregister(self) -> None:
        """Revoke the lease (deleting the key with it); best effort, bounded by the timeout."""
        lease_id, self._lease_id = self._lease_id, None
        self.registered.clear()
        if lease_id is not None and self._client is not None:
            try:
                async with asyncio.timeout(self._timeout):
                    await self._client.revoke_lease(lease_id)
            except Exception as exc:  # the lease will expire by itself within one TTL
                _log.warning("could not revoke etcd lease: %s", exc)
        await self._reset_client()

    async def _connect(self) -> Any:
        if self._client is None:
            # Each new client dials the next endpoint: one that is down is left after a try.
            self._client = etcd_client(self._etcd, self._dials, timeout=self._timeout)
            self._dials += 1
        return self._client

    async def _reset_client(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(self._timeout):
                    await client.close()

    async def _register(self) -> None:
        client = await self._connect()
        async with asyncio.timeout(self._timeout):
            lease = await client.lease(self._ttl)
            value = (self._info.encode() if self._signer is None
                     else self._signer.encode(self._key, int(lease.id), self._info))
            await client.put(self._key, value, lease=lease)
        self._lease_id = int(lease.id)
        self.registrations += 1
        self.registered.set()
        _log.info("registered %s at %s in etcd (lease %x, ttl %ds)", self._info.node_id,
                  self._info.address, self._lease_id, self._ttl)

    async def _refresh(self) -> bool:
        """Keep the lease alive; False when etcd no longer knows it or our key is gone."""
        client = await self._connect()
        assert self._lease_id is not None
        async with asyncio.timeout(self._timeout):
            reply = await client.refresh_lease(self._lease_id)
        if reply is None or int(reply.TTL) <= 0:
            return False
        # A restored etcd (or an operator) may have dropped the key but kept the lease.
        async with asyncio.timeout(self._timeout):
            current = await client.get(self._key)
        return current is not None and int(current.lease) == self._lease_id
