"""The daemon's registration in etcd: `<prefix><node_id>` -> its `DaemonInfo`, under a lease
that the control plane's lease keeper (kvstore/cluster/lease.py) refreshes every TTL/3.

The keeper also reads the key back on every refresh: a restored etcd (or an operator) that
dropped the key while the lease lived, or anyone who overwrote it with another value, finds it
written back under the daemon's own lease. When the lease itself is gone (etcd restarted and
lost it, or a long pause let it expire) it grants a new one and registers again, backing off
until etcd answers: clients may briefly see the daemon disappear while etcd is down, never a
stale address. On a clean stop the lease is revoked, so clients see the daemon leave at once
instead of after a TTL.

With a `RegistrationSigner` the value is signed over the key, the lease and every field
(kvstore/cluster/daemon_trust.py): the keeper grants the lease first, then puts the signed value.
"""

from __future__ import annotations

import asyncio
import logging

from kvstore.cluster.clients import StickyClients
from kvstore.cluster.daemon_trust import RegistrationSigner
from kvstore.cluster.discovery import DEFAULT_PREFIX, DaemonInfo
from kvstore.cluster.lease import LeaseKeeper
from kvstore.etcd import EtcdSpec

__all__ = ["Registrar"]

_log = logging.getLogger(__name__)


class Registrar:
    """Keeps `<prefix><node_id>` -> DaemonInfo registered while `run()` runs."""

    def __init__(self, etcd: EtcdSpec | str, info: DaemonInfo, *, prefix: str = DEFAULT_PREFIX,
                 ttl: int = 5, request_timeout: float = 2.0,
                 signer: RegistrationSigner | None = None) -> None:
        self._info = info
        self._timeout = request_timeout
        self._clients = StickyClients(etcd, request_timeout)
        key = f"{prefix}{info.node_id}".encode()
        self._keeper = LeaseKeeper(
            key, (lambda _lease: info.encode()) if signer is None
            else (lambda lease: signer.encode(key, lease, info)),
            max(int(ttl), 1), timeout=request_timeout, what="daemon registration")

    @property
    def key(self) -> bytes:
        return self._keeper.key

    @property
    def registered(self) -> asyncio.Event:
        return self._keeper.registered

    @property
    def registrations(self) -> int:
        """How many times the key was registered under a new lease: 1 normally, more after
        etcd trouble."""
        return self._keeper.registrations

    @property
    def rewrites(self) -> int:
        """How many times the key was found changed or gone under a live lease and rewritten."""
        return self._keeper.rewrites

    async def run(self) -> None:
        """Register, then refresh every TTL/3 until cancelled; re-register after any failure."""
        await self._keeper.run(self._clients)

    async def deregister(self) -> None:
        """Revoke the lease (deleting the key with it); best effort, bounded by the timeout."""
        if self._keeper.lease_id is not None:
            try:
                await self._keeper.revoke(await self._clients.acquire())
            except Exception as exc:  # the lease will expire by itself within one TTL
                _log.warning("could not revoke etcd lease: %s", exc)
        self._keeper.forget()
        await self._clients.close()
