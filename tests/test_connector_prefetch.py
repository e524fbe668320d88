"""Prefetch on the router's failover hint (connectors/vllm/prefetch.py, kvstore/cluster/hints.py).

Real parts: an etcd, a kvstore daemon, the router's own `SessionTable` over its `EtcdBackend`
writing the hint in a failover's rebinding, and the connector's `Prefetcher` over a store of a
host tier and that daemon, as a worker's connector holds it. What is checked: the moved
session's blocks end up in host RAM, byte for byte, before any request asks; hints for other
workers, forged hints (no lease, another session's key, garbage), stale hints and missing
blocks pull nothing; a salted session is found under its salt; the config refuses what cannot
work. The engine-level figures (the next turn's TTFT with and without) are benchmarks.prefetch.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from connectors.vllm.config import ConnectorConfig, PrefetchSpec
from connectors.vllm.params import namespace_for
from connectors.vllm.prefetch import Prefetcher
from connectors.vllm.stats import Count, Counts
from deploy.local.daemons import DaemonProcess
from deploy.local.services import EtcdServer
from kvstore.cluster.hints import PrefetchHint, hint_key
from kvstore.errors import ConfigError
from kvstore.etcd import EtcdSpec, etcd_client
from kvstore.frame import BlockRead, CodecId, Compression, DType, build_frame
from kvstore.keys import BlockKey, ModelFingerprint, SessionId, SessionKey
from kvstore.manifest import SessionManifest
from kvstore.store import TieredStore
from kvstore.tiers.factory import HostSpec, RemoteSpec, build_tiers
from router.membership.workers import WorkerId
from router.state.etcd import EtcdBackend
from router.state.sessions import SessionTable

FP = ModelFingerprint("test/prefetch", "w", "bfloat16", 2, 2, 32, 16, "cpu/tnhd", "raw")
TENANT = "acme"
PREFIX = "/kvkeep-prefetch"
BLOCKS = 24


def _remote(daemon: DaemonProcess) -> RemoteSpec:
    return RemoteSpec(daemons=((daemon.node_id, daemon.address),), replicas=1)


def _frame(key: BlockKey, seed: int) -> bytes:
    segment = bytes([seed % 251]) * 1024 + key.digest
    return build_frame([(segment, Compression.NONE, len(segment))] * 2, codec=CodecId.RAW,
                       dtype=DType.BFLOAT16, layout_id="cpu/tnhd", token_count=16,
                       layer_shape=(2, len(segment) // 4), key_digest=key.digest)


def _save_session(daemon: DaemonProcess, session: str, *, salt: str | None = None,
                  blocks: int = BLOCKS, listed_extra: int = 0) -> dict[BlockKey, bytes]:
    """What the session's old worker left in the daemon: its blocks and its manifest (which
    names `listed_extra` more blocks that were never stored)."""
    namespace = namespace_for(TENANT, salt)
    hashes = [f"{session}-{i}".encode().ljust(16, b".") for i in range(blocks + listed_extra)]
    frames = {BlockKey.of(FP, namespace, h): b"" for h in hashes[:blocks]}
    store = TieredStore(build_tiers([_remote(daemon)]))
    try:
        for i, key in enumerate(frames):
            frames[key] = _frame(key, i)
            assert store.put(key, frames[key])
        store.put_manifest(SessionManifest(
            key=SessionKey.of(FP, namespace, session), block_hashes=tuple(hashes),
            token_count=16 * len(hashes)))
        assert store.flush(10.0)
    finally:
        store.close()
    return frames


@pytest.fixture
def worker_store(daemon: DaemonProcess) -> Iterator[TieredStore]:
    """The new worker's connector store: host RAM above the daemon, nothing in RAM yet."""
    store = TieredStore(build_tiers([HostSpec(16 << 20), _remote(daemon)]))
    yield store
    store.close()


