"""The host-RAM tier: round trips, layer ranges, budget and LRU, pinning, slab reuse, manifests."""

from __future__ import annotations

import threading
import time
import tracemalloc
from collections.abc import Sequence

import pytest

from kvstore.errors import DeadlineExceeded, InvalidFrame, TierError, TierUnavailable
from kvstore.frame import BlockRead, FrameHeader, LayerRange
from kvstore.keys import BlockKey
from kvstore.manifest import SessionManifest
from kvstore.tiers.base import Tier
from kvstore.tiers.memory.host import HostTier
from tests.blockframes import block_key, make_frame, session_key

PAGE = 1024
# A 4-layer frame of 1 KiB segments plus its header: 5 pages of 1 KiB.
PAGES_PER_BLOCK = 5


def small_tier(blocks: int, **kwargs: object) -> HostTier:
    """A tier whose budget holds exactly `blocks` test frames, with 1 KiB pages, 8 KiB arenas."""
    return HostTier(blocks * PAGES_PER_BLOCK * PAGE, page_bytes=PAGE, arena_bytes=8 * PAGE,
                    **kwargs)  # type: ignore[arg-type]


def test_is_a_tier_and_round_trips() -> None:
    tier = small_tier(4)
    assert isinstance(tier, Tier)
    key = block_key(1)
    frame = make_frame(key)
    assert tier.put(key, frame)
    assert tier.put(key, frame)  # idempotent
    read = tier.get(key)
    assert read is not None
    assert isinstance(read.payload, bytes)
    read.verify()
    read.verify_key(key.digest)
    assert read.to_frame() == frame
    assert tier.contains([key, block_key(2)]) == [True, False]
    assert tier.get(block_key(2)) is None
    stats = tier.stats()
    assert (stats.blocks, stats.hits, stats.misses, stats.puts) == (1, 1, 1, 1)
    assert stats.bytes_used == PAGES_PER_BLOCK * PAGE


def test_get_into_out_copies_only_the_requested_layers() -> None:
    tier = small_tier(2)
    key = block_key(1)
    frame = make_frame(key)
    tier.put(key, bytearray(frame))  # any buffer type is accepted
    header = FrameHeader.unpack(frame)
    layers = LayerRange(1, 3)
    start, stop = header.span(layers)
    out = bytearray(b"\xaa" * len(frame))
    read = tier.get(key, layers, out=out)
    assert read is not None
    assert read.layers == layers
    assert isinstance(read.payload, memoryview)
    assert read.payload.obj is out  # a view of the caller's buffer, no copy of its own
    assert bytes(read.payload) == frame[start:stop]
    assert out[: stop - start] == frame[start:stop]
    assert out[stop - start:] == b"\xaa" * (len(frame) - (stop - start))  # nothing else touched
    read.verify()
    assert BlockRead.from_frame(frame, layers).payload == read.payload


def test_out_buffer_too_small_is_a_tier_error_and_unpins() -> None:
    tier = small_tier(2)
    key = block_key(1)
    tier.put(key, make_frame(key))
    with pytest.raises(TierError):
        tier.get(key, out=bytearray(10))
    with pytest.raises(TierError):
        tier.get(key, out=memoryview(bytes(100_000)))  # read-only
    assert tier.pinned_blocks == 0


def test_put_rejects_bad_frames_and_oversized_blocks() -> None:
    tier = small_tier(1)
    key, other = block_key(1), block_key(2)
    with pytest.raises(InvalidFrame):
        tier.put(key, make_frame(other))  # bound to another key
    with pytest.raises(InvalidFrame):
        tier.put(key, make_frame(key)[:-1])  # truncated
    with pytest.raises(InvalidFrame):
        tier.put(key, b"not a frame at all")
    assert not tier.put(key, make_frame(key, segment_bytes=4096))  # larger than the budget
    assert tier.stats().rejected_puts == 1
    assert tier.stats().bytes_used == 0


def test_budget_and_lru_eviction() -> None:
    tier = small_tier(3)
    keys = [block_key(i) for i in range(5)]
    for key in keys[:3]:
        assert tier.put(key, make_frame(key))
    assert tier.get(keys[0]) is not None  # 0 becomes most recent; 1 is now the oldest
    assert tier.put(keys[3], make_frame(keys[3]))
    # A lookup counts as a use too: the order is now 0, 2, 3 (oldest first).
    assert tier.contains(keys[:4]) == [True, False, True, True]
    assert tier.put(keys[4], make_frame(keys[4]))
    assert tier.contains(keys) == [False, False, True, True, True]
    stats = tier.stats()
    assert stats.bytes_used <= stats.bytes_budget
    assert stats.blocks == 3
    assert tier.evictions == 2
    for key in keys[2:]:  # survivors are intact (no page was shared)
        read = tier.get(key)
        assert read is not None and read.to_frame() == make_frame(key)


