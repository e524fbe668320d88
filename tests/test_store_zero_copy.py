"""The zero-copy paths of the host tier and the store that the daemon's data plane uses:
lending a block's pages to send from (`borrow`), receiving a frame straight into pages
(`reserve` / `begin_put` + `commit_put`), and verifying a payload held in pieces."""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.errors import CorruptBlock, InvalidFrame
from kvstore.frame import BlockRead, LayerRange, verify_pieces
from kvstore.keys import BlockKey
from kvstore.store import StoreConfig, TieredStore
from kvstore.tiers.memory.host import HostTier
from kvstore.tiers.nvme.durable_files import write_chunked
from kvstore.tiers.nvme.tier import NvmeTier
from tests.blockframes import block_key, make_frame

PAGE = 64 << 10


def host(budget: int = 4 << 20) -> HostTier:
    return HostTier(budget, page_bytes=PAGE, arena_bytes=1 << 20)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[TieredStore]:
    s = TieredStore([host(), NvmeTier(tmp_path / "nvme", 64 << 20)],
                    config=StoreConfig(writer_nice=5))
    try:
        yield s
    finally:
        s.close()


def fill(pieces: list[memoryview], frame: bytes) -> None:
    pos = 0
    for piece in pieces:
        piece[:] = frame[pos: pos + len(piece)]
        pos += len(piece)
    assert pos == len(frame)


# -- verify_pieces ---------------------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(layers=st.integers(1, 8), seg=st.sampled_from([4, 12, 1000, 5000]),
       cuts=st.lists(st.integers(0, 1 << 16), max_size=6), data=st.data())
def test_verify_pieces_agrees_with_verify_across_any_split(
        layers: int, seg: int, cuts: list[int], data: st.DataObject) -> None:
    key = block_key(1)
    frame = make_frame(key, layers=layers, segment_bytes=seg, seed=layers)
    start = data.draw(st.integers(0, layers - 1))
    want = LayerRange(start, data.draw(st.integers(start + 1, layers)))
    read = BlockRead.from_frame(frame, want)
    payload = bytes(read.payload)
    bounds = sorted({min(c, len(payload)) for c in cuts})
    edges = [0, *bounds, len(payload)]
    pieces = [payload[a:b] for a, b in itertools.pairwise(edges)]
    verify_pieces(read.header, want, pieces)  # the good copy passes, however it is cut
    if payload:
        flip = data.draw(st.integers(0, len(payload) - 1))
        bad = bytearray(payload)
        bad[flip] ^= 0x40
        with pytest.raises(CorruptBlock):
            verify_pieces(read.header, want, [bad[a:b] for a, b in itertools.pairwise(edges)])
    with pytest.raises(CorruptBlock):  # a payload of the wrong size
        verify_pieces(read.header, want, [*pieces, b"x"])


# -- borrow ----------------------------------------------------------------------------------


def test_borrow_lends_pinned_read_only_pages_of_the_range() -> None:
    tier = host()
    key = block_key(2)
    frame = make_frame(key, layers=4, segment_bytes=100_000)  # spans pages
    assert tier.put(key, frame)
    whole = tier.borrow(key)
    assert whole is not None and len(whole.pieces) > 1
    assert b"".join(whole.pieces) == bytes(BlockRead.from_frame(frame).payload)
    assert all(p.readonly for p in whole.pieces)
    part = tier.borrow(key, LayerRange(1, 3))
    assert part is not None
    assert b"".join(part.pieces) == bytes(BlockRead.from_frame(frame, LayerRange(1, 3)).payload)
    assert part.size == 200_000
    part.release()
    part.release()  # twice is harmless
    # Deleted while lent: the pages stay intact until the borrower lets go.
    used = tier.stats().bytes_used
    assert tier.delete([key]) == 1
    assert not tier.contains([key])[0]
    assert b"".join(whole.pieces) == bytes(BlockRead.from_frame(frame).payload)
    assert tier.stats().bytes_used == used
    whole.release()
    assert tier.stats().bytes_used == 0
    assert tier.borrow(key) is None
    assert tier.put(key, frame)
    with pytest.raises(ValueError):
        tier.borrow(key, LayerRange(0, 9))


def test_borrowed_blocks_are_not_evicted() -> None:
    tier = host(budget=1 << 20)
    keys = [block_key(i) for i in range(3)]
    frames = [make_frame(k, layers=4, segment_bytes=100_000) for k in keys]
    assert tier.put(keys[0], frames[0])
    lent = tier.borrow(keys[0])
    assert lent is not None
    for key, frame in zip(keys[1:], frames[1:], strict=True):
        tier.put(key, frame)  # the budget holds two: the lent one must survive
    assert tier.contains([keys[0]]) == [True]
    assert b"".join(lent.pieces) == bytes(BlockRead.from_frame(frames[0]).payload)
    lent.release()


