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
over mTLS, or loopback; kvstore/tiers/daemon_trust.py) before it becomes a member. What fails
is ignored, logged once and counted by reason (`rejected`); a trusted daemon whose key is
overwritten by an untrusted value leaves the membership until it registers again.

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
import contextlib
import logging
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from kvstore.errors import UntrustedRegistration
from kvstore.etcd import EtcdSpec, etcd_client, etcd_spec
from kvstore.tiers.daemon_info import DaemonInfo
from kvstore.tiers.daemon_trust import DaemonTrust

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

_END = object()  # the watch stream ended
_REMEMBERED_REJECTIONS = 1024  # (key, revision) pairs already counted and logged

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
    """Keeps `members` equal to the daemons registered under `prefix` (asyncio, one loop)."""

    def __init__(self, etcd: EtcdSpec | str, prefix: str = DEFAULT_PREFIX, *,
                 trust: DaemonTrust | None = None, resync_interval: float = 5.0,
                 request_timeout: float = 2.0,
                 delete_grace_s: float = DELETE_GRACE_S) -> None:
        self._etcd = etcd_spec(etcd)
        self._grace = delete_grace_s
        # Members whose key vanished, until their grace ends (touched on the loop only).
        self._leaving: dict[str, asyncio.TimerHandle] = {}
        self._trust = trust if trust is not None else DaemonTrust()
        self.rejected: Counter[str] = Counter()
        """Registrations ignored, by reason (each key and revision counted once)."""
        self._counted: OrderedDict[tuple[bytes, int], None] = OrderedDict()
        self._prefix = prefix.encode()
        self._resync = resync_interval
        self._timeout = request_timeout
        self._members: dict[str, DaemonInfo] = {}
        self._listeners: list[Listener] = []
        self._lock = threading.Lock()  # members are read from other threads
        self.synced = asyncio.Event()
        """Set once the first listing succeeded."""

    def members(self) -> dict[str, DaemonInfo]:
        with self._lock:
            return dict(self._members)

    def subscribe(self, listener: Listener) -> None:
        with self._lock:
            self._listeners.append(listener)

    async def run(self) -> None:
        """List and watch forever (cancel to stop); errors only cause a reconnect."""
        try:
            await self._run()
        finally:
            for timer in self._leaving.values():
                timer.cancel()
            self._leaving.clear()

    async def _run(self) -> None:
        attempt = 0
        while True:
            client = etcd_client(self._etcd, attempt, timeout=self._timeout)
            try:
                await self._list_and_watch(client)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # aetcd raises its own tree and raw grpc errors alike
                _log.info("etcd membership watch on %s broke (%s); re-listing", client.target,
                          exc)
            finally:
                with contextlib.suppress(Exception):
                    async with asyncio.timeout(self._timeout):
                        await client.close()
            attempt += 1
            await asyncio.sleep(min(0.1 * attempt, 1.0))

    async def _list_and_watch(self, client: Any) -> None:
        revision = await self._relist(client)
        watch = await client.watch_prefix(self._prefix, start_revision=revision + 1)
        # A pump task moves events into a queue, so that waiting for the next event can time
        # out (to re-list) without cancelling, and so closing, aetcd's event iterator.
        events: asyncio.Queue[Any] = asyncio.Queue()

        async def pump() -> None:
            try:
                async for event in watch:
                    events.put_nowait(event)
                events.put_nowait(_END)
            except Exception as exc:  # the watch broke: hand the error to the reader
                events.put_nowait(exc)

        pumper = asyncio.create_task(pump())
        try:
            while True:
                try:
                    # asyncio.timeout, not wait_for (which can swallow a cancellation on 3.11).
                    async with asyncio.timeout(self._resync):
                        event = await events.get()
                except TimeoutError:
                    revision = await self._relist(client)
                    continue
                if event is _END:
                    return
                if isinstance(event, Exception):
                    raise event
                if event.kv.mod_revision <= revision:
                    continue  # already in the listing
                revision = event.kv.mod_revision
                node_id = event.kv.key[len(self._prefix):].decode(errors="replace")
                if event.kind != "PUT":
                    if not self._defer_departure(node_id):
                        self._update(_remover(node_id))
                elif (info := self._admit(event.kv)) is not None:
                    self._cancel_departure(info.node_id)
                    self._update(_setter(info))
                else:  # an untrusted value replacing a member's registration: gone at once
                    self._cancel_departure(node_id)
                    self._update(_remover(node_id))
        finally:
            pumper.cancel()
            with contextlib.suppress(Exception):
                async with asyncio.timeout(self._timeout):
                    await watch.cancel()

    async def _relist(self, client: Any) -> int:
        listing = await client.get_prefix(self._prefix)
        members: dict[str, DaemonInfo] = {}
        listed: set[str] = set()  # node ids with a key, trusted or not
        for kv in listing:
            listed.add(bytes(kv.key)[len(self._prefix):].decode(errors="replace"))
            info = self._admit(kv)
            if info is not None:
                members[info.node_id] = info
                self._cancel_departure(info.node_id)
        for node_id, info in self.members().items():
            if node_id not in listed and self._defer_departure(node_id):
                members[node_id] = info  # absent from this listing: leaves after the grace
        self._update(_replacer(members))
        self.synced.set()
        return int(listing.header.revision)

    @property
    def trust(self) -> DaemonTrust:
        return self._trust

    def _admit(self, kv: Any) -> DaemonInfo | None:
        """The daemon `kv` registers, if it proves to be one; else None (counted, logged)."""
        try:
            return self._trust.admit(self._prefix, bytes(kv.key), bytes(kv.value),
                                     int(kv.lease))
        except UntrustedRegistration as exc:
            mark = (bytes(kv.key), int(kv.mod_revision))
            with self._lock:
                if mark in self._counted:  # seen before (a re-list): no second count
                    return None
                self._counted[mark] = None
                if len(self._counted) > _REMEMBERED_REJECTIONS:
                    self._counted.popitem(last=False)
                self.rejected[exc.reason] += 1
            _log.warning("ignoring registration %r: %s", mark[0], exc)
            return None

    def _defer_departure(self, node_id: str) -> bool:
        """Start (or keep running) the grace of a member whose key vanished; False when it is
        no member or there is no grace (then it goes now). On the loop."""
        if self._grace <= 0:
            return False
        with self._lock:
            if node_id not in self._members:
                return False
        if node_id not in self._leaving:
            self._leaving[node_id] = asyncio.get_running_loop().call_later(
                self._grace, self._depart, node_id)
        return True

    def _cancel_departure(self, node_id: str) -> None:
        """Its key is back (or replaced): no departure pending any more."""
        if (timer := self._leaving.pop(node_id, None)) is not None:
            timer.cancel()

    def _depart(self, node_id: str) -> None:
        """The grace ran out without the key coming back."""
        self._leaving.pop(node_id, None)
        self._update(_remover(node_id))

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


