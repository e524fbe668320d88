"""An acknowledged put is never evicted from RAM before its copy reaches the disk.

The write-behind reads each put back from the first tier (RAM) when it gets to it. With the
disk behind and RAM full, RAM evicted its least recently used blocks, and a block still waiting
for its disk copy, made older by reads of the others, was gone before the writer came for it
(`source_gone`): a block whose put was acknowledged, lost. The store now holds such a block in
RAM (`SupportsHold`) until its copy is written. A CI run of tests/test_remote_tier_cluster.py
showed it: re-replication pushed every missing copy, each put was acknowledged, and 7 of 1,000
blocks were left with one copy.

Real tiers here (host RAM, NVMe files), with the disk's writes held at a gate.
"""

from __future__ import annotations

from pathlib import Path

from kvstore.store import StoreConfig, TieredStore
from kvstore.tiers.memory.host import HostTier
from kvstore.tiers.nvme.tier import NvmeTier
from tests.blockframes import block_key, make_frame
from tests.stalled_disk import DiskGate

T = 30.0
PAGE = 64 << 10


def test_blocks_waiting_for_the_disk_are_not_evicted_from_ram(tmp_path: Path) -> None:
    gate = DiskGate()
    ram = HostTier(8 * PAGE, page_bytes=PAGE)
    disk = NvmeTier(tmp_path / "nvme", 64 << 20, write_fn=gate.write, verify_on_put=False)
    frames = {i: make_frame(block_key(i), layers=2, segment_bytes=20_000) for i in range(24)}
    with TieredStore([ram, disk], config=StoreConfig(write_queue_depth=64, writer_threads=1,
                                                     promote=False)) as store:
        gate.open.clear()
        acknowledged = []
        for i, frame in frames.items():
            if store.put(block_key(i), frame):
                acknowledged.append(i)
            # Reads of the blocks before it make a waiting block the least recently used.
            for j in acknowledged[:-1]:
                store.get(block_key(j))
        assert len(acknowledged) > 8, "RAM never filled: the test proved nothing"
        assert store.pending_writes > 1
        gate.open.set()
        assert store.flush(T)
        lost = [i for i in acknowledged if not disk.contains([block_key(i)])[0]]
        assert lost == [], f"acknowledged, never written to disk: {lost}"
        for i in acknowledged:
            read = store.get(block_key(i))
            assert read is not None and read.to_frame() == frames[i], i
        assert store.stats().write_behind_dropped == 0