def test_store_borrow_verifies_and_drops_a_corrupt_copy(store: TieredStore) -> None:
    key = block_key(3)
    frame = make_frame(key, layers=4, segment_bytes=50_000)
    assert store.put(key, frame)
    assert store.flush(10)
    lent = store.borrow(key)
    assert lent is not None
    lent.release()
    assert store.borrow(block_key(99)) is None  # a miss
    assert store.borrow(key, LayerRange(0, 99)) is None  # a bad range: `get` says why
    # Flip a byte of the copy in RAM (behind the tier's back): borrow refuses it and drops it,
    # and `get` still finds the good copy on disk.
    tier = store.tiers[0]
    assert isinstance(tier, HostTier)
    entry = tier._index[key.digest]  # white box: corrupt the stored pages
    tier._page_views[entry.pages[-1]][10] ^= 0xFF
    assert store.borrow(key) is None
    assert store.tiers[0].contains([key]) == [False]
    read = store.get(key)
    assert read is not None and read.to_frame() == frame


@pytest.mark.parametrize("recheck", [0.0, 0.3])
def test_a_lent_copy_is_checked_after_its_first_send_then_at_most_every_recheck(
        tmp_path: Path, recheck: float) -> None:
    """`check_borrowed` hashes a lent block the first time, then skips it for `lent_recheck_s`
    (0: never skips): a copy corrupted in RAM meanwhile is found at the next check, dropped,
    and the disk's good copy read instead."""
    store = TieredStore([host(), NvmeTier(tmp_path / "nvme", 64 << 20)],
                        config=StoreConfig(lent_recheck_s=recheck))
    try:
        key = block_key(7)
        frame = make_frame(key, layers=4, segment_bytes=50_000)
        assert store.put(key, frame) and store.flush(10)

        def send_once() -> bool:
            lent = store.borrow(key, verify=False)
            assert lent is not None
            try:
                return store.check_borrowed(key, lent)
            finally:
                lent.release()

        assert send_once()
        tier = store.tiers[0]
        assert isinstance(tier, HostTier)
        tier._page_views[tier._index[key.digest].pages[-1]][5] ^= 0x01  # white box: a bit flips
        if recheck:
            assert send_once()  # checked a moment ago: not hashed again
            time.sleep(recheck + 0.05)
        assert not send_once()
        assert tier.contains([key]) == [False]
        read = store.get(key)
        assert read is not None and read.to_frame() == frame
        assert store.flush(10)  # the get promotes the disk's copy back into RAM ...
        assert send_once()  # ... which is good
    finally:
        store.close()


def test_a_block_received_in_place_counts_as_checked_for_its_first_sends(
        tmp_path: Path) -> None:
    """`commit_put` follows the caller's verification of the very pages it publishes (the
    daemon's receive path), so the first sends within `lent_recheck_s` do not hash the block
    again; a bit that flips later is still found once the window has passed."""
    store = TieredStore([host(), NvmeTier(tmp_path / "nvme", 64 << 20)],
                        config=StoreConfig(lent_recheck_s=0.3))
    try:
        key = block_key(9)
        frame = make_frame(key, layers=4, segment_bytes=50_000)
        pending = store.begin_put(key, len(frame))
        assert pending is not None
        fill(pending.pieces, frame)
        assert store.commit_put(pending, BlockRead.from_frame(frame).header)
        assert store.flush(10)
        tier = store.tiers[0]
        assert isinstance(tier, HostTier)
        tier._page_views[tier._index[key.digest].pages[-1]][5] ^= 0x01  # white box: a flip
        lent = store.borrow(key, verify=False)
        assert lent is not None
        assert store.check_borrowed(key, lent)  # received a moment ago: not hashed again
        lent.release()
        time.sleep(0.35)
        lent = store.borrow(key, verify=False)
        assert lent is not None
        assert not store.check_borrowed(key, lent)  # the window passed: found and dropped
        lent.release()
        assert tier.contains([key]) == [False]
        read = store.get(key)
        assert read is not None and read.to_frame() == frame
    finally:
        store.close()


def test_a_lent_layer_range_passing_its_check_does_not_excuse_the_whole_block(
        tmp_path: Path) -> None:
    store = TieredStore([host(), NvmeTier(tmp_path / "nvme", 64 << 20)],
                        config=StoreConfig(lent_recheck_s=60.0))
    try:
        key = block_key(8)
        assert store.put(key, make_frame(key, layers=4, segment_bytes=50_000))
        assert store.flush(10)
        tier = store.tiers[0]
        assert isinstance(tier, HostTier)
        tier._page_views[tier._index[key.digest].pages[-1]][5] ^= 0x01  # in the last layer
        first = store.borrow(key, LayerRange(0, 1), verify=False)
        assert first is not None
        assert store.check_borrowed(key, first)  # layer 0 is intact
        first.release()
        whole = store.borrow(key, verify=False)
        assert whole is not None
        assert not store.check_borrowed(key, whole)  # checked: the range excused nothing
        whole.release()
    finally:
        store.close()


