"""Memory under churn (issue 13 item 11): a daemon fed many times its disk's capacity of new
blocks keeps per-block state only for the blocks it still holds.

Counts of entries, not RSS or timing: the daemon's own store and core (as `kvkeep store serve`
builds them) receive a stream of new blocks far past what the disk tier holds, and every
structure that could keep something per block must stay within what the budgets allow:
the key catalog (its dict and its log on disk), the key cache, the tiers' indexes, the
write-behind's bookkeeping. `python -m benchmarks.soak` measures the RSS of a real daemon.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore.daemon.catalog import KeyCatalog
from kvstore.daemon.config import DaemonConfig
from kvstore.daemon.core import BlockServiceCore
from kvstore.daemon.server import open_daemon_store
from kvstore.keys import Namespace
from kvstore.net.scope import Scope
from kvstore.store import TieredStore
from kvstore.tiers.memory.host import HostTier
from kvstore.tiers.nvme.tier import NvmeTier
from tests.blockframes import FINGERPRINT, block_key, make_frame

SEGMENT = 16_000  # 4 layers: frames of ~64 KB
MEM, DISK = 1 << 20, 4 << 20


@pytest.fixture
def daemon_parts(tmp_path: Path) -> Iterator[tuple[TieredStore, KeyCatalog, BlockServiceCore]]:
    config = DaemonConfig(listen="127.0.0.1:0", data_dir=tmp_path, mem_budget=MEM,
                          disk_budget=DISK, node_id="churn")
    store = open_daemon_store(config)
    catalog = KeyCatalog(tmp_path / "keys.log")
    core = BlockServiceCore("churn", store, catalog, tokens=None, key_cache_limit=512)
    try:
        yield store, catalog, core
    finally:
        store.close()
        catalog.close()


def _put(core: BlockServiceCore, scope: Scope, i: int, namespace: Namespace) -> bool:
    key = block_key(i, namespace)
    frame = make_frame(key, segment_bytes=SEGMENT, seed=i)
    with core.begin_put(scope, key.block_hash, len(frame)) as incoming:
        incoming.write(0, frame)
        return incoming.commit()


@pytest.mark.parametrize("tenants", [1, 3])
def test_per_block_state_is_bounded_after_churn(
        daemon_parts: tuple[TieredStore, KeyCatalog, BlockServiceCore], tenants: int) -> None:
    store, catalog, core = daemon_parts
    host, nvme = store.tiers
    assert isinstance(host, HostTier) and isinstance(nvme, NvmeTier)
    frame_bytes = len(make_frame(block_key(0), segment_bytes=SEGMENT))
    capacity = DISK // frame_bytes  # blocks the disk tier holds
    namespaces = [Namespace(f"tenant-{t}") for t in range(tenants)]
    scopes = [Scope(FINGERPRINT.digest, ns) for ns in namespaces]
    total = 12 * capacity
    for i in range(total):
        t = i % tenants
        assert _put(core, scopes[t], i, namespaces[t])
        if i % 64 == 0:
            # Reads of recent blocks hit: the churn is not just the daemon dropping everything.
            recent = max(i - 8, 0)
            key = block_key(recent, namespaces[recent % tenants])
            block = core.open_read(key, None)
            assert block is not None
            assert block.finish()
    assert store.flush(30)
    held = nvme.stats().blocks + host.stats().blocks
    assert nvme.stats().blocks <= capacity
    # The catalog follows what the store holds, not everything it ever held ...
    assert len(catalog) <= held
    assert len(catalog) >= nvme.stats().blocks // 2  # ... and still knows what it holds
    # ... and so does its log on disk (compacted as it goes).
    log_bytes = os.path.getsize(catalog.path)
    assert log_bytes <= 8 * 100 * max(held, 1024)
    assert core.cached_keys <= 512
    assert store.pending_writes == 0
    # The tenants' byte counts are the bytes their held blocks take, not all they ever wrote.
    assert sum(catalog.tenant_bytes(ns.tenant) for ns in namespaces) <= held * frame_bytes
