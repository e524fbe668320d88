"""Crash-safe whole-file writes and range reads into caller buffers: the nvme tier's disk I/O.

A file is published with the classic protocol: write a temp file in the destination directory,
fdatasync it, rename it over its final name, fsync the directory. A crash at any moment leaves
either the old state or the complete new file under the final name, plus at worst a temp file
that the next start deletes. Readers still verify every byte (frame checksums), so even a
filesystem that breaks these promises degrades to a miss, never to wrong data.

Everything here raises plain OSError (or DeadlineExceeded, which callers must catch before
OSError: it is a TimeoutError); the tier translates OSError at its boundary. Kept free of tier
state so that tests can swap the low-level write (`WriteFn`) to inject faults such as ENOSPC.
"""

from __future__ import annotations

import contextlib
import errno
import os
import time
from collections.abc import Callable

from kvstore.errors import DeadlineExceeded

__all__ = [
    "WriteFn",
    "TEMP_SUFFIX",
    "WRITE_CHUNK_BYTES",
    "READ_CHUNK_BYTES",
    "write_chunked",
    "create_temp",
    "finish_temp",
    "discard_temp",
    "read_into",
    "drop_cache",
    "is_space_error",
]

WriteFn = Callable[[int, memoryview], None]
"""Writes all of a buffer to a file descriptor at its current offset, or raises OSError."""

TEMP_SUFFIX = ".tmp"

# Measured on this machine's virtio disk with 4 MiB blocks (medians of noisy runs): one 4 MiB
# write + fsync ~1.3-1.8 GB/s, 1 MiB writes that each start their own writeback ~2.3 GB/s,
# because the disk works on the first MiB while Python copies the next into the page cache.
WRITE_CHUNK_BYTES = 1 << 20
# Cold reads: one 4 MiB pread ~1.0 GB/s, 512 KiB preads ~1.7 GB/s (the first read starts
# readahead for the rest, which then overlaps with copying out the previous chunk).
READ_CHUNK_BYTES = 512 << 10

_SPACE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})


def is_space_error(exc: OSError) -> bool:
    """Disk full or quota exhausted: a reason to stop admitting, not a failure of the tier."""
    return exc.errno in _SPACE_ERRNOS


def drop_cache(fd: int, offset: int = 0, length: int = 0) -> None:
    """Drop clean cached pages of a range and start writeback of its dirty ones.

    The host tier is the RAM cache; keeping a second copy of every block in the page cache would
    only push out memory that matters. On Linux DONTNEED also starts asynchronous writeback of
    dirty pages in the range, which `write_chunked` uses to overlap disk and CPU work.
    """
    os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)


def write_chunked(fd: int, data: memoryview, chunk: int = WRITE_CHUNK_BYTES) -> None:
    """The default WriteFn: write everything, starting writeback behind each chunk."""
    offset, total = 0, len(data)
    while offset < total:
        written = os.write(fd, data[offset: offset + chunk])
        if written <= 0:  # a regular file never does this, but a loop must not spin on it
            raise OSError(errno.EIO, "write made no progress")
        drop_cache(fd, offset, written)
        offset += written


def create_temp(dir_fd: int, final_name: str, serial: int) -> tuple[str, int]:
    """Create an exclusive temp file next to `final_name`; returns (temp name, fd)."""
    temp_name = f".{final_name}.{os.getpid()}.{serial}{TEMP_SUFFIX}"
    fd = os.open(temp_name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644,
                 dir_fd=dir_fd)
    return temp_name, fd


def finish_temp(fd: int, *, durable: bool) -> None:
    """Make a written temp file's bytes durable (before its rename), drop its pages, close it.

    fdatasync is enough: it persists the data and the size, which is all a new file needs; the
    name becomes durable with the directory fsync after the rename.
    """
    try:
        if durable:
            os.fdatasync(fd)
        drop_cache(fd)
    finally:
        os.close(fd)


def discard_temp(dir_fd: int, temp_name: str, fd: int | None) -> None:
    """Best-effort cleanup after a failed write; never raises (the first error is what counts)."""
    if fd is not None:
        with contextlib.suppress(OSError):
            os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(temp_name, dir_fd=dir_fd)


def read_into(fd: int, out: memoryview, offset: int, *, deadline: float | None = None,
              chunk: int = READ_CHUNK_BYTES) -> int:
    """Fill `out` from file offset `offset` in chunks; returns bytes read (short at EOF).

    Checks `deadline` between chunks and raises DeadlineExceeded past it, so one slow read cannot
    hold a caller far beyond its budget.
    """
    done, total = 0, len(out)
    while done < total:
        if deadline is not None and done and time.monotonic() > deadline:
            raise DeadlineExceeded("read ran past its deadline")
        got = os.preadv(fd, [out[done: done + chunk]], offset + done)
        if got == 0:
            break
        done += got
    return done
