"""Verify once: every read is hashed exactly once between its tier and its decoded layers, and
corruption in any tier (host pages flipped in memory, nvme files on disk, a value in Redis, a
daemon's copy) is still caught and becomes a miss (or the next tier's good copy).

Hashes are counted by wrapping `segment_checksum` where the frame and block modules call it:
a count, not a timing, so these tests say the same on any machine.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import redis

from deploy.local.daemons import DaemonProcess
from deploy.local.services import RedisServer
from kvstore import block, frame
from kvstore.block import decode_frame, decode_layer, decode_layers
from kvstore.errors import CorruptBlock
from kvstore.frame import BlockRead, FrameBytes, LayerRange
from kvstore.keys import BlockKey
from kvstore.store import StoreConfig, TieredStore
from kvstore.tiers.factory import HostSpec, RedisSpec, RemoteSpec
from kvstore.tiers.memory.host import HostTier
from kvstore.tiers.nvme.tier import NvmeTier
from kvstore.tiers.remote.tier import RemoteTier
from tests.blockframes import block_key, make_frame

LAYERS, SEGMENT = 4, 8192
NO_PROMOTION = StoreConfig(promote=False, get_deadline_s=10.0)


class HashCounter:
    def __init__(self) -> None:
        self.calls = 0
        self.bytes = 0

    def reset(self) -> None:
        self.calls = self.bytes = 0


@pytest.fixture
def hashes(monkeypatch: pytest.MonkeyPatch) -> HashCounter:
    counter = HashCounter()
    real = frame.segment_checksum

    def counting(data: FrameBytes) -> bytes:
        counter.calls += 1
        counter.bytes += len(data)
        return real(data)

    monkeypatch.setattr(frame, "segment_checksum", counting)
    monkeypatch.setattr(block, "segment_checksum", counting)
    return counter


def layer_outputs() -> list[np.ndarray]:
    # make_frame's layers are raw fp16 of shape (2, SEGMENT // 4)
    return [np.empty((2, SEGMENT // 4), np.uint16) for _ in range(LAYERS)]


def put_frames(store: TieredStore, count: int, start: int = 0) -> dict[BlockKey, bytes]:
    frames = {}
    for i in range(start, start + count):
        key = block_key(i)
        frames[key] = make_frame(key, layers=LAYERS, segment_bytes=SEGMENT)
        assert store.put(key, frames[key])
    assert store.flush(10)
    return frames


def get_and_decode(store: TieredStore, key: BlockKey, expected: bytes,
                   layers: LayerRange | None = None) -> None:
    read = store.get(key, layers)
    assert read is not None and read.verified
    outs = layer_outputs()
    want = layers or LayerRange(0, LAYERS)
    decode_layers(read, out=outs[: len(want)], key=key)
    original = BlockRead.from_frame(expected)
    for i, layer in enumerate(range(want.start, want.stop)):
        assert outs[i].tobytes() == bytes(original.segment(layer))


# -- hashed exactly once ---------------------------------------------------------------------


def test_a_host_hit_is_hashed_once_by_the_store_and_not_by_decoding(
        hashes: HashCounter) -> None:
    with TieredStore([HostTier(16 << 20)]) as store:
        frames = put_frames(store, 3)
        hashes.reset()
        for key, expected in frames.items():
            get_and_decode(store, key, expected)
        assert hashes.calls == 3 * LAYERS and hashes.bytes == 3 * LAYERS * SEGMENT
        hashes.reset()
        key, expected = next(iter(frames.items()))
        get_and_decode(store, key, expected, LayerRange(1, 3))  # a layer range: its 2 segments
        assert hashes.calls == 2


def test_an_nvme_hit_is_hashed_once_by_its_tier(tmp_path: Path, hashes: HashCounter) -> None:
    with TieredStore([NvmeTier(tmp_path / "nvme", 16 << 20)], config=NO_PROMOTION) as store:
        frames = put_frames(store, 3)
        hashes.reset()
        for key, expected in frames.items():
            get_and_decode(store, key, expected)
        assert hashes.calls == 3 * LAYERS


def test_a_promotion_reads_its_verified_source_without_hashing_it_again(
        tmp_path: Path, hashes: HashCounter) -> None:
    upper = HostTier(16 << 20, name="host")
    lower = NvmeTier(tmp_path / "nvme", 16 << 20)
    key = block_key(1)
    expected = make_frame(key, layers=LAYERS, segment_bytes=SEGMENT)
    assert lower.put(key, expected)
    with TieredStore([upper, lower], config=StoreConfig(get_deadline_s=10.0)) as store:
        hashes.reset()  # building and storing the frame hashed it
        get_and_decode(store, key, expected)  # nvme verifies; the get and decode do not
        assert store.flush(10)
        # The promotion read the block back from nvme (one more read, hashed by nvme once).
        assert hashes.calls == 2 * LAYERS
        assert upper.contains([key]) == [True]


def test_unverified_reads_are_hashed_by_decoding_once_per_segment(hashes: HashCounter) -> None:
    key = block_key(1)
    whole = make_frame(key, layers=LAYERS, segment_bytes=SEGMENT)
    hashes.reset()  # building the frame hashed it
    decode_frame(whole, key=key)
    assert hashes.calls == LAYERS
    hashes.reset()
    read = BlockRead.from_frame(whole)
    assert not read.verified
    decode_layer(read, 2, key=key)
    assert hashes.calls == 1
    hashes.reset()
    checked = read.verified_for(key.digest)
    assert checked.verified and hashes.calls == LAYERS
    hashes.reset()
    checked.verify()
    assert checked.verified_for(key.digest) is checked
    decode_layers(checked, key=key)
    assert hashes.calls == 0


def test_a_read_verified_for_one_key_is_refused_for_another() -> None:
    key, other = block_key(1), block_key(2)
    checked = BlockRead.from_frame(make_frame(key)).verified_for(key.digest)
    with pytest.raises(CorruptBlock):
        checked.verified_for(other.digest)
    with pytest.raises(CorruptBlock):
        decode_layers(checked, key=other)


def test_a_corrupt_unverified_read_is_refused_by_decoding() -> None:
    key = block_key(1)
    bad = bytearray(make_frame(key, layers=LAYERS, segment_bytes=SEGMENT))
    bad[-5] ^= 0x20  # in the last segment
    read = BlockRead.from_frame(bytes(bad))
    decode_layer(read, 0, key=key)  # the first segment is intact
    with pytest.raises(CorruptBlock):
        decode_layer(read, LAYERS - 1, key=key)
    with pytest.raises(CorruptBlock):
        read.verified_for(key.digest)


# -- corruption in every tier is still a miss ------------------------------------------------


def test_host_pages_flipped_in_memory_are_a_miss_and_the_next_tier_serves(
        tmp_path: Path) -> None:
    upper = HostTier(16 << 20, page_bytes=4096, arena_bytes=1 << 20)
    with TieredStore([upper, NvmeTier(tmp_path / "nvme", 16 << 20)],
                     config=NO_PROMOTION) as store:
        frames = put_frames(store, 2)
        (key, expected), (alone, _) = frames.items()
        for k in frames:  # white box: a bit flips in RAM, behind the tier's back
            entry = upper._index[k.digest]
            upper._page_views[entry.pages[-1]][100] ^= 0x04
        get_and_decode(store, key, expected)  # the host copy is refused, nvme's is served
        assert upper.contains([key]) == [False]  # ... and the bad one deleted
        store.tiers[1].delete([alone])
        assert store.get(alone) is None  # corrupt in RAM and gone below: a miss
        assert upper.contains([alone]) == [False]
        assert store.stats().corrupt == 2 and store.stats().misses == 1


def test_an_nvme_file_flipped_on_disk_is_a_miss(tmp_path: Path) -> None:
    with TieredStore([NvmeTier(tmp_path / "nvme", 16 << 20)], config=NO_PROMOTION) as store:
        frames = put_frames(store, 2)
        (key, _), (intact, expected) = frames.items()
        (path,) = (tmp_path / "nvme").glob(f"**/{key.digest.hex()}*")
        data = bytearray(path.read_bytes())
        data[-3] ^= 0x01
        path.write_bytes(bytes(data))
        assert store.get(key) is None
        assert store.tiers[0].contains([key]) == [False]
        get_and_decode(store, intact, expected)
        assert store.stats().corrupt == 1


def test_a_value_flipped_in_redis_is_a_miss_and_deleted(redis_server: RedisServer) -> None:
    with TieredStore.from_specs([HostSpec(16 << 20), RedisSpec(redis_server.url)],
                                config=NO_PROMOTION) as store:
        frames = put_frames(store, 2)
        (key, _), (intact, expected) = frames.items()
        store.tiers[0].delete(list(frames))  # read from redis, not from RAM
        client = redis.Redis.from_url(redis_server.url)
        (name,) = [n for n in client.keys("kvkeep:b:*") if key.digest.hex().encode() in n]
        value = bytearray(client.get(name))
        value[-1] ^= 0x80
        client.set(name, bytes(value))
        assert store.get(key) is None
        assert store.tiers[1].contains([key]) == [False]
        get_and_decode(store, intact, expected)
        assert store.stats().corrupt == 1


def remote_store(daemons: list[DaemonProcess], replicas: int) -> TieredStore:
    spec = RemoteSpec(daemons=tuple((d.node_id, d.address) for d in daemons),
                      replicas=replicas, timeout_s=5.0)
    return TieredStore.from_specs([spec], config=NO_PROMOTION)


def test_a_remote_hit_is_hashed_once_in_this_process(daemons: list[DaemonProcess],
                                                     hashes: HashCounter) -> None:
    with remote_store(daemons, replicas=2) as store:
        frames = put_frames(store, 3, start=100)
        hashes.reset()
        for key, expected in frames.items():
            get_and_decode(store, key, expected)
        assert hashes.calls == 3 * LAYERS  # the remote tier's, and nobody else's


def _corrupt_on_disk(daemon: DaemonProcess, key: BlockKey) -> None:
    """Flip a payload byte of the daemon's file of `key`; restarted, so its RAM copy is gone."""
    deadline = time.monotonic() + 10
    while not list(daemon.data_dir.glob(f"blocks/**/{key.digest.hex()}*")):
        assert time.monotonic() < deadline, "the daemon never wrote the block to disk"
        time.sleep(0.05)
    daemon.terminate()
    (path,) = daemon.data_dir.glob(f"blocks/**/{key.digest.hex()}*")
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF
    path.write_bytes(bytes(data))
    daemon.spawn()
    daemon.wait_healthy()


