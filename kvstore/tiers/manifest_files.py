"""Session manifests as small crash-safe files, one per session, that never roll back.

`put` reads the stored generation and writes only if the offered one is not older, under a lock
per shard, so two threads can never interleave "read generation" and "write". Across processes
the nvme tier's directory lock guarantees a single writer. Raises OSError for the caller to
translate; a manifest that fails to decode is deleted and reported as CorruptBlock.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
from collections.abc import Callable, Sequence

from kvstore.errors import CorruptBlock
from kvstore.keys import SessionKey
from kvstore.manifest import SessionManifest
from kvstore.tiers.durable_files import (
    WriteFn,
    create_temp,
    discard_temp,
    finish_temp,
    read_into,
)
from kvstore.tiers.nvme_recovery import MANIFEST_SUFFIX

__all__ = ["ManifestFiles"]


class ManifestFiles:
    def __init__(self, dir_fds: Sequence[int], *, durable: bool, write_fn: WriteFn,
                 on_corrupt: Callable[[], None]) -> None:
        self._dirs = tuple(dir_fds)
        self._locks = tuple(threading.Lock() for _ in self._dirs)
        self._durable = durable
        self._write = write_fn
        self._on_corrupt = on_corrupt
        self._serial = itertools.count()

    def put(self, manifest: SessionManifest) -> bool:
        """Store unless a newer generation is stored; True if written (equal overwrites)."""
        data = memoryview(manifest.encode())
        shard = self._shard(manifest.key)
        dir_fd, name = self._dirs[shard], manifest.key.storage_name + MANIFEST_SUFFIX
        with self._locks[shard]:
            try:
                current = self._load(dir_fd, name, manifest.key)
            except CorruptBlock:
                current = None  # deleted and counted; the new one takes its place
            if current is not None and current.generation > manifest.generation:
                return False
            temp_name, fd = "", None
            try:
                temp_name, fd = create_temp(dir_fd, name, next(self._serial))
                self._write(fd, data)
                opened, fd = fd, None  # finish_temp closes it, even when it fails
                finish_temp(opened, durable=self._durable)
                os.rename(temp_name, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            except OSError:
                if temp_name:
                    discard_temp(dir_fd, temp_name, fd)
                raise
            if self._durable:
                os.fsync(dir_fd)
            return True

    def get(self, key: SessionKey) -> SessionManifest | None:
        shard = self._shard(key)
        with self._locks[shard]:
            return self._load(self._dirs[shard], key.storage_name + MANIFEST_SUFFIX, key)

    def delete(self, key: SessionKey) -> bool:
        shard = self._shard(key)
        with self._locks[shard]:
            try:
                os.unlink(key.storage_name + MANIFEST_SUFFIX, dir_fd=self._dirs[shard])
            except FileNotFoundError:
                return False
            return True

    def _shard(self, key: SessionKey) -> int:
        return key.digest[0] % len(self._dirs)

    def _load(self, dir_fd: int, name: str, key: SessionKey) -> SessionManifest | None:
        try:
            fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC, dir_fd=dir_fd)
        except FileNotFoundError:
            return None
        try:
            data = bytearray(os.fstat(fd).st_size)
            got = read_into(fd, memoryview(data), 0)
        finally:
            os.close(fd)
        try:
            return SessionManifest.decode(memoryview(data)[:got], expected=key)
        except CorruptBlock:
            self._on_corrupt()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=dir_fd)
            raise
