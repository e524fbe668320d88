"""The hbm tier: a clear ConfigError without CUDA; round trips, layer ranges, eviction and a
store on top of it where CUDA exists (gpu-marked, skipped elsewhere)."""

from __future__ import annotations

import pytest

from kvstore.errors import ConfigError
from kvstore.frame import FrameHeader, LayerRange
from kvstore.store import TieredStore
from kvstore.tiers.base import Tier
from kvstore.tiers.memory.hbm import HbmTier, cuda_available
from kvstore.tiers.memory.host import HostTier
from tests.blockframes import block_key, make_frame

MiB = 1 << 20


@pytest.mark.skipif(cuda_available(), reason="checks the CPU-only behaviour")
def test_without_cuda_construction_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="CUDA"):
        HbmTier(64 * MiB)


@pytest.mark.gpu
def test_round_trip_and_layer_range_on_device() -> None:
    tier = HbmTier(8 * MiB, page_bytes=4096, arena_bytes=MiB)
    try:
        assert isinstance(tier, Tier)
        key = block_key(1)
        frame = make_frame(key, segment_bytes=10_000)
        assert tier.put(key, frame)
        read = tier.get(key)
        assert read is not None and read.to_frame() == frame
        layers = LayerRange(1, 3)
        start, stop = FrameHeader.unpack(frame).span(layers)
        out = bytearray(b"\xaa" * len(frame))
        part = tier.get(key, layers, out=out)
        assert part is not None
        part.verify()
        assert out[: stop - start] == frame[start:stop]
        assert out[stop - start:] == b"\xaa" * (len(frame) - (stop - start))
    finally:
        tier.close()


@pytest.mark.gpu
def test_device_budget_evicts_lru() -> None:
    frame_bytes = len(make_frame(block_key(0), segment_bytes=65536))
    tier = HbmTier(3 * frame_bytes + 3 * 4096, page_bytes=4096, arena_bytes=MiB)
    try:
        keys = [block_key(i) for i in range(5)]
        for key in keys:
            assert tier.put(key, make_frame(key, segment_bytes=65536))
        assert tier.contains(keys) == [False, False, True, True, True]
        assert tier.stats().bytes_used <= tier.stats().bytes_budget
        arenas = tier.arena_allocations
        for key in keys:
            tier.put(key, make_frame(key, segment_bytes=65536))
        assert tier.arena_allocations == arenas
    finally:
        tier.close()


@pytest.mark.gpu
def test_store_over_hbm_and_host() -> None:
    hbm = HbmTier(4 * MiB, page_bytes=65536, arena_bytes=MiB)
    host = HostTier(16 * MiB)
    store = TieredStore([hbm, host])
    try:
        key = block_key(1)
        frame = make_frame(key, segment_bytes=65536)
        assert store.put(key, frame)
        assert store.flush(10)
        assert host.contains([key]) == [True]
        hbm.delete([key])
        read = store.get(key)
        assert read is not None and read.to_frame() == frame
        assert store.flush(10)
        assert hbm.contains([key]) == [True]  # promoted back onto the device
    finally:
        store.close()
