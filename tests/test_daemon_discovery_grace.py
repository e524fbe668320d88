"""Daemon discovery across an etcd stall (lead's note 3, found by the chaos suite's etcd pause).

When etcd stalls past the daemons' lease TTL it expires every lease on resuming, and each live
daemon's registrar writes its key again within a moment: a client (the remote tier's
`EtcdDiscovery`, the daemon's own `MembershipWatcher`) that took those deletes, or a re-listing
made in that moment, for departures dropped every daemon at once. Real etcd (paused with
SIGSTOP), real daemons; a daemon that really leaves still leaves, after the grace.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Mapping
from pathlib import Path

from deploy.local.daemons import running_daemons
from deploy.local.processes import freeze
from deploy.local.services import EtcdServer
from kvstore.cluster.discovery import (
    DEFAULT_PREFIX,
    DaemonInfo,
    EtcdDiscovery,
    MembershipWatcher,
)
from kvstore.etcd import etcd_client

GRACE_S = 1.5
LEASE_TTL = 2


class Snapshots:
    """Every membership the discovery announced, as sets of node ids."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.seen: list[frozenset[str]] = []

    def __call__(self, members: Mapping[str, DaemonInfo]) -> None:
        with self._lock:
            self.seen.append(frozenset(members))

    def since(self, start: int) -> list[frozenset[str]]:
        with self._lock:
            return self.seen[start:]


def test_an_etcd_stall_past_the_lease_ttl_drops_no_live_daemon(
        tmp_path: Path, etcd_server: EtcdServer) -> None:
    with running_daemons(tmp_path, 2, etcd_url=etcd_server.url, lease_ttl=LEASE_TTL) as daemons:
        ids = {d.node_id for d in daemons}
        discovery = EtcdDiscovery(etcd_server.url, resync_interval=1.0,
                                  delete_grace_s=GRACE_S)
        snapshots = Snapshots()
        try:
            assert discovery.wait_for(lambda m: ids <= set(m), timeout=10)
            discovery.subscribe(snapshots)
            start = len(snapshots.since(0))
            # Past the TTL, and past a re-listing or two (resync 1 s, requests time out).
            freeze(etcd_server.proc.pid)
            try:
                time.sleep(LEASE_TTL * 2 + 0.5)
            finally:
                os.kill(etcd_server.proc.pid, signal.SIGCONT)
            time.sleep(GRACE_S + 2.0)  # the leases expire, the daemons register again
            assert discovery.members().keys() >= ids
            dropped = [s for s in snapshots.since(start) if not ids <= s]
            assert not dropped, f"live daemons dropped for a moment: {dropped}"
            # A daemon that really goes still leaves: killed (its lease expires) ...
            gone = daemons[0]
            gone.kill()
            assert discovery.wait_for(lambda m: gone.node_id not in m,
                                      timeout=LEASE_TTL + GRACE_S + 5)
            assert daemons[1].node_id in discovery.members()
        finally:
            discovery.close()


def test_a_clean_stop_leaves_after_the_grace_and_a_return_in_it_is_no_departure(
        tmp_path: Path, etcd_server: EtcdServer) -> None:
    with running_daemons(tmp_path, 2, etcd_url=etcd_server.url, lease_ttl=LEASE_TTL) as daemons:
        stays, stops = daemons
        discovery = EtcdDiscovery(etcd_server.url, delete_grace_s=GRACE_S)
        snapshots = Snapshots()
        try:
            assert discovery.wait_for(lambda m: {stays.node_id, stops.node_id} <= set(m),
                                      timeout=10)
            discovery.subscribe(snapshots)
            start = len(snapshots.since(0))
            # A key deleted and written back at once (a mass lease expiry, as the registrar
            # answers it): no departure.
            asyncio.run(_delete_and_put_back(etcd_server, DEFAULT_PREFIX + stays.node_id))
            time.sleep(0.3)  # the delete and the put have long arrived
            assert all(stays.node_id in s for s in snapshots.since(start)), snapshots.seen
            # A clean stop revokes the lease: the key is deleted for good.
            assert stops.proc is not None
            stops.proc.send_signal(signal.SIGTERM)
            deleted = asyncio.run(_until_deleted(etcd_server, DEFAULT_PREFIX + stops.node_id))
            assert stops.node_id in discovery.members()
            assert discovery.wait_for(lambda m: stops.node_id not in m, timeout=GRACE_S + 5)
            assert time.monotonic() - deleted >= GRACE_S - 0.3  # not before the grace
            stops.terminate()
            assert stays.node_id in discovery.members()
            assert all(stays.node_id in s for s in snapshots.since(start))
        finally:
            discovery.close()


async def _until_deleted(etcd: EtcdServer, key: str) -> float:
    """When `key` was first seen gone (polled every 20 ms)."""
    client = etcd_client(etcd.url, timeout=5)
    try:
        end = time.monotonic() + 30
        while await client.get(key.encode()) is not None:
            assert time.monotonic() < end, f"{key} never deleted"
            await asyncio.sleep(0.02)
        return time.monotonic()
    finally:
        await client.close()


async def _delete_and_put_back(etcd: EtcdServer, key: str) -> None:
    client = etcd_client(etcd.url, timeout=5)
    try:
        found = await client.get(key.encode())
        assert found is not None
        await client.delete(key.encode())
        await client.put(key.encode(), bytes(found.value), lease=int(found.lease))
    finally:
        await client.close()


def test_a_relisting_without_a_member_keeps_it_for_the_grace(etcd_server: EtcdServer) -> None:
    """A re-listing (after a broken watch, or the periodic one) that misses a key is a delete
    too: the member stays for the grace and goes only if the key stays away. Registrations
    written by hand (loopback addresses: trusted without proof), listings made on cue."""
    a = DaemonInfo("a", "127.0.0.1:1", 1.0)
    b = DaemonInfo("b", "127.0.0.1:2", 1.0)
    grace = 0.5

    async def main() -> None:
        client = etcd_client(etcd_server.url, timeout=5)
        watcher = MembershipWatcher(etcd_server.url, delete_grace_s=grace)
        try:
            lease = await client.lease(60)  # lease-less registrations are not believed
            for info in (a, b):
                await client.put(f"{DEFAULT_PREFIX}{info.node_id}".encode(), info.encode(),
                                 lease=lease)
            await watcher._relist(client)
            assert set(watcher.members()) == {"a", "b"}
            await client.delete(f"{DEFAULT_PREFIX}b".encode())
            await watcher._relist(client)
            assert set(watcher.members()) == {"a", "b"}  # in its grace
            await client.put(f"{DEFAULT_PREFIX}b".encode(), b.encode(), lease=lease)
            await watcher._relist(client)  # back in time
            await asyncio.sleep(grace + 0.3)
            assert set(watcher.members()) == {"a", "b"}
            await client.delete(f"{DEFAULT_PREFIX}b".encode())
            await watcher._relist(client)
            await asyncio.sleep(grace + 0.3)
            assert set(watcher.members()) == {"a"}  # stayed away: gone
            # An untrusted value in its place is no departure to wait for.
            await client.put(f"{DEFAULT_PREFIX}a".encode(),
                             DaemonInfo("a", "10.9.9.9:1", 1.0).encode(), lease=lease)
            await watcher._relist(client)
            assert watcher.members() == {}
        finally:
            await client.close()

    asyncio.run(main())