@pytest.fixture
def prefetcher(etcd_server: EtcdServer, worker_store: TieredStore) -> Iterator[Prefetcher]:
    prefetch = Prefetcher(store=worker_store,
                          spec=PrefetchSpec(EtcdSpec(etcd_server.url), "w1", PREFIX),
                          tenant=TENANT, manifest_fp=FP, block_fp=FP, counters=Counts())
    assert prefetch.wait_synced(10.0)
    yield prefetch
    prefetch.close()


def _counts(prefetch: Prefetcher) -> dict[str, int]:
    return dict(prefetch._counters.snapshot().as_dict())


def _wait(prefetch: Prefetcher, count: Count, value: int, timeout: float = 15.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if _counts(prefetch).get(count, 0) >= value and prefetch.idle():
            return
        time.sleep(0.02)
    raise AssertionError(f"{count} never reached {value}: {_counts(prefetch)}")


def _fail_over(etcd: EtcdServer, session: str, to: str, *, salt: str | None = None) -> None:
    """What the router replica that wins a failover writes (`Rebinder` -> `SessionTable.bind`)."""
    async def run() -> None:
        backend = EtcdBackend(etcd.url, PREFIX)
        await backend.start()
        try:
            table = SessionTable(backend, 600.0)
            won, _ = await table.bind(SessionId(session), WorkerId(to), "tiny", expected=None,
                                      reason="failover", restore_from=WorkerId("w0"),
                                      owner=TENANT, prefetch=True, salt=salt)
            assert won
        finally:
            await backend.close()
    asyncio.run(run())


def _in_host_ram(store: TieredStore, keys: list[BlockKey]) -> list[int]:
    return store.locate(keys, in_process_only=True)


def test_failover_hint_pulls_the_session_into_host_ram(
        daemon: DaemonProcess, etcd_server: EtcdServer, worker_store: TieredStore,
        prefetcher: Prefetcher) -> None:
    frames = _save_session(daemon, "s-moved")
    keys = list(frames)
    assert _in_host_ram(worker_store, keys) == [-1] * BLOCKS
    _fail_over(etcd_server, "s-moved", "w1")
    _wait(prefetcher, Count.PREFETCH_BLOCKS, BLOCKS)
    assert _in_host_ram(worker_store, keys) == [0] * BLOCKS
    for key, frame in frames.items():
        read = worker_store.get(key)
        assert read is not None
        assert bytes(read.payload) == bytes(BlockRead.from_frame(frame).payload)
    counts = _counts(prefetcher)
    assert counts.get(Count.PREFETCH_HINTS, 0) == 1 and counts.get(Count.PREFETCH_MISSING, 0) == 0


def test_only_this_workers_hints_and_a_salted_session(
        daemon: DaemonProcess, etcd_server: EtcdServer, worker_store: TieredStore,
        prefetcher: Prefetcher) -> None:
    theirs = _save_session(daemon, "s-theirs")
    salted = _save_session(daemon, "s-salted", salt="kvkeep-0123abcd")
    _fail_over(etcd_server, "s-theirs", "w2")  # another worker's hint
    _fail_over(etcd_server, "s-salted", "w1", salt="kvkeep-0123abcd")
    _wait(prefetcher, Count.PREFETCH_BLOCKS, BLOCKS)
    assert _in_host_ram(worker_store, list(salted)) == [0] * BLOCKS
    assert _in_host_ram(worker_store, list(theirs)) == [-1] * BLOCKS
    assert _counts(prefetcher).get(Count.PREFETCH_HINTS, 0) == 1


def test_forged_stale_and_missing_hints_pull_nothing(
        daemon: DaemonProcess, etcd_server: EtcdServer, worker_store: TieredStore,
        prefetcher: Prefetcher) -> None:
    victim = _save_session(daemon, "s-victim")
    _save_session(daemon, "s-gaps", blocks=4, listed_extra=6)
    hint = PrefetchHint(SessionId("s-victim"), "tiny", 3, time.time())

    async def forge() -> None:
        client = etcd_client(EtcdSpec(etcd_server.url))
        try:
            # No lease: written by hand, not by a router's transaction.
            await client.put(hint_key(PREFIX, "w1", "s-victim"), hint.to_json())
            lease = await client.lease(60)
            # Under another session's key, and not a hint at all.
            await client.put(hint_key(PREFIX, "w1", "s-other"), hint.to_json(), lease=lease)
            await client.put(hint_key(PREFIX, "w1", "s-junk"), b"[" * 5000, lease=lease)
            # Stale: a failover two hours ago.
            old = PrefetchHint(SessionId("s-victim"), "tiny", 4, time.time() - 7200)
            await client.put(hint_key(PREFIX, "w1", "s-victim"), old.to_json(), lease=lease)
        finally:
            await client.close()
    asyncio.run(forge())
    _fail_over(etcd_server, "s-gaps", "w1")  # 4 blocks stored, 6 listed but never stored
    _wait(prefetcher, Count.PREFETCH_BLOCKS, 4)
    counts = _counts(prefetcher)
    assert counts.get(Count.PREFETCH_MISSING, 0) == 6
    assert counts.get(Count.PREFETCH_SKIPPED, 0) == 1  # the stale one
    assert counts.get(Count.PREFETCH_HINTS, 0) == 1  # s-gaps only
    assert {"no-lease", "wrong-key", "malformed"} <= set(prefetcher.rejected)
    assert _in_host_ram(worker_store, list(victim)) == [-1] * BLOCKS


def test_a_dead_daemon_is_a_counted_miss(tmp_path: Path, etcd_server: EtcdServer) -> None:
    store = TieredStore(build_tiers([HostSpec(1 << 20), RemoteSpec(
        daemons=(("gone", "127.0.0.1:9"),), replicas=1, timeout_s=0.5)]))
    prefetch = Prefetcher(store=store, spec=PrefetchSpec(EtcdSpec(etcd_server.url), "w1",
                                                         PREFIX),
                          tenant=TENANT, manifest_fp=FP, block_fp=FP, counters=Counts())
    try:
        assert prefetch.wait_synced(10.0)
        _fail_over(etcd_server, "s-lost", "w1")
        _wait(prefetch, Count.PREFETCH_HINTS, 1)
        counts = _counts(prefetch)
        assert counts.get(Count.PREFETCH_MISSING, 0) + counts.get(Count.PREFETCH_ERRORS, 0) == 1
        assert counts.get(Count.PREFETCH_BLOCKS, 0) == 0
    finally:
        prefetch.close()
        store.close()


@pytest.mark.parametrize(("store", "prefetch", "message"), [
    ({"host_bytes": 1 << 20, "remote": {"daemons": {"d": "127.0.0.1:1"}}},
     {"worker_id": "w1"}, "needs store.remote with 'etcd'"),
    ({"remote": {"etcd": "http://127.0.0.1:2379"}}, {"worker_id": "w1"},
     "needs store.host_bytes or store.nvme"),
    ({"host_bytes": 1 << 20, "remote": {"etcd": "http://127.0.0.1:2379"}},
     {"worker_id": "a/b"}, "no '/'"),
    ({"host_bytes": 1 << 20, "remote": {"etcd": "http://127.0.0.1:2379"}},
     {"worker_id": "w1", "max_blocks": 0}, "max_blocks"),
])
def test_config_refuses_a_prefetch_that_cannot_work(store: dict[str, object],
                                                   prefetch: dict[str, object],
                                                   message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ConnectorConfig.from_extra({"store": store, "prefetch": prefetch})


def test_config_takes_the_etcd_of_the_remote_tier() -> None:
    config = ConnectorConfig.from_extra({
        "store": {"host_bytes": 1 << 20, "remote": {"etcd": "http://127.0.0.1:2379"}},
        "prefetch": {"worker_id": "worker-3", "prefix": "/routers"}})
    assert config.prefetch is not None
    assert config.prefetch.worker_id == "worker-3" and config.prefetch.prefix == "/routers"
    assert config.prefetch.etcd.endpoints == (("127.0.0.1", 2379),)
