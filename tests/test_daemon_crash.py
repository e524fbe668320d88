"""SIGKILL a daemon in the middle of streams of puts: after a restart no corrupt or partial block
is ever returned, and the daemon takes new writes; with its disk tier fsync'd (the default) and
without (`--disk-fsync off`, page cache only, which a killed process does not lose either)."""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import pytest

from deploy.local.daemons import start_daemon
from kvstore.errors import KVKeepError
from kvstore.keys import BlockKey
from kvstore.net.daemon_client import DaemonClient
from kvstore.net.scope import scope_of
from tests.blockframes import block_key, make_frame

T = 10.0
KILLS = 3


def frame_for(key: BlockKey, i: int) -> bytes:
    # Every third block spans two 4 MiB chunks, so kills also land between chunks of one block.
    return make_frame(key, layers=4, segment_bytes=(1536 << 10) if i % 3 == 0 else (64 << 10))


@pytest.mark.parametrize(("fsync", "kills"), [("block", KILLS), ("off", 2)])
def test_sigkill_during_puts_never_yields_partial_blocks(tmp_path: Path, fsync: str,
                                                          kills: int) -> None:
    daemon = start_daemon(tmp_path, "crashy", extra=("--disk-fsync", fsync))
    rng = random.Random(7)
    attempted: dict[BlockKey, bytes] = {}
    acked: set[BlockKey] = set()
    next_id = 0
    try:
        for _ in range(kills):
            client = daemon.client()
            stop = threading.Event()

            def writer(start: int, client: DaemonClient = client,
                       stop: threading.Event = stop) -> None:
                i = start
                while not stop.is_set():
                    batch = [block_key(i + j) for j in range(4)]
                    frames = [frame_for(k, i + j) for j, k in enumerate(batch)]
                    attempted.update(zip(batch, frames, strict=True))
                    i += len(batch)
                    try:
                        ok = client.put(scope_of(batch[0]),
                                        [(k.block_hash, f) for k, f in zip(batch, frames,
                                                                             strict=True)],
                                        timeout=T)
                    except KVKeepError:
                        return  # the daemon died under us
                    acked.update(k for k, admitted in zip(batch, ok, strict=True) if admitted)

            thread = threading.Thread(target=writer, args=(next_id,))
            thread.start()
            time.sleep(rng.uniform(0.4, 1.2))
            daemon.kill()
            stop.set()
            thread.join(30)
            next_id += 100_000
            daemon.close_clients()
            daemon.spawn()
            daemon.wait_healthy()
            _check_everything(daemon.client(), attempted)
        assert acked, "the writer never got a put acknowledged before the kills"
        # And the store takes new writes.
        client = daemon.client()
        key = block_key(999_999_999)
        assert client.put(scope_of(key), [(key.block_hash, frame_for(key, 1))], timeout=T) == [
            True]
    finally:
        daemon.close_clients()
        daemon.terminate()


def _check_everything(client: DaemonClient, attempted: dict[BlockKey, bytes]) -> None:
    found = 0
    for key, frame in attempted.items():
        read = client.get(scope_of(key), key.block_hash, timeout=T)
        if read is None:
            continue
        read.verify()
        read.verify_key(key.digest)
        assert read.to_frame() == frame, "a block came back different from what was written"
        found += 1
    assert found > 0


@pytest.mark.parametrize("fsync", [True, False])
def test_disk_fsync_and_prefault_settings_reach_their_tiers(
        tmp_path: Path, fsync: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--disk-fsync off` (DaemonConfig.disk_fsync=False) writes blocks without fdatasync;
    the default syncs each one. `--mem-prefault` allocates the RAM budget up front."""
    import os

    from kvstore.daemon.config import DaemonConfig
    from kvstore.daemon.server import open_daemon_store
    from kvstore.tiers.memory.host import HostTier
    from kvstore.tiers.nvme.tier import NvmeTier

    synced: list[int] = []
    real = os.fdatasync
    monkeypatch.setattr(os, "fdatasync", lambda fd: (synced.append(fd), real(fd))[1])
    config = DaemonConfig(listen="127.0.0.1:0", data_dir=tmp_path, mem_budget=1 << 20,
                          disk_budget=4 << 20, node_id="sync", disk_fsync=fsync,
                          mem_prefault=not fsync)
    store = open_daemon_store(config)
    try:
        host = store.tiers[0]
        assert isinstance(host, HostTier)
        assert host.allocated_bytes == (0 if fsync else 1 << 20)
        nvme = store.tiers[-1]
        assert isinstance(nvme, NvmeTier)
        key = block_key(1)
        assert nvme.put(key, make_frame(key, layers=2, segment_bytes=4096))
        read = nvme.get(key)
        assert read is not None
        read.verify()
    finally:
        store.close()
    assert bool(synced) == fsync
