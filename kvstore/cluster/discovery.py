"""Which kvstore daemons exist: static lists, or a live view of an etcd prefix.

Each daemon registers `<prefix><node_id>` -> JSON `DaemonInfo` under a lease it refreshes
(kvstore/daemon/registration.py); the key vanishes when the daemon stops or its lease expires.
`MembershipWatcher` keeps a snapshot of the prefix by listing it and then watching from the
listed revision; after any error (etcd restarted, connection reset) it lists again, so a missed
event can never leave a stale view for longer than one reconnect. It also re-lists every
`resync_interval` seconds as a safety net against a silently stuck watch stream.

`EtcdDiscovery` runs a watcher on its own thread and event loop for synchronous callers (the
remote tier); the daemon runs a `MembershipWatcher` directly in its own loop.

A registration is a claim: each one passes the watcher's `DaemonTrust` (signed, or dialled
over mTLS, or loopback; kvstore/cluster/daemon_trust.py) before it becomes a member. What fails
is ignored, logged once and counted by reason (`rejected`); a trusted daemon whose key is
overwritten by an untrusted value leaves the membership until it registers again. Whatever the
proof, a registration must be attached to a lease ("no-lease" otherwise), and one address is
one daemon ("duplicate": the older registration wins; kvstore/cluster/daemon_trust.py says why).
No value, however malformed, can stop the watch (kvstore/cluster/watcher.py).

A daemon whose key vanishes (a delete, or a re-listing without it) leaves only if its key has
not come back within `delete_grace_s`. When etcd stalls (paused, a slow disk, an election) past
the daemons' lease TTL, it expires every lease at once on resuming, and each live daemon's
registrar writes its key again as soon as it notices (at most TTL/3 later): acting on those
deletes dropped every daemon from every client for that moment (puts and reads missed, the
daemon's own re-replication saw its peers go). The router's worker registry does the same
(router/state/etcd.py). A daemon that is really gone leaves this much after its lease: its
calls fail meanwhile, which the remote tier's breakers and fallbacks handle anyway. An untrusted
value replacing a registration is not a departure to wait for: that member goes at once.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from kvstore.cluster.clients import FreshClients
from kvstore.cluster.daemon_info import DaemonInfo
from kvstore.cluster.daemon_trust import DaemonTrust, identities
from kvstore.cluster.records import EtcdRecord
from kvstore.cluster.watcher import PrefixWatcher, ThreadedWatch
from kvstore.etcd import EtcdSpec

__all__ = [
    "DEFAULT_PREFIX",
    "DELETE_GRACE_S",
    "DaemonInfo",
    "Discovery",
    "StaticDiscovery",
    "MembershipWatcher",
    "EtcdDiscovery",
    "parse_etcd_endpoints",
    "Listener",
    "DaemonTrust",
]

DEFAULT_PREFIX = "/kvkeep/stores/"
_log = logging.getLogger(__name__)

DELETE_GRACE_S = 2.0
"""How long a vanished registration may take to come back before its daemon leaves: longer than
a registrar takes to notice a lost lease and register again (TTL/3: 1.7 s at the daemon's
default TTL of 5 s), much shorter than a TTL."""

Listener = Callable[[Mapping[str, "DaemonInfo"]], None]
"""Called with the full new membership after every change (from the discovery's own thread)."""


class Discovery(Protocol):
    """A live view of the daemons; the remote tier asks it, and listens to it."""

    def members(self) -> dict[str, DaemonInfo]: ...

    def subscribe(self, listener: Listener) -> None: ...

    def close(self) -> None: ...


class StaticDiscovery:
    """A fixed set of daemons (benchmarks, tests, single-node setups without etcd)."""

    def __init__(self, daemons: Sequence[DaemonInfo]) -> None:
        self._members = {d.node_id: d for d in daemons}

    def members(self) -> dict[str, DaemonInfo]:
        return dict(self._members)

    def subscribe(self, listener: Listener) -> None:
        listener(self.members())

    def close(self) -> None:
        pass


def parse_etcd_endpoints(url: str) -> list[tuple[str, int]]:
    """`http://h1:2379,http://h2:2379` -> [(h1, 2379), (h2, 2379)] (see `EtcdSpec`)."""
    return list(EtcdSpec(url).endpoints)


class MembershipWatcher:
    """Keeps `members` equal to the daemons registered under `prefix` (asyncio, one loop): a
    `PrefixWatcher` (kvstore/cluster/watcher.py) whose decoder is the trust check, with leases
    required, one daemon per address and the delete grace."""

    def __init__(self, etcd: EtcdSpec | str, prefix: str = DEFAULT_PREFIX, *,
                 trust: DaemonTrust | None = None, resync_interval: float = 5.0,
                 request_timeout: float = 2.0,
                 delete_grace_s: float = DELETE_GRACE_S,
                 on_reject: Callable[[str], None] | None = None) -> None:
        self._trust = trust if trust is not None else DaemonTrust()
        self._prefix = prefix.encode()
        self._members: dict[str, DaemonInfo] = {}
        self._listeners: list[Listener] = []
        self._lock = threading.Lock()  # members are read from other threads
        self._watcher: PrefixWatcher[DaemonInfo] = PrefixWatcher(
            FreshClients(etcd, request_timeout), self._prefix, self._decode, self,
            what="daemon registration", require_lease=True, grace_s=delete_grace_s,
            resync_s=resync_interval, exclusive=identities, timeout=request_timeout,
            on_reject=on_reject)

    @property
    def rejected(self) -> Counter[str]:
        """Registrations ignored, by reason (each key and revision counted once)."""
        return self._watcher.rejected

    @property
    def synced(self) -> asyncio.Event:
        """Set once the first listing succeeded."""
        return self._watcher.synced

    @property
    def trust(self) -> DaemonTrust:
        return self._trust

    def members(self) -> dict[str, DaemonInfo]:
        with self._lock:
            return dict(self._members)

    def subscribe(self, listener: Listener) -> None:
        with self._lock:
            self._listeners.append(listener)

    async def run(self) -> None:
        """List and watch forever (cancel to stop); errors only cause a reconnect."""
        await self._watcher.run()

    async def _relist(self, client: Any) -> int:
        """One listing now (tests drive the grace with it)."""
        return await self._watcher._relist(client)

    def _decode(self, record: EtcdRecord) -> DaemonInfo:
        return self._trust.admit(self._prefix, record.key, record.value, record.lease)

    # --- the watcher's sink ----------------------------------------------------------------
    def reset(self, items: Mapping[str, DaemonInfo]) -> None:
        def replace(members: dict[str, DaemonInfo]) -> None:
            members.clear()
            members.update(items)
        self._update(replace)

    def put(self, name: str, item: DaemonInfo) -> None:
        self._update(lambda members: members.__setitem__(name, item))

    def delete(self, name: str, revision: int) -> None:
        self._update(lambda members: members.pop(name, None))

    def _update(self, change: Callable[[dict[str, DaemonInfo]], object]) -> None:
        with self._lock:
            before = dict(self._members)
            change(self._members)
            if before == self._members:
                return
            snapshot, listeners = dict(self._members), list(self._listeners)
        for listener in listeners:
            try:
                listener(snapshot)
            except Exception:  # a listener's bug must not stop discovery
                _log.exception("membership listener failed")


class EtcdDiscovery:
    """`MembershipWatcher` on a background thread, for synchronous users (the remote tier)."""

    def __init__(self, etcd: EtcdSpec | str, prefix: str = DEFAULT_PREFIX, *,
                 trust: DaemonTrust | None = None, resync_interval: float = 5.0,
                 wait_synced: float = 5.0, delete_grace_s: float = DELETE_GRACE_S,
                 on_reject: Callable[[str], None] | None = None) -> None:
        """`on_reject(reason)`: called (on the discovery's thread) for each registration
        ignored, to count it in the caller's metrics."""
        self._watcher = MembershipWatcher(etcd, prefix, trust=trust,
                                          resync_interval=resync_interval,
                                          delete_grace_s=delete_grace_s, on_reject=on_reject)
        self._thread = ThreadedWatch(self._watcher, "kvkeep-discovery")
        if wait_synced > 0:
            self.wait_synced(wait_synced)

    def members(self) -> dict[str, DaemonInfo]:
        return self._watcher.members()

    @property
    def rejected(self) -> dict[str, int]:
        """Registrations ignored as untrusted, by reason (see `MembershipWatcher.rejected`)."""
        return dict(self._watcher.rejected)

    def subscribe(self, listener: Listener) -> None:
        self._watcher.subscribe(listener)
        listener(self._watcher.members())

    def wait_synced(self, timeout: float) -> bool:
        """Wait until the first listing arrived; False if etcd did not answer in time."""
        if self._thread.wait_synced(timeout):
            return True
        _log.warning("etcd discovery not synced after %.1fs; starting with no daemons", timeout)
        return False

    def wait_for(self, predicate: Callable[[Mapping[str, DaemonInfo]], bool],
                 timeout: float) -> bool:
        """Poll until `predicate(members)` holds (tests, start-up ordering)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if predicate(self.members()):
                return True
            time.sleep(0.02)
        return predicate(self.members())

    def close(self) -> None:
        self._thread.close()