def test_delete_frees_pages() -> None:
    tier = small_tier(2)
    keys = [block_key(i) for i in range(2)]
    for key in keys:
        tier.put(key, make_frame(key))
    assert tier.delete([keys[0], block_key(9)]) == 1
    assert tier.stats().bytes_used == PAGES_PER_BLOCK * PAGE
    assert tier.put(block_key(3), make_frame(block_key(3)))
    assert tier.evictions == 0


class GatedHostTier(HostTier):
    """Pauses every copy out at its start, until released: a read that is "in flight"."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.entered = threading.Event()
        self.release = threading.Event()

    def _read_into(self, pages: Sequence[int], start: int, stop: int, dst: memoryview) -> None:
        self.entered.set()
        assert self.release.wait(10)
        super()._read_into(pages, start, stop, dst)


def _gated(blocks: int) -> GatedHostTier:
    return GatedHostTier(blocks * PAGES_PER_BLOCK * PAGE, page_bytes=PAGE, arena_bytes=8 * PAGE)


def _read_in_thread(tier: HostTier, key: BlockKey, result: list[BlockRead | None]
                    ) -> threading.Thread:
    out = bytearray(1 << 16)

    def run() -> None:
        result.append(tier.get(key, out=out))

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_pinned_block_is_not_evicted_mid_copy() -> None:
    tier = _gated(2)
    pinned, other = block_key(1), block_key(2)
    tier.put(pinned, make_frame(pinned))
    tier.put(other, make_frame(other))
    result: list[BlockRead | None] = []
    reader = _read_in_thread(tier, pinned, result)
    assert tier.entered.wait(10)
    assert tier.pinned_blocks == 1
    # After `other` is touched the pinned block is the LRU one, yet the put evicts `other`.
    tier.contains([other])
    newcomer = block_key(3)
    assert tier.put(newcomer, make_frame(newcomer))
    assert tier.contains([pinned, other, newcomer]) == [True, False, True]
    tier.release.set()
    reader.join(10)
    assert result and result[0] is not None
    assert result[0].to_frame() == make_frame(pinned)
    assert tier.pinned_blocks == 0


def test_everything_pinned_means_the_put_is_refused() -> None:
    tier = _gated(1)
    pinned = block_key(1)
    tier.put(pinned, make_frame(pinned))
    result: list[BlockRead | None] = []
    reader = _read_in_thread(tier, pinned, result)
    assert tier.entered.wait(10)
    assert not tier.put(block_key(2), make_frame(block_key(2)))
    assert tier.stats().rejected_puts == 1
    tier.release.set()
    reader.join(10)
    assert result[0] is not None and result[0].to_frame() == make_frame(pinned)
    assert tier.put(block_key(2), make_frame(block_key(2)))  # unpinned: evictable again


def test_block_deleted_while_pinned_keeps_its_pages_until_unpinned() -> None:
    tier = _gated(2)
    pinned = block_key(1)
    tier.put(pinned, make_frame(pinned))
    result: list[BlockRead | None] = []
    reader = _read_in_thread(tier, pinned, result)
    assert tier.entered.wait(10)
    assert tier.delete([pinned]) == 1
    assert tier.contains([pinned]) == [False]
    # Its pages are still held: one more block fits beside them, and the next one evicts that
    # block rather than reuse the pages under the reader.
    assert tier.stats().bytes_used == PAGES_PER_BLOCK * PAGE
    assert tier.put(block_key(2), make_frame(block_key(2)))
    assert tier.put(block_key(3), make_frame(block_key(3)))
    assert tier.contains([block_key(2), block_key(3)]) == [False, True]
    assert tier.stats().bytes_used == 2 * PAGES_PER_BLOCK * PAGE
    tier.release.set()
    reader.join(10)
    assert result[0] is not None and result[0].to_frame() == make_frame(pinned)
    assert tier.stats().bytes_used == PAGES_PER_BLOCK * PAGE  # freed on unpin


def test_slabs_are_reused_not_reallocated() -> None:
    frames_per_budget = 8
    segment = 64 << 10
    frame_pages = (4 * segment) // (16 << 10) + 1
    tier = HostTier(frames_per_budget * frame_pages * (16 << 10), page_bytes=16 << 10,
                    arena_bytes=1 << 20)
    keys = [block_key(i) for i in range(64)]
    frames = {key: make_frame(key, segment_bytes=segment) for key in keys}
    for key in keys[:frames_per_budget]:  # warm up: the budget is filled once
        assert tier.put(key, frames[key])
    allocated, arenas = tier.allocated_bytes, tier.arena_allocations
    assert allocated <= tier.stats().bytes_budget
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for key in keys[frames_per_budget:]:
            assert tier.put(key, frames[key])
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert tier.evictions == len(keys) - frames_per_budget
    assert (tier.allocated_bytes, tier.arena_allocations) == (allocated, arenas)
    # 56 puts of 256 KiB frames moved 14 MiB; the tier's own Python allocations stay tiny.
    assert grown < 256 << 10
    for key in keys[-frames_per_budget:]:
        read = tier.get(key)
        assert read is not None and read.to_frame() == frames[key]


def test_prefault_allocates_the_budget_up_front() -> None:
    tier = HostTier(16 * PAGE, page_bytes=PAGE, arena_bytes=4 * PAGE, prefault=True)
    assert tier.allocated_bytes == 16 * PAGE
    assert tier.arena_allocations == 4
    key = block_key(1)
    assert tier.put(key, make_frame(key))
    assert tier.arena_allocations == 4


def test_deadline_and_close() -> None:
    tier = small_tier(1)
    key = block_key(1)
    tier.put(key, make_frame(key))
    with pytest.raises(DeadlineExceeded):
        tier.get(key, deadline=time.monotonic() - 1)
    assert tier.get(key, deadline=time.monotonic() + 10) is not None
    tier.close()
    tier.close()
    with pytest.raises(TierUnavailable):
        tier.get(key)
    with pytest.raises(TierUnavailable):
        tier.put(key, make_frame(key))
    with pytest.raises(TierUnavailable):
        tier.contains([key])


def test_manifests_never_roll_back() -> None:
    tier = small_tier(1)
    skey = session_key()
    m2 = SessionManifest(skey, (), token_count=32, generation=2)
    tier.put_manifest(m2)
    tier.put_manifest(SessionManifest(skey, (), token_count=16, generation=1))
    assert tier.get_manifest(skey) == m2
    m3 = SessionManifest(skey, (), token_count=48, generation=3)
    tier.put_manifest(m3)
    assert tier.get_manifest(skey) == m3
    assert tier.delete_manifest(skey)
    assert not tier.delete_manifest(skey)
    assert tier.get_manifest(skey) is None


def test_concurrent_readers_and_writers_see_only_whole_blocks() -> None:
    tier = small_tier(6)
    keys = [block_key(i) for i in range(24)]
    frames = {key: make_frame(key) for key in keys}
    stop = time.monotonic() + 1.0
    failures: list[str] = []

    def worker(seed: int) -> None:
        out = bytearray(8192)
        i = seed
        while time.monotonic() < stop:
            key = keys[i % len(keys)]
            i += 7
            if i % 3:
                tier.put(key, frames[key])
            else:
                read = tier.get(key, out=out)
                if read is not None and read.to_frame() != frames[key]:
                    failures.append(f"bad bytes for {key}")

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures
    assert tier.pinned_blocks == 0
    assert tier.stats().bytes_used <= tier.stats().bytes_budget


def test_manifests_are_bounded_least_recently_used_first() -> None:
    from kvstore.keys import BlockHash

    def manifest(name: str, generation: int = 1) -> SessionManifest:
        return SessionManifest(session_key(name),
                               tuple(BlockHash(bytes([i]) * 32) for i in range(10)),
                               token_count=320, generation=generation,
                               token_ids=tuple(range(320)))

    one = 256 + 72 * 10 + 36 * 320  # the tier's estimate of one manifest's memory
    tier = HostTier(1 << 20, manifest_budget=4 * one + one // 2)
    try:
        for i in range(4):
            tier.put_manifest(manifest(f"s{i}"))
        assert tier.get_manifest(session_key("s0")) is not None  # now the most recent
        tier.put_manifest(manifest("s4"))
        assert tier.get_manifest(session_key("s1")) is None  # the least recent went
        assert tier.manifest_evictions == 1
        tier.put_manifest(manifest("s2", generation=2))  # a rewrite adds no bytes
        tier.delete_manifest(session_key("s3"))
        tier.put_manifest(manifest("s5"))  # fits where s3 was
        assert tier.manifest_evictions == 1
        for name in ("s0", "s2", "s4", "s5"):
            assert tier.get_manifest(session_key(name)) is not None, name
    finally:
        tier.close()
