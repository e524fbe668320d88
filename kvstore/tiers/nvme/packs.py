"""Pack files: the nvme tier's blocks appended to a few large files instead of a file each.

    <root>/packs/<serial:08x>.kvp     frames at 4 KiB-aligned offsets, nothing else

Why: a file per block cost its create, rename and directory entry, and with `durable` a
fdatasync each. For 256 KiB blocks that was most of a put's disk time: a bare loop here wrote
1.3-1.6 GB/s as files (0.16-0.20 ms of CPU a block) and 3.1-3.7 GB/s appended to one file
(0.04-0.08 ms), and a durable batch now needs one fdatasync, not one per block.

A block is one frame, written whole at an aligned offset of the active pack: frames describe
themselves (key digest, size, checksums), so a pack needs no index of its own and the start-up
scan (recovery.py) finds every block by walking the pack's data. A new pack is started when the
active one passes `PACK_BYTES`, and at every start (packs are never appended to after a
restart, so a torn tail is only ever at the end of an old pack, where the scan skips it).

Removing a block punches a hole over its pages (fallocate PUNCH_HOLE | KEEP_SIZE): the disk
space returns at once, and the next scan finds nothing there, so a deleted block does not come
back after a restart. Where the filesystem cannot punch holes, the block's first page is
zeroed instead (the scan then finds no frame there) and its space returns with its pack. A
pack whose last block has gone, and that no write still targets, is unlinked.

Not thread-safe by itself: the tier calls every method under its lock; the data itself is
written and read through fds of the caller's own (`name`), outside that lock.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import os
import re
from collections import Counter
from collections.abc import Iterable

__all__ = ["PACK_BYTES", "PACK_SUFFIX", "RECORD_ALIGN", "Location", "PackFiles",
           "aligned", "pack_name", "pack_serial"]

log = logging.getLogger(__name__)

PACK_SUFFIX = ".kvp"
RECORD_ALIGN = 4096
"""Every frame starts on a page: a hole punched over one block never touches another."""
PACK_BYTES = 64 << 20
"""A pack's size before the next one starts: big enough that creating packs costs nothing
measurable, small enough that a pack whose blocks have all gone frees its space soon where
holes cannot be punched."""

_NAME_RE = re.compile(r"([0-9a-f]{8})" + re.escape(PACK_SUFFIX))
_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02

Location = tuple[int, int]
"""(pack serial, byte offset) of a frame."""


def aligned(size: int) -> int:
    """`size` rounded up to the record alignment."""
    return -(-size // RECORD_ALIGN) * RECORD_ALIGN


def pack_name(serial: int) -> str:
    return f"{serial:08x}{PACK_SUFFIX}"


def pack_serial(name: str) -> int | None:
    """The serial of a pack file's name, None for any other name."""
    match = _NAME_RE.fullmatch(name)
    return int(match.group(1), 16) if match else None


def _load_fallocate() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    path = ctypes.util.find_library("c")
    if path is None:
        return None
    fn = ctypes.CDLL(path, use_errno=True).fallocate
    fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    fn.restype = ctypes.c_int
    return fn


_fallocate = _load_fallocate()


def free_range(fd: int, offset: int, length: int) -> bool:
    """Punch a hole over [offset, offset + length) of an open pack; False where the filesystem
    cannot (the caller then zeroes the record's first page). Raises OSError on other errors."""
    if _fallocate is None:
        return False
    if _fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, offset, length) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EOPNOTSUPP, errno.ENOSYS):
        return False
    raise OSError(err, f"cannot punch a hole in a pack: {os.strerror(err)}")


