"""The redis tier against a real redis-server: round trips, chunking, ranges, limits, failures."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis

from deploy.local.services import RedisServer, start_redis
from kvstore.errors import InvalidFrame, TierUnavailable
from kvstore.frame import BlockRead, FrameHeader, LayerRange
from kvstore.manifest import SessionManifest
from kvstore.store import TieredStore
from kvstore.tiers.base import Tier
from kvstore.tiers.memory.host import HostTier
from kvstore.tiers.redis import RedisConfig, RedisTier
from tests.blockframes import block_key, corrupt, make_frame, session_key

CHUNK = 256 << 10


@pytest.fixture
def tier(redis_server: RedisServer) -> RedisTier:
    t = RedisTier(RedisConfig(url=redis_server.url, chunk_bytes=CHUNK))
    yield t  # type: ignore[misc]
    t.close()


def test_it_is_a_tier(tier: RedisTier) -> None:
    assert isinstance(tier, Tier)


@pytest.mark.parametrize("segment_bytes", [1000, 200_000])  # one value / chunked (~800 KB)
def test_round_trip_whole_and_ranges(tier: RedisTier, segment_bytes: int) -> None:
    key = block_key(segment_bytes)
    frame = make_frame(key, layers=4, segment_bytes=segment_bytes)
    assert tier.contains([key]) == [False]
    assert tier.put(key, frame)
    assert tier.put(key, frame)  # idempotent
    assert tier.contains([key, block_key(1)]) == [True, False]
    read = tier.get(key)
    assert read is not None
    read.verify()
    read.verify_key(key.digest)
    assert read.to_frame() == frame
    out = bytearray(len(frame))
    read = tier.get(key, out=out)
    assert read is not None and read.to_frame() == frame
    header = FrameHeader.unpack(frame)
    for layers in (LayerRange(0, 1), LayerRange(1, 3), LayerRange(3, 4)):
        part = tier.get(key, layers)
        assert part is not None and part.layers == layers
        part.verify()
        start, stop = header.span(layers)
        assert bytes(part.payload) == frame[start:stop]
        into = bytearray(stop - start + 7)
        part = tier.get(key, layers, out=into)
        assert part is not None and bytes(part.payload) == frame[start:stop]
    assert tier.delete([key, block_key(2)]) == 1
    assert tier.get(key) is None
    assert tier.get(key, LayerRange(0, 1)) is None


def test_chunks_are_deleted_with_their_block(tier: RedisTier, redis_server: RedisServer) -> None:
    key = block_key(7)
    tier.put(key, make_frame(key, layers=4, segment_bytes=300_000))
    r = redis.Redis.from_url(redis_server.url)
    assert len(r.keys("kvkeep:b:*")) == 1 + 5  # index + ceil(1.2 MB / 256 KiB) chunks
    tier.delete([key])
    assert r.keys("kvkeep:*") == []


def test_an_evicted_chunk_makes_a_miss_not_a_partial_block(tier: RedisTier,
                                                          redis_server: RedisServer) -> None:
    key = block_key(8)
    tier.put(key, make_frame(key, layers=4, segment_bytes=300_000))
    r = redis.Redis.from_url(redis_server.url)
    chunk = sorted(k for k in r.keys("kvkeep:b:*") if k.count(b":") == 4)[2]
    r.delete(chunk)
    assert tier.get(key) is None
    assert r.keys("kvkeep:*") == []  # the leftovers are gone too


def test_bad_frames_are_refused(tier: RedisTier) -> None:
    key = block_key(9)
    with pytest.raises(InvalidFrame):
        tier.put(key, make_frame(block_key(10)))
    with pytest.raises(InvalidFrame):
        tier.put(key, b"not a frame at all")
    # A corrupt payload is stored as given (the header parses); the reader's verify catches it.
    tier.put(key, corrupt(make_frame(key)))
    read = tier.get(key)
    assert read is not None
    with pytest.raises(Exception, match="checksum"):
        read.verify()


def test_manifests_keep_the_newest_generation(tier: RedisTier) -> None:
    key = session_key("redis-1")
    tier.put_manifest(SessionManifest(key, (b"a",), 16, generation=5))
    tier.put_manifest(SessionManifest(key, (b"b",), 32, generation=4))
    got = tier.get_manifest(key)
    assert got is not None and got.generation == 5 and got.block_hashes == (b"a",)
    tier.put_manifest(SessionManifest(key, (b"c",), 48, generation=6))
    assert tier.get_manifest(key).generation == 6  # type: ignore[union-attr]
    assert tier.delete_manifest(key)
    assert tier.get_manifest(key) is None


def test_full_redis_rejects_puts_and_keeps_serving(tmp_path: Path) -> None:
    with start_redis(tmp_path, maxmemory="3mb") as server:
        tier = RedisTier(RedisConfig(url=server.url, chunk_bytes=CHUNK))
        keys = [block_key(100 + i) for i in range(40)]
        results = [tier.put(k, make_frame(k, layers=2, segment_bytes=100_000)) for k in keys]
        assert results[0] and not all(results)
        first = tier.get(keys[0])
        assert first is not None and first.to_frame() == make_frame(keys[0], layers=2,
                                                                    segment_bytes=100_000)
        tier.close()


def test_redis_down_is_unavailable(tmp_path: Path) -> None:
    with start_redis(tmp_path) as server:
        tier = RedisTier(RedisConfig(url=server.url, socket_timeout=0.5))
        server.proc.kill()
        server.proc.wait()
        with pytest.raises(TierUnavailable):
            tier.get(block_key(1))
        with pytest.raises(TierUnavailable):
            tier.put(block_key(1), make_frame(block_key(1)))
        tier.close()


def test_behind_a_tiered_store(redis_server: RedisServer) -> None:
    redis_tier = RedisTier(RedisConfig(url=redis_server.url, chunk_bytes=CHUNK))
    with TieredStore([HostTier(8 << 20), redis_tier]) as store:
        keys = [block_key(200 + i) for i in range(8)]
        frames = {k: make_frame(k, layers=4, segment_bytes=100_000) for k in keys}
        for k, f in frames.items():
            assert store.put(k, f)
        assert store.flush(10)
        assert redis_tier.contains(keys) == [True] * len(keys)  # written behind
        store.tiers[0].delete(keys)  # reads now come from redis
        for k, f in frames.items():
            read = store.get(k, deadline=None)
            assert read is not None and read.to_frame() == f
        part = store.get(keys[0], LayerRange(2, 4))
        assert part is not None
        assert bytes(part.payload) == bytes(BlockRead.from_frame(frames[keys[0]],
                                                                 LayerRange(2, 4)).payload)
