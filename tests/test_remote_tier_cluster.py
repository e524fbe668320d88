"""Three real daemons registered in a real etcd, R=2: losing a node loses no block.

Write 1,000 blocks, SIGKILL one daemon: every block is still readable at once; re-replication
brings every block back to 2 copies; the killed daemon restarts, rejoins and serves its disk.
Then etcd itself is restarted under load: daemons re-register and clients recover.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from deploy.local.daemons import DaemonProcess, running_daemons
from deploy.local.services import EtcdServer
from kvstore.errors import KVKeepError
from kvstore.keys import BlockKey
from kvstore.manifest import SessionManifest
from kvstore.net.daemon_client import DaemonClient
from kvstore.net.scope import scope_of
from kvstore.tiers.remote.tier import RemoteConfig, RemoteTier
from tests.blockframes import block_key, make_frame, session_key

pytestmark = pytest.mark.slow

T = 10.0
N_BLOCKS = 1000


def wait_until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def copies(daemons: list[DaemonProcess], keys: list[BlockKey]) -> list[int]:
    """How many of `daemons` hold each key (asked directly, one batched lookup each)."""
    counts = [0] * len(keys)
    scope = scope_of(keys[0])
    for d in daemons:
        c = DaemonClient(d.node_id, d.address)
        try:
            for start in range(0, len(keys), 500):
                batch = keys[start:start + 500]
                for i, hit in enumerate(c.lookup(scope, [k.block_hash for k in batch],
                                                 timeout=T)):
                    counts[start + i] += int(hit)
        finally:
            c.close()
    return counts


def _repair_report(survivors: list[DaemonProcess], keys: list[BlockKey],
                   victim_keys: list[BlockKey]) -> str:
    """Why copies are missing: the keys short of copies (held by whom, the victim's or not),
    each survivor's Stat counters, and the end of its log (its repair passes)."""
    short = [k for k, n in zip(keys, copies(survivors, keys), strict=True) if n < 2]
    victims = {k.digest for k in victim_keys}
    lines = [f"{len(short)} keys short of copies"]
    for key in short[:10]:
        holders = [d.node_id for d in survivors if held_by(d, [key])]
        lines.append(f"  {key.block_hash.hex()[:16]}: held by {holders}, "
                     f"{'a' if key.digest in victims else 'not a'} victim's key")
    for d in survivors:
        c = DaemonClient(d.node_id, d.address)
        try:
            lines.append(f"--- {d.node_id}: {c.stat(timeout=T)}")
        finally:
            c.close()
        lines.append(d.log_text()[-4000:])
    return "\n".join(lines)


def held_by(d: DaemonProcess, keys: list[BlockKey]) -> list[BlockKey]:
    c = DaemonClient(d.node_id, d.address)
    try:
        flags = c.lookup(scope_of(keys[0]), [k.block_hash for k in keys], timeout=T)
    finally:
        c.close()
    return [k for k, hit in zip(keys, flags, strict=True) if hit]


def flushed_to_disk(d: DaemonProcess) -> bool:
    c = DaemonClient(d.node_id, d.address)
    try:
        tiers = dict(c.stat(timeout=T).tier_blocks)
    finally:
        c.close()
    return tiers.get("nvme", -1) >= tiers.get("host", 0)


def test_three_daemons_survive_a_killed_node(tmp_path: Path, etcd_server: EtcdServer) -> None:
    with running_daemons(tmp_path, 3, etcd_url=etcd_server.url) as daemons:
        tier = RemoteTier.from_etcd(etcd_server.url, RemoteConfig(replicas=2, call_timeout=2.0))
        try:
            wait_until(lambda: len(tier.members()) == 3, 10, "3 daemons in etcd")
            keys = [block_key(i) for i in range(N_BLOCKS)]
            frames = {k: make_frame(k, layers=2, segment_bytes=512) for k in keys}
            for start in range(0, N_BLOCKS, 100):
                batch = keys[start:start + 100]
                assert tier.put_many([(k, frames[k]) for k in batch]) == [True] * len(batch)
            assert copies(daemons, keys) == [2] * N_BLOCKS
            manifest = SessionManifest(session_key("cluster"), tuple(k.block_hash
                                                                     for k in keys[:8]), 128)
            tier.put_manifest(manifest)

            victim = daemons[1]
            wait_until(lambda: flushed_to_disk(victim), 20, "the victim's write-behind")
            victim_keys = held_by(victim, keys)
            assert 400 < len(victim_keys) < 950  # rendezvous spreads 2,000 copies over 3 nodes
            victim.kill()

            # Every block is readable at once: the dead daemon costs one failed call, then its
            # circuit breaker skips it (a probe now and then, with a growing cooldown).
            errors_before = tier.counters().errors
            for key in keys:
                read = tier.get(key)
                assert read is not None, key
                assert read.to_frame() == frames[key]
            assert tier.counters().errors - errors_before <= 20 < len(victim_keys)
            assert tier.contains(keys) == [True] * N_BLOCKS
            got = tier.get_manifest(manifest.key)
            assert got is not None and got.block_hashes == manifest.block_hashes

            # Its lease expires, survivors re-replicate: each block has 2 copies again.
            survivors = [daemons[0], daemons[2]]
            wait_until(lambda: len(tier.members()) == 2, 15, "the victim's lease to expire")
            try:
                wait_until(lambda: copies(survivors, keys) == [2] * N_BLOCKS, 60,
                           "re-replication to 2 copies")
            except AssertionError as exc:  # say where each survivor's repair stands
                raise AssertionError(f"{exc}; {_repair_report(survivors, keys, victim_keys)}"
                                     ) from None
            # Counted by the pushing daemon once each put returns: a moment after the copies
            # are visible to a lookup, so waited for rather than read once.
            def repaired() -> int:
                total = 0
                for d in survivors:
                    c = DaemonClient(d.node_id, d.address)
                    try:
                        total += c.stat(timeout=T).repaired_blocks
                    finally:
                        c.close()
                return total

            wait_until(lambda: repaired() >= len(victim_keys), 10, "the repairs to be counted")

            # The victim restarts on its data dir, rejoins, and serves what its disk holds.
            victim.spawn()
            victim.wait_healthy()
            wait_until(lambda: len(tier.members()) == 3, 15, "the victim to rejoin")
            assert held_by(victim, victim_keys) == victim_keys
            for key in keys[:100]:
                read = tier.get(key)
                assert read is not None and read.to_frame() == frames[key]
        finally:
            tier.close()


def test_etcd_restart_under_load(tmp_path: Path, etcd_server: EtcdServer) -> None:
    with running_daemons(tmp_path, 2, etcd_url=etcd_server.url) as daemons:
        tier = RemoteTier.from_etcd(etcd_server.url, RemoteConfig(replicas=2, call_timeout=2.0))
        try:
            wait_until(lambda: len(tier.members()) == 2, 10, "2 daemons in etcd")
            stop = threading.Event()
            errors: list[str] = []
            done: list[BlockKey] = []

            def load() -> None:
                i = 10_000
                while not stop.is_set():
                    key = block_key(i)
                    frame = make_frame(key, layers=2, segment_bytes=1024)
                    try:
                        if tier.put(key, frame):
                            read = tier.get(key)
                            if read is None or read.to_frame() != frame:
                                errors.append(f"block {i} not read back")
                            done.append(key)
                    except KVKeepError as exc:
                        errors.append(f"{i}: {exc}")
                    i += 1
                    time.sleep(0.005)

            worker = threading.Thread(target=load)
            worker.start()
            time.sleep(0.5)
            etcd_server.kill()
            time.sleep(1.5)  # the daemons' refreshes fail meanwhile; clients keep their view
            count_during = len(done)
            etcd_server.restart()
            time.sleep(0.5)
            # Both daemons re-register and the client's watch recovers.
            wait_until(lambda: len(tier.members()) == 2, 20, "re-registration after restart")
            # A change after the restart reaches the client: proof its watch is live again.
            daemons[0].terminate()
            wait_until(lambda: tier.members() == [daemons[1].node_id], 20,
                       "the client to see a deregistration after the etcd restart")
            time.sleep(0.5)
            stop.set()
            worker.join(30)
            assert not errors, errors[:5]
            assert len(done) > count_during > 0
        finally:
            tier.close()