class PackFiles:
    """The packs of one data directory: which is active, how far it is written, and how many
    blocks (committed, and placed but not yet committed) each still holds.

    Bookkeeping runs under the tier's lock; the disk work it decides (punching the holes of
    removed blocks, unlinking empty packs) is queued and done by `release`, which the tier
    calls after letting go of its lock: a hole punch waits on the filesystem's journal
    (0.37 ms a 256 KiB block here, 0.16 for runs of 32), and readers and writers must not wait
    behind it. The queued ranges are merged where they touch, so an LRU eviction of blocks
    written one after the other is one punch. Nothing can be placed in a freed range again
    (packs only grow), so doing this late is safe.
    """

    def __init__(self, dir_fd: int, *, durable: bool, serials: Iterable[int] = ()) -> None:
        self.dir_fd = dir_fd
        self._durable = durable
        self._live: Counter[int] = Counter({serial: 0 for serial in serials})
        self._pending: Counter[int] = Counter()
        self._next = max(self._live, default=0) + 1
        self._active = -1
        self._end = 0
        self._frees: list[tuple[int, int, int]] = []  # (serial, offset, length)
        self._unlinks: list[int] = []
        self.holes_unsupported = False
        self.free_errors = 0

    def place(self, size: int) -> Location:
        """Where the next frame of `size` bytes goes; starts a pack when the active one is full
        (OSError if it cannot be created). The caller must `commit` or `abandon` it."""
        if self._active < 0 or self._end >= PACK_BYTES:
            self._start_pack()
        location = (self._active, self._end)
        self._end += aligned(size)
        self._pending[self._active] += 1
        return location

    def commit(self, serial: int) -> None:
        """A placed frame is written (and synced, if durable) and indexed."""
        self._pending[serial] -= 1
        self._live[serial] += 1

    def abandon(self, serial: int, offset: int, size: int) -> None:
        """A placed frame was not written whole: free what of it reached the disk."""
        self._pending[serial] -= 1
        self._frees.append((serial, offset, aligned(size)))
        self._unlink_if_empty(serial)

    def loaded(self, serial: int) -> None:
        """A block the start-up scan found."""
        self._live[serial] += 1

    def remove(self, serial: int, offset: int, size: int) -> None:
        """A committed block left the index: free its pages, and its pack once empty."""
        self._live[serial] -= 1
        self._frees.append((serial, offset, aligned(size)))
        self._unlink_if_empty(serial)

    def free_stale(self, serial: int, offset: int, size: int) -> None:
        """Free an older copy of a block the start-up scan found twice (the later one counts)."""
        self._frees.append((serial, offset, aligned(size)))

    def drop_empty(self) -> None:
        """Unlink every pack without blocks (after the start-up scan)."""
        for serial in list(self._live):
            self._unlink_if_empty(serial)

    def take_work(self) -> tuple[list[tuple[int, int, int]], list[int]]:
        """The frees and unlinks queued since the last call, for `release` (under the lock)."""
        work = (self._frees, self._unlinks)
        self._frees, self._unlinks = [], []
        return work

    def release(self, work: tuple[list[tuple[int, int, int]], list[int]]) -> None:
        """Do the disk work `take_work` handed over (outside the tier's lock). A failure is
        logged and counted (`free_errors`): the blocks are already out of the index, so they
        are never served from here; at worst the next start finds one again, a verified
        frame."""
        frees, unlinks = work
        gone = set(unlinks)
        runs: list[tuple[int, int, int, list[int]]] = []  # serial, offset, length, frame starts
        for serial, offset, length in sorted(f for f in frees if f[0] not in gone):
            if runs and runs[-1][0] == serial and runs[-1][1] + runs[-1][2] == offset:
                last = runs[-1]
                runs[-1] = (serial, last[1], last[2] + length, [*last[3], offset])
            else:
                runs.append((serial, offset, length, [offset]))
        for serial, offset, length, starts in runs:
            self._free(serial, offset, length, starts)
        for serial in unlinks:
            try:
                os.unlink(pack_name(serial), dir_fd=self.dir_fd)
            except FileNotFoundError:
                continue
            except OSError as exc:  # its blocks are all gone: only the disk space is lost
                self._free_failed(serial, exc)

    def _start_pack(self) -> None:
        serial = self._next
        fd = os.open(pack_name(serial), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC,
                     0o644, dir_fd=self.dir_fd)
        os.close(fd)
        if self._durable:  # the pack's name before any block in it counts as durable
            os.fsync(self.dir_fd)
        self._next += 1
        previous, self._active, self._end = self._active, serial, 0
        self._live[serial] += 0
        if previous >= 0:
            self._unlink_if_empty(previous)

    def _free(self, serial: int, offset: int, length: int, starts: list[int]) -> None:
        """Make the frames starting at `starts` in a range unfindable, and give back the
        range's pages where the filesystem can."""
        try:
            fd = os.open(pack_name(serial), os.O_WRONLY | os.O_CLOEXEC, dir_fd=self.dir_fd)
        except FileNotFoundError:
            return
        except OSError as exc:
            self._free_failed(serial, exc)
            return
        try:
            if self.holes_unsupported or not free_range(fd, offset, length):
                self.holes_unsupported = True
                # The scan must not find these frames again: zero each one's first page.
                zeros = bytes(RECORD_ALIGN)
                for start in starts:
                    os.pwrite(fd, zeros, start)
        except OSError as exc:
            self._free_failed(serial, exc)
        finally:
            os.close(fd)

    def _free_failed(self, serial: int, exc: OSError) -> None:
        self.free_errors += 1
        log.warning("nvme pack %s: cannot free a removed block or pack: %s", pack_name(serial),
                    exc)

    def _unlink_if_empty(self, serial: int) -> None:
        if serial == self._active or self._live[serial] > 0 or self._pending[serial] > 0:
            return
        del self._live[serial]
        self._pending.pop(serial, None)
        self._unlinks.append(serial)
