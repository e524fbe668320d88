"""The nvme tier: round trips, range reads, verification, LRU budget, recovery, disk full,
manifests and concurrency. Frames are built directly with build_frame from random bytes."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.errors import (
    ConfigError,
    CorruptBlock,
    DeadlineExceeded,
    InvalidFrame,
    TierError,
    TierUnavailable,
)
from kvstore.frame import BlockRead, CodecId, Compression, DType, LayerRange, build_frame
from kvstore.keys import BlockHash, BlockKey, Namespace, SessionKey, validate_session_id
from kvstore.manifest import SessionManifest
from kvstore.tiers.base import Tier
from kvstore.tiers.nvme import durable_files
from kvstore.tiers.nvme.tier import NvmeTier

FP = bytes(range(16))
NS = Namespace("tenant-a")
LAYERS = 4
SEG = 4096


def key_of(i: int, ns: Namespace = NS) -> BlockKey:
    return BlockKey(FP, ns, BlockHash(i.to_bytes(8, "little")))


def frame_for(key: BlockKey, seg: int = SEG, layers: int = LAYERS, seed: int = 0) -> bytes:
    rng = np.random.default_rng(int.from_bytes(key.digest[:8], "little") + seed)
    data = [(rng.bytes(seg), Compression.NONE, seg) for _ in range(layers)]
    return build_frame(data, codec=CodecId.RAW, dtype=DType.FLOAT16, layout_id="nhd",
                       token_count=16, layer_shape=(16, 2, seg // 64), key_digest=key.digest)


def payload_of(frame: bytes, layers: LayerRange | None = None) -> bytes:
    return bytes(BlockRead.from_frame(frame, layers).payload)


def block_files(root: Path) -> list[Path]:
    return sorted((root / "blocks").rglob("*.kvb"))


def temp_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.name.endswith(".tmp"))


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "nvme"


@pytest.fixture
def tier(root: Path) -> Iterator[NvmeTier]:
    with NvmeTier(root, 64 << 20) as t:
        yield t


# ----------------------------------------------------------------------------- basics

def test_is_a_tier(tier: NvmeTier) -> None:
    assert isinstance(tier, Tier)
    assert tier.name == "nvme"


def test_round_trip_and_contains(tier: NvmeTier) -> None:
    keys = [key_of(i) for i in range(5)]
    frames = [frame_for(k) for k in keys]
    for k, f in zip(keys[:3], frames[:3], strict=True):
        assert tier.put(k, f)
    assert tier.contains(keys) == [True, True, True, False, False]
    for k, f in zip(keys[:3], frames[:3], strict=True):
        got = tier.get(k)
        assert got is not None and got.is_complete
        assert got.to_frame() == f
    assert tier.get(keys[4]) is None
    s = tier.stats()
    assert (s.blocks, s.bytes_used, s.puts, s.hits, s.misses) == (
        3, sum(map(len, frames[:3])), 3, 3, 1)


def test_put_is_idempotent(tier: NvmeTier) -> None:
    k = key_of(1)
    assert tier.put(k, frame_for(k))
    assert tier.put(k, frame_for(k))
    assert tier.stats().puts == 1
    assert len(block_files(tier.data_dir)) == 1


def test_get_into_caller_buffer_is_a_view_of_it(tier: NvmeTier) -> None:
    k = key_of(2)
    f = frame_for(k)
    tier.put(k, f)
    out = bytearray(len(f))
    got = tier.get(k, out=out)
    assert got is not None
    assert bytes(got.payload) == payload_of(f)
    assert isinstance(got.payload, memoryview) and got.payload.obj is out
    arr = np.zeros(len(f), dtype=np.uint8)  # a numpy buffer works as well
    got = tier.get(k, LayerRange(1, 3), out=arr.data)
    assert got is not None and bytes(got.payload) == payload_of(f, LayerRange(1, 3))
    assert arr[: len(got.payload)].tobytes() == payload_of(f, LayerRange(1, 3))
    with pytest.raises(ValueError, match="out buffer"):
        tier.get(k, out=bytearray(10))


def test_layer_range_reads_only_header_and_range(tier: NvmeTier,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    k = key_of(3)
    f = frame_for(k, seg=64 << 10, layers=8)
    tier.put(k, f)
    header = BlockRead.from_frame(f).header
    want = LayerRange(2, 5)
    start, stop = header.span(want)
    reads: list[tuple[int, int]] = []
    real = os.preadv

    def spy(fd: int, buffers: list[memoryview], offset: int) -> int:
        n = real(fd, buffers, offset)
        reads.append((offset, n))
        return n

    monkeypatch.setattr(os, "preadv", spy)
    got = tier.get(k, want)
    assert got is not None and bytes(got.payload) == payload_of(f, want)
    assert reads[0] == (0, header.header_size)
    assert sum(n for _, n in reads[1:]) == stop - start
    assert min(off for off, _ in reads[1:]) == start


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 7), st.integers(1, 8))
def test_any_layer_range_round_trips(start: int, width: int) -> None:
    stop = min(8, start + width)
    with tempfile.TemporaryDirectory() as d, NvmeTier(d, 1 << 20) as t:
        k = key_of(start * 10 + width)
        f = frame_for(k, seg=1000, layers=8)  # odd sizes: nothing is page aligned
        t.put(k, f)
        got = t.get(k, LayerRange(start, stop))
        assert got is not None and bytes(got.payload) == payload_of(f, LayerRange(start, stop))


def test_layer_range_past_the_block_is_a_caller_error(tier: NvmeTier) -> None:
    k = key_of(4)
    tier.put(k, frame_for(k))
    with pytest.raises(ValueError):
        tier.get(k, LayerRange(0, LAYERS + 1))


def test_deadline(tier: NvmeTier) -> None:
    k = key_of(5)
    tier.put(k, frame_for(k))
    with pytest.raises(DeadlineExceeded):
        tier.get(k, deadline=time.monotonic() - 0.001)
    assert tier.get(k, deadline=time.monotonic() + 10) is not None


def test_invalid_frames_are_refused_and_leave_nothing(tier: NvmeTier) -> None:
    k, other = key_of(6), key_of(7)
    good = frame_for(k)
    with pytest.raises(InvalidFrame):
        tier.put(k, frame_for(other))  # bound to another key
    with pytest.raises(InvalidFrame):
        tier.put(k, b"not a frame at all")
    with pytest.raises(InvalidFrame):
        tier.put(k, good[:-1])
    with pytest.raises(InvalidFrame):
        tier.put(k, good + b"x")
    flipped = bytearray(good)
    flipped[-1] ^= 1
    with pytest.raises(InvalidFrame):
        tier.put(k, flipped)
    with pytest.raises(InvalidFrame):  # one bad frame refuses the whole batch
        tier.put_many([(other, frame_for(other)), (k, flipped)])
    assert tier.stats().blocks == 0 and not block_files(tier.data_dir)
    assert not temp_files(tier.data_dir)


def test_put_many(tier: NvmeTier) -> None:
    keys = [key_of(i) for i in range(40)]
    assert tier.put(keys[0], frame_for(keys[0]))
    items = [(k, frame_for(k)) for k in keys] + [(keys[5], frame_for(keys[5]))]
    assert tier.put_many(items) == [True] * len(items)
    assert tier.stats().puts == 40
    for k in keys:
        got = tier.get(k)
        assert got is not None and got.to_frame() == frame_for(k)


def test_durable_false_still_round_trips(root: Path) -> None:
    with NvmeTier(root, 1 << 20, durable=False, drop_page_cache=False) as t:
        k = key_of(8)
        assert t.put(k, frame_for(k))
        got = t.get(k)
        assert got is not None and got.to_frame() == frame_for(k)


# ----------------------------------------------------------------------- corruption

def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as fh:
        fh.seek(offset)
        byte = fh.read(1)[0]
        fh.seek(offset)
        fh.write(bytes([byte ^ 0x10]))


@pytest.mark.parametrize("where", ["segment", "header"])
def test_corrupt_block_is_deleted_counted_and_raised(tier: NvmeTier, where: str) -> None:
    k = key_of(9)
    f = frame_for(k)
    tier.put(k, f)
    header = BlockRead.from_frame(f).header
    offset = header.header_size + 100 if where == "segment" else 30
    (path,) = block_files(tier.data_dir)
    _flip(path, offset)
    with pytest.raises(CorruptBlock):
        tier.get(k, out=bytearray(len(f)))
    assert not path.exists()
    assert tier.contains([k]) == [False]
    assert tier.get(k) is None
    s = tier.stats()
    assert (s.corrupt, s.blocks, s.bytes_used) == (1, 0, 0)


def test_corruption_outside_the_read_range_is_not_read(tier: NvmeTier) -> None:
    k = key_of(10)
    f = frame_for(k)
    tier.put(k, f)
    header = BlockRead.from_frame(f).header
    (path,) = block_files(tier.data_dir)
    _flip(path, header.segments[3].offset + 5)
    got = tier.get(k, LayerRange(0, 3))  # verified: everything it returns is intact
    assert got is not None and bytes(got.payload) == payload_of(f, LayerRange(0, 3))
    with pytest.raises(CorruptBlock):
        tier.get(k, LayerRange(3, 4))


def test_frame_of_another_key_under_a_name_is_corrupt(tier: NvmeTier) -> None:
    a, b = key_of(11), key_of(12)
    tier.put(a, frame_for(a))
    tier.put(b, frame_for(b))
    path_a, path_b = (tier.data_dir / "blocks" / f"{k.digest[0] % 64:02x}" /
                      f"{k.storage_name}.kvb" for k in (a, b))
    shutil.copyfile(path_a, path_b)  # same size: only the key binding can tell
    with pytest.raises(CorruptBlock):
        tier.get(b)
    assert path_a.exists() and not path_b.exists()


def test_file_removed_behind_our_back_is_a_miss(tier: NvmeTier) -> None:
    k = key_of(13)
    tier.put(k, frame_for(k))
    (path,) = block_files(tier.data_dir)
    path.unlink()
    assert tier.get(k) is None
    assert tier.stats().blocks == 0


# ------------------------------------------------------------------------ budget, LRU

def test_lru_eviction_within_budget(root: Path) -> None:
    size = len(frame_for(key_of(0)))
    with NvmeTier(root, 3 * size) as t:
        keys = [key_of(i) for i in range(5)]
        for k in keys[:3]:
            assert t.put(k, frame_for(k))
        assert t.get(keys[0]) is not None  # 0 is now most recently used; 1 is the LRU
        assert t.put(keys[3], frame_for(keys[3]))
        assert t.contains(keys[:4]) == [True, False, True, True]
        assert t.put(keys[4], frame_for(keys[4]))
        assert t.contains(keys) == [True, False, False, True, True]
        assert len(block_files(root)) == 3
        assert t.stats().bytes_used == 3 * size
        big = key_of(99)
        assert not t.put(big, frame_for(big, seg=4 * SEG))  # larger than the whole budget
        assert t.stats().rejected_puts == 1
        assert t.contains(keys) == [True, False, False, True, True]


# --------------------------------------------------------------------------- recovery

def test_recovery_rebuilds_index_and_cleans_up(root: Path) -> None:
    keys = [key_of(i) for i in range(6)]
    with NvmeTier(root, 1 << 20) as t:
        for k in keys:
            t.put(k, frame_for(k))
    shard = root / "blocks" / f"{keys[0].digest[0] % 64:02x}"
    leftovers = [shard / f".{keys[0].storage_name}.kvb.123.4.tmp",
                 root / "manifests" / "00" / ".abc.kvm.1.1.tmp"]
    for p in leftovers:
        p.write_bytes(b"half a block")
    paths = {k: shard.parent / f"{k.digest[0] % 64:02x}" / f"{k.storage_name}.kvb" for k in keys}
    data = paths[keys[1]].read_bytes()
    paths[keys[1]].write_bytes(data[:-10])  # truncated: size disagrees with the header
    _flip(paths[keys[2]], 20)  # header no longer verifies
    shutil.copyfile(paths[keys[4]], paths[keys[3]])  # bound to another key than its name
    foreign = shard / "README"
    foreign.write_text("not ours")
    with NvmeTier(root, 1 << 20) as t:
        r = t.recovery
        assert (r.blocks, r.temp_removed, r.invalid_removed) == (3, 2, 3)
        assert t.contains(keys) == [True, False, False, False, True, True]
        assert t.stats().corrupt == 3
        for k in (keys[0], keys[4], keys[5]):
            got = t.get(k)
            assert got is not None and got.to_frame() == frame_for(k)
        assert foreign.exists() and not any(p.exists() for p in leftovers)
        assert t.put(keys[1], frame_for(keys[1]))


def test_recovery_with_a_smaller_budget_drops_the_oldest(root: Path) -> None:
    keys = [key_of(i) for i in range(4)]
    size = len(frame_for(keys[0]))
    with NvmeTier(root, 1 << 20) as t:
        for n, k in enumerate(keys):
            t.put(k, frame_for(k))
            path = next(p for p in block_files(root) if p.stem == k.storage_name)
            os.utime(path, ns=(n * 10**9, n * 10**9))  # mtimes are coarse; make order explicit
    with NvmeTier(root, 2 * size) as t:
        assert t.contains(keys) == [False, False, True, True]
        assert len(block_files(root)) == 2


def test_one_owner_per_directory(root: Path) -> None:
    with NvmeTier(root, 1 << 20), pytest.raises(ConfigError):
        NvmeTier(root, 1 << 20)
    with NvmeTier(root, 1 << 20) as again:
        assert again.stats().blocks == 0


def test_closed_tier_refuses_calls(root: Path) -> None:
    t = NvmeTier(root, 1 << 20)
    t.close()
    t.close()
    with pytest.raises(TierUnavailable):
        t.get(key_of(1))
    with pytest.raises(TierUnavailable):
        t.put(key_of(1), frame_for(key_of(1)))
    with pytest.raises(TierUnavailable):
        t.contains([key_of(1)])


def test_close_waits_for_a_put_in_flight(root: Path) -> None:
    def slow_write(fd: int, data: memoryview) -> None:
        time.sleep(0.3)
        durable_files.write_chunked(fd, data)

    t = NvmeTier(root, 1 << 20, write_fn=slow_write)
    results: list[bool] = []
    writer = threading.Thread(target=lambda: results.append(t.put(key_of(1),
                                                                   frame_for(key_of(1)))))
    writer.start()
    time.sleep(0.1)
    t.close()  # must not pull the directory fds from under the write
    writer.join()
    assert results == [True]
    with NvmeTier(root, 1 << 20) as again:
        got = again.get(key_of(1))
        assert got is not None and got.to_frame() == frame_for(key_of(1))


def test_bad_budget() -> None:
    with pytest.raises(ConfigError):
        NvmeTier("/nonexistent-never-created", 0)


# -------------------------------------------------------------------------- manifests

def _manifest(session: str, generation: int, n: int = 3) -> SessionManifest:
    key = SessionKey(FP, NS, validate_session_id(session))
    return SessionManifest(key, tuple(BlockHash(bytes([generation, i])) for i in range(n)),
                           token_count=16 * n, generation=generation, updated_at=1.0)


def test_manifests_are_bounded_least_recently_used_first(root: Path) -> None:
    size = len(_manifest("s0", 1, n=20).encode())
    with NvmeTier(root, 1 << 20, manifest_budget=int(4.5 * size)) as t:
        for i in range(4):
            t.put_manifest(_manifest(f"s{i}", 1, n=20))
        assert t.get_manifest(_manifest("s0", 1).key) is not None  # s0 is now the most recent
        t.put_manifest(_manifest("s4", 1, n=20))  # over budget: s1, the least recent, goes
        assert t.get_manifest(_manifest("s1", 1).key) is None
        kept = [f"s{i}" for i in (0, 2, 3, 4)]
        assert all(t.get_manifest(_manifest(s, 1).key) is not None for s in kept)
        t.put_manifest(_manifest("s2", 2, n=20))  # a rewrite replaces its bytes, adds none
        assert all(t.get_manifest(_manifest(s, 1).key) is not None for s in kept)
        assert len(list(root.rglob("*.kvm"))) == 4
    # A restart finds the manifests and their order (by file time) and keeps the budget.
    with NvmeTier(root, 1 << 20, manifest_budget=int(2.5 * size)) as t:
        assert len(list(root.rglob("*.kvm"))) == 2
        assert t.get_manifest(_manifest("s2", 2).key) is not None  # the newest two stayed
    with NvmeTier(root, 1 << 20, manifest_budget=size // 2) as t:  # one alone may exceed it
        t.put_manifest(_manifest("big", 1, n=20))
        assert t.get_manifest(_manifest("big", 1).key) is not None
        assert len(list(root.rglob("*.kvm"))) == 1


def test_manifest_round_trip_and_no_rollback(root: Path) -> None:
    with NvmeTier(root, 1 << 20) as t:
        m3, m2, m3b = _manifest("s1", 3), _manifest("s1", 2), _manifest("s1", 3, n=5)
        assert t.get_manifest(m3.key) is None
        t.put_manifest(m3)
        assert t.get_manifest(m3.key) == m3
        t.put_manifest(m2)  # older: ignored
        assert t.get_manifest(m3.key) == m3
        t.put_manifest(m3b)  # same generation: overwrites
        assert t.get_manifest(m3.key) == m3b
        t.put_manifest(_manifest("s2", 1))
    with NvmeTier(root, 1 << 20) as t:
        assert t.recovery.manifests == 2
        assert t.get_manifest(m3.key) == m3b
        assert t.delete_manifest(m3.key)
        assert not t.delete_manifest(m3.key)
        assert t.get_manifest(m3.key) is None
        assert t.get_manifest(_manifest("s2", 1).key) == _manifest("s2", 1)


def test_corrupt_manifest_is_deleted_and_replaceable(root: Path) -> None:
    with NvmeTier(root, 1 << 20) as t:
        m = _manifest("s1", 7)
        t.put_manifest(m)
        (path,) = (root / "manifests").rglob("*.kvm")
        _flip(path, 12)
        with pytest.raises(CorruptBlock):
            t.get_manifest(m.key)
        assert not path.exists() and t.stats().corrupt == 1
        t.put_manifest(_manifest("s1", 1))  # nothing (valid) stored, so any generation goes
        assert t.get_manifest(m.key) == _manifest("s1", 1)


# -------------------------------------------------------------------------- disk full

class FailingWrites:
    """A WriteFn that fails with `err` while `failing` is set (fault injection)."""

    def __init__(self, err: int = errno.ENOSPC) -> None:
        self.err = err
        self.failing = False
        self.calls = 0

    def __call__(self, fd: int, data: memoryview) -> None:
        self.calls += 1
        if self.failing:
            os.write(fd, data[: len(data) // 2])  # a partial temp file must not survive
            raise OSError(self.err, os.strerror(self.err))
        durable_files.write_chunked(fd, data)


def test_injected_disk_full_stops_admission_and_keeps_reads(root: Path) -> None:
    writes = FailingWrites(errno.ENOSPC)
    with NvmeTier(root, 1 << 20, write_fn=writes, space_recheck_s=3600) as t:
        keys = [key_of(i) for i in range(6)]
        assert t.put(keys[0], frame_for(keys[0]))
        assert t.put(keys[1], frame_for(keys[1]))
        writes.failing = True
        assert not t.put(keys[2], frame_for(keys[2]))
        assert not t.admitting
        writes.failing = False
        calls = writes.calls
        assert not t.put(keys[3], frame_for(keys[3]))  # refused without touching the disk
        assert writes.calls == calls
        assert t.put(keys[0], frame_for(keys[0]))  # already stored: still True
        assert not temp_files(root) and len(block_files(root)) == 2
        got = t.get(keys[1])
        assert got is not None and got.to_frame() == frame_for(keys[1])
        assert t.stats().rejected_puts == 2 and t.stats().errors == 0
        assert t.delete([keys[0]]) == 1  # freeing space re-opens admission
        assert t.admitting
        assert t.put(keys[3], frame_for(keys[3]))
        writes.failing = True  # EDQUOT mid-batch: the rest of the batch is refused too
        writes.err = errno.EDQUOT
        assert t.put_many([(k, frame_for(k)) for k in keys[4:]]) == [False, False]
        assert not temp_files(root)


def test_disk_full_recheck_reopens_admission(root: Path) -> None:
    writes = FailingWrites()
    with NvmeTier(root, 1 << 20, write_fn=writes, space_recheck_s=0.05,
                  min_free_bytes=0) as t:
        writes.failing = True
        assert not t.put(key_of(1), frame_for(key_of(1)))
        writes.failing = False
        time.sleep(0.06)  # the real disk has room, so the periodic re-check lets writes in
        assert t.put(key_of(1), frame_for(key_of(1)))
        assert t.admitting


def test_other_write_errors_raise_and_leave_nothing(root: Path) -> None:
    writes = FailingWrites(errno.EIO)
    with NvmeTier(root, 1 << 20, write_fn=writes) as t:
        writes.failing = True
        with pytest.raises(TierError):
            t.put(key_of(1), frame_for(key_of(1)))
        assert t.put_many([(key_of(2), frame_for(key_of(2)))]) == [False]
        assert t.admitting and t.stats().errors == 2
        assert not temp_files(root) and not block_files(root)
        writes.failing = False
        assert t.put(key_of(1), frame_for(key_of(1)))


@pytest.fixture
def tiny_tmpfs(tmp_path: Path) -> Iterator[Path]:
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)],
                          capture_output=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_real_disk_full_on_a_tiny_tmpfs(tiny_tmpfs: Path) -> None:
    root = tiny_tmpfs / "nvme"
    filler = tiny_tmpfs / "filler"
    filler.write_bytes(b"\0" * (300 << 10))  # someone else's data, freed later
    keys = [key_of(i) for i in range(20)]
    frames = [frame_for(k, seg=25 << 10) for k in keys]  # ~100 KiB each
    with NvmeTier(root, 64 << 20, space_recheck_s=0.05, min_free_bytes=0) as t:
        stored = []
        for k, f in zip(keys, frames, strict=True):
            if not t.put(k, f):
                break
            stored.append(k)
        assert 2 <= len(stored) < len(keys) and not t.admitting
        assert not temp_files(root)
        assert len(block_files(root)) == len(stored)
        assert not t.put(keys[-1], frames[-1])
        for k in stored:  # reads keep working on a full disk
            got = t.get(k)
            assert got is not None and got.to_frame() == frame_for(k, seg=25 << 10)
        filler.unlink()
        time.sleep(0.06)
        assert t.put(keys[len(stored)], frames[len(stored)])
    with NvmeTier(root, 64 << 20) as t:  # nothing partial survived on disk either
        assert t.recovery.invalid_removed == 0 and t.recovery.temp_removed == 0
        assert t.stats().blocks == len(stored) + 1


# ------------------------------------------------------------------------- concurrency

def test_concurrent_readers_writers_deleters(root: Path) -> None:
    size = len(frame_for(key_of(0), seg=8192))
    keys = [key_of(i) for i in range(48)]
    frames = {k: frame_for(k, seg=8192) for k in keys}
    expected = {k: payload_of(f) for k, f in frames.items()}
    failures: list[str] = []
    stop = threading.Event()
    # A budget of 20 blocks for 48 keys keeps eviction busy under the readers.
    with NvmeTier(root, 20 * size) as t:
        def worker(body: Callable[[np.random.Generator], None], seed: int) -> None:
            rng = np.random.default_rng(seed)
            try:
                while not stop.is_set():
                    body(rng)
            except Exception as exc:  # any exception is a failure of the test
                failures.append(repr(exc))

        def write(rng: np.random.Generator) -> None:
            picks = [keys[int(i)] for i in rng.integers(0, len(keys), 3)]
            if rng.random() < 0.5:
                t.put(picks[0], frames[picks[0]])
            else:
                t.put_many([(k, frames[k]) for k in picks])

        def read(rng: np.random.Generator) -> None:
            k = keys[int(rng.integers(0, len(keys)))]
            out = bytearray(size)
            layers = LayerRange(1, 3) if rng.random() < 0.3 else None
            got = t.get(k, layers, out=out)
            if got is not None:
                want = payload_of(frames[k], layers) if layers else expected[k]
                if bytes(got.payload) != want:
                    failures.append(f"wrong bytes for {k.storage_name}")

        def delete(rng: np.random.Generator) -> None:
            t.delete([keys[int(rng.integers(0, len(keys)))]])
            time.sleep(0.002)

        threads = [threading.Thread(target=worker, args=(fn, n))
                   for n, fn in enumerate([write, write, read, read, read, delete])]
        for th in threads:
            th.start()
        time.sleep(2.0)
        stop.set()
        for th in threads:
            th.join()
        s = t.stats()
        assert not failures, failures[:5]
        assert s.corrupt == 0 and s.errors == 0 and s.hits > 50 and s.puts > 50
        assert s.bytes_used <= 20 * size
        on_disk = {p.stem for p in block_files(root)}
        assert on_disk == {k.storage_name for k in keys if t.contains([k])[0]}
        assert s.bytes_used == sum(p.stat().st_size for p in block_files(root))
        assert not temp_files(root)