def _setter(info: DaemonInfo) -> Callable[[dict[str, DaemonInfo]], None]:
    def change(members: dict[str, DaemonInfo]) -> None:
        members[info.node_id] = info
    return change


def _remover(node_id: str) -> Callable[[dict[str, DaemonInfo]], None]:
    def change(members: dict[str, DaemonInfo]) -> None:
        members.pop(node_id, None)
    return change


def _replacer(new: dict[str, DaemonInfo]) -> Callable[[dict[str, DaemonInfo]], None]:
    def change(members: dict[str, DaemonInfo]) -> None:
        members.clear()
        members.update(new)
    return change


class EtcdDiscovery:
    """`MembershipWatcher` on a background thread, for synchronous users (the remote tier)."""

    def __init__(self, etcd: EtcdSpec | str, prefix: str = DEFAULT_PREFIX, *,
                 trust: DaemonTrust | None = None, resync_interval: float = 5.0,
                 wait_synced: float = 5.0, delete_grace_s: float = DELETE_GRACE_S) -> None:
        self._watcher = MembershipWatcher(etcd, prefix, trust=trust,
                                          resync_interval=resync_interval,
                                          delete_grace_s=delete_grace_s)
        self._loop = asyncio.new_event_loop()
        self._task: asyncio.Task[None] | None = None
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._main, name="kvkeep-discovery", daemon=True)
        self._thread.start()
        self._started.wait()
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
        future = asyncio.run_coroutine_threadsafe(self._wait_synced(timeout), self._loop)
        try:
            future.result(timeout + 1.0)
        except TimeoutError:
            _log.warning("etcd discovery not synced after %.1fs; starting with no daemons",
                         timeout)
            return False
        return True

    async def _wait_synced(self, timeout: float) -> None:
        async with asyncio.timeout(timeout):
            await self._watcher.synced.wait()

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
        if self._task is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._task.cancel)
        self._thread.join(5.0)

    def _main(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._task = self._loop.create_task(self._watcher.run())
        self._started.set()
        with contextlib.suppress(asyncio.CancelledError):
            self._loop.run_until_complete(self._task)
        self._loop.close()