def test_a_corrupt_daemon_copy_is_the_other_replica_or_a_miss(
        daemons: list[DaemonProcess]) -> None:
    by_id = {d.node_id: d for d in daemons}
    with remote_store(daemons, replicas=2) as store:
        (key, expected), = put_frames(store, 1, start=200).items()
        remote = store.tiers[0]
        assert isinstance(remote, RemoteTier)
        _corrupt_on_disk(by_id[remote.placement(key)[0]], key)
        read = _get_within(store, key, 10.0)  # the restarted daemon may be skipped a while
        assert read is not None and read.to_frame() == expected  # the other replica's copy
    with remote_store(daemons, replicas=1) as store:
        (key, _), = put_frames(store, 1, start=201).items()
        remote = store.tiers[0]
        assert isinstance(remote, RemoteTier)
        _corrupt_on_disk(by_id[remote.placement(key)[0]], key)
        assert _get_within(store, key, 3.0) is None  # the only copy is bad: a miss
        assert store.lookup([key]) == 0  # and it is gone, not served later


def _get_within(store: TieredStore, key: BlockKey, seconds: float) -> BlockRead | None:
    deadline = time.monotonic() + seconds
    while True:
        read = store.get(key)
        if read is not None or time.monotonic() >= deadline:
            return read
        time.sleep(0.1)
