"""Session records (KV manifests or conversation records, kvstore/manifest.py) as small
crash-safe files, one per session, that never roll back.

`put` reads the stored generation and writes only if the offered one is not older, under a lock
per shard, so two threads can never interleave "read generation" and "write". Across processes
the nvme tier's directory lock guarantees a single writer. Raises OSError for the caller to
translate; a manifest that fails to decode is deleted and reported as CorruptBlock.

Their bytes are bounded by `byte_budget`: past it the least recently used manifests (written
or read; on start, by file time) are deleted. Each tenant's manifests are also bounded by
`tenant_share` of it: past that, the tenant's own least recently used go, never another's, so
one tenant writing many big manifests cannot evict everyone's session records (M7). Manifests
found on start are not read, so their tenant is unknown: they count against the whole budget
only, until written again. A session whose manifest went can still restore its blocks by
prefix; only the manifest's own record of it is gone.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence

from kvstore.errors import CorruptBlock
from kvstore.keys import SessionKey
from kvstore.manifest import SessionRecord, decode_session_record
from kvstore.tiers.nvme.durable_files import (
    WriteFn,
    create_temp,
    discard_temp,
    finish_temp,
    read_into,
)
from kvstore.tiers.nvme.recovery import MANIFEST_SUFFIX

__all__ = ["ManifestFiles"]

log = logging.getLogger(__name__)

_File = tuple[int, str]  # (shard, file name)


class ManifestFiles:
    def __init__(self, dir_fds: Sequence[int], *, durable: bool, write_fn: WriteFn,
                 on_corrupt: Callable[[], None], byte_budget: int,
                 tenant_share: float = 1.0) -> None:
        self._dirs = tuple(dir_fds)
        self._locks = tuple(threading.Lock() for _ in self._dirs)
        self._durable = durable
        self._write = write_fn
        self._on_corrupt = on_corrupt
        self._serial = itertools.count()
        self._budget = byte_budget
        # Sizes of the stored manifests, least recently used first. Its lock is taken inside a
        # shard's lock, never the other way round.
        self._lru: OrderedDict[_File, int] = OrderedDict()
        self._lru_lock = threading.Lock()
        self._bytes = 0
        self._tenant_share = tenant_share
        self._tenant_of: dict[_File, str] = {}
        self._tenant_bytes: dict[str, int] = {}
        self.evicted = 0
        self._load_index()
        self._evict()

    def put(self, record: SessionRecord) -> bool:
        """Store unless a newer generation is stored; True if written (equal overwrites)."""
        data = memoryview(record.encode())
        shard = self._shard(record.key)
        dir_fd, name = self._dirs[shard], record.key.storage_name + MANIFEST_SUFFIX
        with self._locks[shard]:
            try:
                current = self._load(dir_fd, name, record.key)
            except CorruptBlock:
                current = None  # deleted and counted; the new one takes its place
            if current is not None and current.generation > record.generation:
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
            self._touch((shard, name), len(data), record.key.namespace.tenant)
        self._evict(record.key.namespace.tenant)
        return True

    def get(self, key: SessionKey) -> SessionRecord | None:
        shard = self._shard(key)
        name = key.storage_name + MANIFEST_SUFFIX
        with self._locks[shard]:
            found = self._load(self._dirs[shard], name, key)
            if found is not None:
                with self._lru_lock:
                    if (shard, name) in self._lru:
                        self._lru.move_to_end((shard, name))
            return found

    def delete(self, key: SessionKey) -> bool:
        shard = self._shard(key)
        name = key.storage_name + MANIFEST_SUFFIX
        with self._locks[shard]:
            self._forget((shard, name))
            try:
                os.unlink(name, dir_fd=self._dirs[shard])
            except FileNotFoundError:
                return False
            return True

    @property
    def bytes_used(self) -> int:
        with self._lru_lock:
            return self._bytes

    def _load_index(self) -> None:
        found: list[tuple[int, _File, int]] = []
        for shard, dir_fd in enumerate(self._dirs):
            for name in os.listdir(dir_fd):
                if not name.endswith(MANIFEST_SUFFIX):
                    continue
                with contextlib.suppress(FileNotFoundError):
                    st = os.stat(name, dir_fd=dir_fd)
                    found.append((st.st_mtime_ns, (shard, name), st.st_size))
        found.sort()
        for _, file, size in found:
            self._lru[file] = size
            self._bytes += size

    @property
    def tenant_share(self) -> float:
        return self._tenant_share

    @tenant_share.setter
    def tenant_share(self, share: float) -> None:
        if not 0 < share <= 1:
            raise ValueError(f"a tenant's manifest share must be in (0, 1], got {share}")
        self._tenant_share = share

    def tenant_bytes(self, tenant: str) -> int:
        with self._lru_lock:
            return self._tenant_bytes.get(tenant, 0)

    def _touch(self, file: _File, size: int, tenant: str | None = None) -> None:
        with self._lru_lock:
            self._untenant(file)
            self._bytes += size - self._lru.get(file, 0)
            self._lru[file] = size
            self._lru.move_to_end(file)
            if tenant is not None:
                self._tenant_of[file] = tenant
                self._tenant_bytes[tenant] = self._tenant_bytes.get(tenant, 0) + size

    def _untenant(self, file: _File) -> None:
        """Drop `file` from its tenant's bytes. Caller holds the LRU lock."""
        tenant = self._tenant_of.pop(file, None)
        if tenant is None:
            return
        left = self._tenant_bytes.get(tenant, 0) - self._lru.get(file, 0)
        if left > 0:
            self._tenant_bytes[tenant] = left
        else:
            self._tenant_bytes.pop(tenant, None)

    def _forget(self, file: _File) -> None:
        with self._lru_lock:
            self._untenant(file)
            self._bytes -= self._lru.pop(file, 0)

    def _evict(self, tenant: str | None = None) -> None:
        """Delete least recently used manifests until they fit the budget (the newest stays),
        and `tenant`'s own until they fit its share (its newest stays)."""
        victims: list[_File] = []
        with self._lru_lock:
            share = int(self._budget * self._tenant_share)
            if tenant is not None and self._tenant_bytes.get(tenant, 0) > share:
                mine = [f for f in self._lru if self._tenant_of.get(f) == tenant]
                for file in mine[:-1]:  # oldest first; never its newest
                    if self._tenant_bytes.get(tenant, 0) <= share:
                        break
                    self._untenant(file)
                    self._bytes -= self._lru.pop(file)
                    victims.append(file)
            while self._bytes > self._budget and len(self._lru) > 1:
                file, _ = next(iter(self._lru.items()))
                self._untenant(file)
                self._bytes -= self._lru.pop(file)
                victims.append(file)
        for shard, name in victims:
            with self._locks[shard]:
                with self._lru_lock:
                    if (shard, name) in self._lru:
                        continue  # written again since it was picked: it is the newest now
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(name, dir_fd=self._dirs[shard])
            self.evicted += 1
        if victims:
            log.info("evicted %d session manifests over the %d-byte budget", len(victims),
                     self._budget)

    def _shard(self, key: SessionKey) -> int:
        return key.digest[0] % len(self._dirs)

    def _load(self, dir_fd: int, name: str, key: SessionKey) -> SessionRecord | None:
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
            return decode_session_record(memoryview(data)[:got], expected=key)
        except CorruptBlock:
            self._on_corrupt()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=dir_fd)
            self._forget((self._dirs.index(dir_fd), name))
            raise
