"""The `nvme` tier: blocks and session manifests as files on local disk, crash safe.

Files (laid out by layout.py) are published with temp + fdatasync + rename + directory fsync
(durable_files), so a block is either complete under its final name or absent; the start-up
scan (recovery.py) deletes leftovers and any file whose header does not verify. Every read
verifies the segments it returns and the key binding (and returns the read marked verified, so
the store and decoding do not hash it again), so even a filesystem that broke its promises
yields a miss, never wrong KV.

Durability: `put` fsyncs its block before returning True, because that is the moment the
connector may drop its own copy. `put_many` gives each block the same guarantee but orders the
work as all writes, then all fdatasyncs, then the renames, then one fsync per directory, so the
disk works on one file while Python copies the next (measured 1.1-1.5x a loop of `put`); the
write-behind queue should call it. `durable=False` skips the fsyncs for scratch caches: a power
loss then loses blocks but still never serves wrong ones.

Concurrency: one lock guards the index and counters; file I/O runs outside it except the short
rename/unlink metadata calls, which run under it so that a reader that finds a corrupt file
never deletes a fresh one that replaced it. A file unlinked while a reader has it open stays
readable (POSIX), so eviction never breaks a read in progress.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from kvstore.errors import (
    ConfigError,
    CorruptBlock,
    DeadlineExceeded,
    TierError,
    TierFull,
    TierUnavailable,
)
from kvstore.frame import BlockRead, FrameBytes, LayerRange, checked_frame
from kvstore.keys import BlockKey, SessionKey
from kvstore.manifest import SessionRecord
from kvstore.tiers.base import Buffer, TierStats
from kvstore.tiers.nvme.block_index import Admission, BlockIndex, IndexEntry
from kvstore.tiers.nvme.disk_space import SpaceGuard
from kvstore.tiers.nvme.durable_files import (
    WriteFn,
    create_temp,
    discard_temp,
    finish_temp,
    is_space_error,
    write_chunked,
)
from kvstore.tiers.nvme.layout import open_and_scan
from kvstore.tiers.nvme.manifest_files import ManifestFiles
from kvstore.tiers.nvme.reads import read_block
from kvstore.tiers.nvme.recovery import RecoveryReport

__all__ = ["NvmeTier", "RecoveryReport", "FrameBytes"]

log = logging.getLogger(__name__)


# How many written-but-not-yet-synced temp files put_many keeps open at once.
_BATCH_WINDOW = 16


@dataclass(frozen=True, slots=True)
class _Pending:
    """One block between the creation of its temp file and its publication."""

    index: int
    digest: bytes
    entry: IndexEntry
    temp_name: str
    fd: int


class NvmeTier:
    """Blocks as files under `data_dir`, LRU within `byte_budget` bytes of frames.

    After a disk-full error (ENOSPC, EDQUOT), or when the filesystem has less than
    `min_free_bytes` free beyond the offered frame (at most 1/16 of the filesystem and of
    `byte_budget`, see disk_space.py; asked at most every `space_recheck_s`, so a disk filled
    by others is seen before a write fails), puts return False until this tier
    frees space itself (delete, eviction) or the filesystem has room again; reads go on
    meanwhile, and `admitting` says which it is now. `write_fn` replaces
    the low-level write, for fault injection in tests. Session manifests have their own budget,
    `manifest_budget` bytes (default 1/16 of `byte_budget`, at least 16 MiB; least recently used
    deleted first).
    """

    def __init__(self, data_dir: str | os.PathLike[str], byte_budget: int, *,
                 name: str = "nvme", durable: bool = True, drop_page_cache: bool = True,
                 verify_on_put: bool = True, space_recheck_s: float = 2.0,
                 min_free_bytes: int = 64 << 20, write_fn: WriteFn | None = None,
                 manifest_budget: int | None = None,
                 manifest_tenant_share: float = 1.0) -> None:
        if byte_budget <= 0:
            raise ConfigError(f"nvme byte budget must be positive, got {byte_budget}")
        self._name = name
        self._root = Path(data_dir)
        self._durable = durable
        self._drop_cache = drop_page_cache
        self._verify_on_put = verify_on_put
        self._write: WriteFn = write_fn or write_chunked
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._index = BlockIndex(byte_budget)
        self._serial = 0
        self._active = 0
        self._closed = False
        self._space = SpaceGuard(self._root, recheck_s=space_recheck_s,
                                 min_free_bytes=min_free_bytes, budget_bytes=byte_budget)
        self._removal_listeners: list[Callable[[Sequence[bytes]], None]] = []
        self._hits = self._misses = self._puts = self._rejected = 0
        self._corrupt = self._errors = 0
        self._layout, found = open_and_scan(self._root, durable=durable)
        self._recovery = found.report
        self._index.load(found.entries)
        with self._lock:  # a smaller budget than last time: shed the oldest blocks now
            self._unlink_victims(self._index.evict_to(byte_budget))
        self._corrupt = found.report.invalid_removed
        self._errors = found.report.unreadable
        self._manifests = ManifestFiles(
            self._layout.manifest_dirs, durable=durable, write_fn=self._write,
            on_corrupt=self._count_corrupt,
            byte_budget=(manifest_budget if manifest_budget is not None
                         else max(16 << 20, byte_budget // 16)),
            tenant_share=manifest_tenant_share)
        if found.report.temp_removed or found.report.invalid_removed:
            log.warning("nvme tier %s recovered: %s", self._root, found.report)

    # ----------------------------------------------------------------------------- public API

    @property
    def name(self) -> str:
        return self._name

    @property
    def data_dir(self) -> Path:
        return self._root

    @property
    def recovery(self) -> RecoveryReport:
        """What the start-up scan found, deleted and skipped."""
        return self._recovery

    def limit_manifests_per_tenant(self, share: float) -> None:
        """Let one tenant's manifests fill at most `share` of the manifest budget (M7)."""
        self._manifests.tenant_share = share

    @property
    def admitting(self) -> bool:
        """False while writes are refused for want of space: asks the filesystem now (one
        statvfs, without the tier's lock), so that a caller about to acknowledge a write knows
        the disk has room."""
        return self._space.allows(0, fresh=True)

    def subscribe_removals(self, listener: Callable[[Sequence[bytes]], None]) -> None:
        """Call `listener(digests)` with the key digests of blocks that left this tier
        (evicted, deleted, found corrupt or gone), after the call that removed them, outside
        the tier's lock. Exceptions it raises are logged and dropped."""
        with self._lock:
            self._removal_listeners.append(listener)

    @property
    def indexed_in_process(self) -> bool:
        return True  # `contains` reads the in-memory index, never the disk (IndexedInProcess)

    def contains(self, keys: Sequence[BlockKey]) -> list[bool]:
        with self._lock:
            self._check_open()
            return [key.digest in self._index for key in keys]

    def get(self, key: BlockKey, layers: LayerRange | None = None, *,
            out: Buffer | None = None, deadline: float | None = None) -> BlockRead | None:
        """Read and verify a block, or the segments of `layers`; None on a miss.

        Reads the header, then only the byte range of the wanted segments, straight into the
        first bytes of `out` when given (the payload is then a view of them). Raises
        CorruptBlock (after deleting the file), DeadlineExceeded or TierUnavailable; ValueError
        if `out` is too small or `layers` goes past the block's layers.
        """
        if deadline is not None and time.monotonic() > deadline:
            raise DeadlineExceeded("nvme get started past its deadline")
        digest = key.digest
        with self._operation():
            with self._lock:
                entry = self._index.lookup(digest)
                if entry is None:
                    self._misses += 1
                    return None
            dir_fd, file_name = self._block_path(digest)
            try:
                fd = os.open(file_name, os.O_RDONLY | os.O_CLOEXEC, dir_fd=dir_fd)
            except FileNotFoundError:
                self._forget(digest, entry)  # removed behind our back: a miss, not an error
                return None
            except OSError as exc:
                self._count_error()
                raise TierUnavailable(f"cannot open block {file_name}: {exc}") from exc
            try:
                result = read_block(fd, digest, entry, layers, out, deadline=deadline,
                                    drop_page_cache=self._drop_cache)
            except CorruptBlock:
                self._discard_corrupt(fd, digest, entry)
                raise
            except DeadlineExceeded:  # a TimeoutError, hence an OSError: keep it apart
                raise
            except OSError as exc:
                self._count_error()
                raise TierUnavailable(f"cannot read block {file_name}: {exc}") from exc
            finally:
                os.close(fd)
            with self._lock:
                self._hits += 1
            return result

    def put(self, key: BlockKey, frame: FrameBytes) -> bool:
        """Store a frame durably; False if not admitted (budget, disk full). Idempotent.

        Raises InvalidFrame if the frame does not parse, fails its checksums or is bound to
        another key, and TierError if the disk fails in another way than running full.
        """
        results, error = self._put_batch([(key, frame)])
        if error is not None:
            raise TierError(f"nvme write failed: {error}") from error
        return results[0]

    def put_many(self, items: Sequence[tuple[BlockKey, FrameBytes]]) -> list[bool]:
        """Store several frames with the guarantees of `put`, syncing them as one batch.

        Every frame is validated (InvalidFrame) before anything is written. Returns one flag per
        item; an item whose write failed is False and counted in `stats().errors`.
        """
        return self._put_batch(items)[0]

    def delete(self, keys: Sequence[BlockKey]) -> int:
        """Remove blocks; returns how many were stored. A put still in flight is not undone."""
        with self._operation(), self._lock:
            victims = [key.digest for key in keys if self._index.remove(key.digest)]
            self._unlink_victims(victims)
        return len(victims)

    def put_manifest(self, record: SessionRecord) -> None:
        """Store a session's record unless a newer generation is stored (an equal one
        overwrites).

        Raises TierFull when the disk is full, TierError on other disk failures.
        """
        with self._operation():
            try:
                self._manifests.put(record)
            except OSError as exc:
                if is_space_error(exc):
                    raise TierFull(f"disk full writing a manifest: {exc}") from exc
                self._count_error()
                raise TierError(f"cannot write a manifest: {exc}") from exc

    def get_manifest(self, key: SessionKey) -> SessionRecord | None:
        """The stored record or None; raises CorruptBlock (after deleting it) if it is bad."""
        with self._operation():
            try:
                return self._manifests.get(key)
            except OSError as exc:
                self._count_error()
                raise TierUnavailable(f"cannot read a manifest: {exc}") from exc

    def delete_manifest(self, key: SessionKey) -> bool:
        with self._operation():
            try:
                return self._manifests.delete(key)
            except OSError as exc:
                self._count_error()
                raise TierError(f"cannot delete a manifest: {exc}") from exc

    def stats(self) -> TierStats:
        with self._lock:
            return TierStats(
                name=self._name, blocks=len(self._index), bytes_used=self._index.used,
                bytes_budget=self._index.budget, hits=self._hits, misses=self._misses,
                puts=self._puts, rejected_puts=self._rejected, corrupt=self._corrupt,
                errors=self._errors, evictions=self._index.evicted)

    def close(self) -> None:
        """Wait for calls in progress, then release the directory. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            while self._active:
                self._idle.wait()
        self._layout.close()

    def __enter__(self) -> NvmeTier:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ------------------------------------------------------------------------------- writing

    def _put_batch(self, items: Sequence[tuple[BlockKey, FrameBytes]]
                   ) -> tuple[list[bool], OSError | None]:
        """Validate all, then write in windows; returns the flags and the first hard error."""
        # Checking the segments too (~50 us per 4 MiB, ~2 % of the write) keeps a frame
        # corrupted in memory from being made durable.
        checked: list[tuple[bytes, memoryview, int]] = []
        for key, frame in items:
            view, header = checked_frame(frame, key.digest, segments=self._verify_on_put)
            checked.append((key.digest, view, header.header_size))
        results = [False] * len(checked)
        first_error: OSError | None = None
        with self._operation():
            for start in range(0, len(checked), _BATCH_WINDOW):
                window = checked[start: start + _BATCH_WINDOW]
                first_error = self._put_window(window, start, results) or first_error
        return results, first_error

    def _put_window(self, window: list[tuple[bytes, memoryview, int]], offset: int,
                    results: list[bool]) -> OSError | None:
        """Write, sync, publish a window of blocks; fills `results`, returns a hard error."""
        written: list[_Pending] = []
        error: OSError | None = None
        for i, (digest, view, header_size) in enumerate(window, offset):
            admission = self._admit(digest, len(view))
            if admission is not Admission.RESERVED:
                results[i] = admission is Admission.PRESENT
                continue
            dir_fd, file_name = self._block_path(digest)
            temp_name, fd = "", None
            try:
                temp_name, fd = create_temp(dir_fd, file_name, self._next_serial())
                self._write(fd, view)
            except OSError as exc:
                if temp_name:
                    discard_temp(dir_fd, temp_name, fd)
                error = self._write_failed(digest, len(view), exc) or error
                continue
            written.append(_Pending(i, digest, IndexEntry(len(view), header_size), temp_name, fd))
        synced: list[_Pending] = []
        for item in written:
            try:
                finish_temp(item.fd, durable=self._durable)  # closes the fd, even on failure
            except OSError as exc:
                discard_temp(self._block_path(item.digest)[0], item.temp_name, None)
                error = self._write_failed(item.digest, item.entry.size, exc) or error
                continue
            synced.append(item)
        for dir_fd in self._publish(synced, results):
            try:
                os.fsync(dir_fd)
            except OSError as exc:
                self._count_error()
                error = error or exc
        return error

    def _publish(self, synced: list[_Pending], results: list[bool]) -> set[int]:
        """Rename synced temp files to their final names and index them; returns dirs to sync."""
        dirs: set[int] = set()
        with self._lock:
            for item in synced:
                dir_fd, file_name = self._block_path(item.digest)
                try:
                    os.rename(item.temp_name, file_name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
                except OSError as exc:
                    discard_temp(dir_fd, item.temp_name, None)
                    self._index.release(item.digest, item.entry.size)
                    self._note_failure(exc)
                    continue
                self._index.commit(item.digest, item.entry)
                self._puts += 1
                results[item.index] = True
                dirs.add(dir_fd)
        return dirs if self._durable else set()

    def _admit(self, digest: bytes, size: int) -> Admission:
        """Admission control: refuse while the disk is full, else reserve (evicting LRU)."""
        with self._lock:
            self._check_open()
            if not self._space.allows(size):
                if digest in self._index:
                    return Admission.PRESENT
                self._rejected += 1
                return Admission.REJECTED
            admission, victims = self._index.reserve(digest, size)
            self._unlink_victims(victims)
            if admission is Admission.REJECTED:
                self._rejected += 1
            return admission

    def _write_failed(self, digest: bytes, size: int, exc: OSError) -> OSError | None:
        """Undo a reservation; returns the error unless it was the disk running full."""
        with self._lock:
            self._index.release(digest, size)
            self._note_failure(exc)
        return None if is_space_error(exc) else exc

    def _note_failure(self, exc: OSError) -> None:
        """Count a failed write; a full disk stops admission instead. Caller holds the lock."""
        if is_space_error(exc):
            self._rejected += 1
            self._space.note_full(exc)
        else:
            self._errors += 1

    # ------------------------------------------------------------------------------ plumbing

    def _unlink_victims(self, digests: list[bytes]) -> None:
        """Delete the files of blocks dropped from the index. Caller holds the lock."""
        for digest in digests:
            dir_fd, file_name = self._block_path(digest)
            try:
                os.unlink(file_name, dir_fd=dir_fd)
            except FileNotFoundError:
                pass
            except OSError as exc:
                self._errors += 1
                log.warning("nvme tier %s: cannot delete %s: %s", self._root, file_name, exc)
        if digests:
            self._space.freed()

    def _discard_corrupt(self, fd: int, digest: bytes, entry: IndexEntry) -> None:
        """Delete a block that failed verification, unless a fresh file has replaced it."""
        dir_fd, file_name = self._block_path(digest)
        try:
            ours = os.fstat(fd)
        except OSError:
            ours = None
        with self._lock:
            self._corrupt += 1
            self._index.remove(digest, expected=entry)
            try:
                on_disk = os.stat(file_name, dir_fd=dir_fd)
                if ours is not None and (on_disk.st_ino, on_disk.st_dev) == (ours.st_ino,
                                                                             ours.st_dev):
                    os.unlink(file_name, dir_fd=dir_fd)
            except OSError:
                pass  # gone already, or undeletable: either way the index no longer serves it
        log.warning("nvme tier %s: deleted corrupt block %s", self._root, file_name)

    def _forget(self, digest: bytes, entry: IndexEntry) -> None:
        with self._lock:
            self._misses += 1
            self._index.remove(digest, expected=entry)

    def _block_path(self, digest: bytes) -> tuple[int, str]:
        return self._layout.block_path(digest)

    def _next_serial(self) -> int:
        with self._lock:
            self._serial += 1
            return self._serial

    def _count_error(self) -> None:
        with self._lock:
            self._errors += 1

    def _count_corrupt(self) -> None:
        with self._lock:
            self._corrupt += 1

    def _check_open(self) -> None:
        if self._closed:
            raise TierUnavailable(f"nvme tier {self._root} is closed")

    @contextmanager
    def _operation(self) -> Iterator[None]:
        """Track calls in progress so that close() never closes a directory fd under them."""
        with self._lock:
            self._check_open()
            self._active += 1
        try:
            yield
        finally:
            with self._lock:
                self._active -= 1
                if not self._active:
                    self._idle.notify_all()
                removed = self._index.drain_removed()
                listeners = self._removal_listeners if removed else []
            for listener in listeners:
                try:
                    listener(removed)
                except Exception:
                    log.exception("nvme tier %s: a removal listener failed", self._root)