# -- reserve / begin_put / commit_put ----------------------------------------------------------


def test_a_frame_received_into_reserved_pages_is_stored_and_written_behind(
        store: TieredStore) -> None:
    key = block_key(4)
    frame = make_frame(key, layers=4, segment_bytes=70_000)
    pending = store.begin_put(key, len(frame))
    assert pending is not None
    assert store.tiers[0].contains([key]) == [False]  # invisible until committed
    fill(pending.pieces, frame)
    header = BlockRead.from_frame(frame).header
    assert store.commit_put(pending, header)
    assert store.flush(10)
    assert all(t.contains([key]) == [True] for t in store.tiers)
    read = store.get(key)
    assert read is not None and read.to_frame() == frame
    assert store.begin_put(key, len(frame)) is None  # present already: `put` handles it


def test_aborted_and_mismatched_reservations_store_nothing_and_give_pages_back(
        store: TieredStore) -> None:
    tier = store.tiers[0]
    key, other = block_key(5), block_key(6)
    frame = make_frame(key, layers=2, segment_bytes=70_000)
    pending = store.begin_put(key, len(frame))
    assert pending is not None
    fill(pending.pieces, frame)
    pending.abort()
    pending.abort()
    assert tier.stats().bytes_used == 0 and tier.contains([key]) == [False]
    # A header of another key, or of another size: refused, pages back, nothing queued.
    for wrong in (BlockRead.from_frame(make_frame(other, layers=2, segment_bytes=70_000)).header,
                  BlockRead.from_frame(make_frame(key, layers=1, segment_bytes=70_000)).header):
        pending = store.begin_put(key, len(frame))
        assert pending is not None
        with pytest.raises(InvalidFrame):
            store.commit_put(pending, wrong)
        assert tier.stats().bytes_used == 0
    assert store.flush(10)
    assert all(t.contains([key]) == [False] for t in store.tiers)


def test_a_concurrent_put_of_the_same_key_wins_and_reserved_pages_are_freed(
        store: TieredStore) -> None:
    tier = store.tiers[0]
    key = block_key(7)
    frame = make_frame(key, layers=2, segment_bytes=70_000)
    pending = store.begin_put(key, len(frame))
    assert pending is not None
    assert store.put(key, frame)  # lands first
    used = tier.stats().bytes_used
    fill(pending.pieces, frame)
    assert store.commit_put(pending, BlockRead.from_frame(frame).header)
    assert tier.stats().bytes_used < 2 * used  # the reserved copy went back


def test_reserve_refuses_what_the_budget_cannot_hold() -> None:
    tier = host(budget=1 << 20)
    assert tier.reserve(block_key(8), 2 << 20) is None
    assert tier.reserve(block_key(8), 0) is None
    pending = tier.reserve(block_key(8), 100)
    assert pending is not None and sum(len(p) for p in pending.pieces) == 100
    tier.close()
    frame = os.urandom(100)
    fill(pending.pieces, frame)  # the arena outlives the closed tier's pool
    assert not pending.commit(BlockRead.from_frame(
        make_frame(block_key(8), layers=1, segment_bytes=16)).header)


def test_delete_waits_for_a_write_behind_in_flight(tmp_path: Path) -> None:
    """A block being written behind when it is deleted must not outlive the delete in a lower
    tier: the writer publishes it there and only then sees the delete and undoes the write. A
    preempted writer (lower CPU priority, a busy node) used to leave it visible in between."""
    writing, release, published = threading.Event(), threading.Event(), threading.Event()

    def slow_write(fd: int, data: memoryview) -> None:
        writing.set()
        release.wait(5)
        write_chunked(fd, data)

    class SlowToUndo(NvmeTier):
        def put(self, key: BlockKey, frame: bytes | bytearray | memoryview) -> bool:
            stored = super().put(key, frame)
            published.set()
            time.sleep(0.5)  # the writer, descheduled between publishing and undoing
            return stored

    store = TieredStore([host(), SlowToUndo(tmp_path / "nvme", 64 << 20, write_fn=slow_write)])
    try:
        key = block_key(9)
        assert store.put(key, make_frame(key))
        assert writing.wait(5)  # the writer is inside the nvme write now
        threading.Timer(0.1, release.set).start()
        assert store.delete([key]) == 1
        assert published.wait(5)
        assert [t.contains([key]) for t in store.tiers] == [[False], [False]]
        assert store.get(key) is None
    finally:
        release.set()
        store.close()
