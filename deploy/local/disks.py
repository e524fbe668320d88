"""Small disks for a local cluster's daemons: a tmpfs mounted on a data dir (root only), so that
"the disk is full" is the kernel's ENOSPC and not a budget the daemon enforces on itself.

tmpfs rather than a loop device: it needs no image file, no mkfs and no losetup, is gone with
its mount, and returns ENOSPC exactly as a full ext4 does for the writes the daemon makes
(write, fallocate, rename). What it does not model is a slow disk: it is RAM.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
from pathlib import Path

from kvstore.errors import ConfigError, KVKeepError

__all__ = ["tmpfs_available", "mount_tmpfs", "unmount", "fill", "FILLER_NAME"]

FILLER_NAME = ".kvkeep-chaos-filler"
_CHUNK = 1 << 20


def tmpfs_available() -> str | None:
    """None when a tmpfs can be mounted here; else why not (for a clear skip message)."""
    if os.geteuid() != 0:
        return "mounting a tmpfs needs root; this process is not root"
    if shutil.which("mount") is None or shutil.which("umount") is None:
        return "mount/umount are not installed"
    return None


def mount_tmpfs(path: Path, size_bytes: int) -> None:
    why = tmpfs_available()
    if why is not None:
        raise ConfigError(why)
    path.mkdir(parents=True, exist_ok=True)
    _run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes},mode=0755", "kvkeep-chaos",
          str(path)])


def unmount(path: Path) -> None:
    """Unmount (lazily: a process that still holds a file there must not block cleanup)."""
    if os.path.ismount(path):
        _run(["umount", "-l", str(path)])


def fill(directory: Path, keep_free: int = 0) -> int:
    """Write a filler file in `directory` until the file system is full (or `keep_free` bytes
    are left); returns the bytes written. Delete `directory / FILLER_NAME` to free them."""
    written = 0
    pattern = b"\xa5" * _CHUNK  # not zeros: a file system that dedups or compresses stays full
    fd = os.open(directory / FILLER_NAME, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC,
                 0o600)
    try:
        while True:
            st = os.statvfs(directory)
            room = st.f_bavail * st.f_frsize - keep_free
            if room <= 0:
                break
            try:
                written += os.write(fd, pattern[:min(_CHUNK, room)])
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                    break
                raise
    finally:
        os.close(fd)
    return written


def _run(argv: list[str]) -> None:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    if done.returncode != 0:
        raise KVKeepError(f"{' '.join(argv)}: {done.stderr.strip() or done.returncode}")
