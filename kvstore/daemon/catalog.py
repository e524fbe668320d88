"""The daemon's catalog of the blocks it stores: their keys (for re-replication), their sizes
and tenants (for per-tenant stored-byte budgets).

Tiers index blocks by key digest and frames only carry that digest, but pushing a block to a
peer needs its full key (fingerprint, namespace, block hash): the peer verifies the frame against
it. So the daemon appends each block it stores to `keys.log` in its data dir and each delete as a
tombstone. On start the log is read up to the first torn or corrupt record (a crash mid-append),
compacted to the live keys, and rewritten atomically.

Bounded: the catalog follows the disk tier. The daemon subscribes it to the nvme tier's
removals (eviction, deletes, corrupt copies dropped: `forget`), so it holds an entry for a block
only while the disk holds the block, never one per block it ever stored (issue 13 item 11: a
daemon fed 46 GB of new blocks through a 512 MiB disk grew ~0.5 KB per block ever seen). The
log is compacted whenever it holds `_COMPACT_RATIO` times more records than live keys.

Full disks (ENOSPC, or any other write error): the catalog never fails a put. A failed append
is cut back off the log (ftruncate to the last whole record, so no torn record sits before later
ones), and the catalog is marked behind: it appends nothing more (a log with a gap in its
history would replay wrongly) and instead retries a compaction, which writes the whole live set,
at most every `_RETRY_S` seconds, until one succeeds. A compaction that fails leaves the old log
in place, whole. Meanwhile the in-memory catalog stays exact; what a crash in that window loses
is the log's record of the newest keys, whose blocks the other replicas hold too.

The log is written to the OS after every append, not fsync'd: a SIGKILL'd daemon loses nothing,
and after a power loss the few keys missing from the catalog are still held by their other
replicas, which will re-replicate them.

Record: u32 body length | 8-byte xxh3-64 of body | body = op | fingerprint (16) |
u8 namespace-label length | label | u8 hash length | block hash [| u64 frame size, op "S"].
Ops: "S" stored (with its size), "D" deleted, "P" stored (older logs, no size: counted as 0).
"""

from __future__ import annotations

import contextlib
import logging
import os
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

import xxhash

from kvstore.daemon.budgets import block_cost
from kvstore.errors import KVKeepError, TierError
from kvstore.keys import BlockHash, BlockKey, Namespace

__all__ = ["KeyCatalog"]

_log = logging.getLogger(__name__)

_HEAD = struct.Struct("<I8s")
_SIZE = struct.Struct("<Q")
_MAX_BODY = 1 + 16 + 1 + 255 + 1 + 255 + _SIZE.size
_STORED, _LEGACY_STORED, _DELETED = b"S", b"P", b"D"
# Compact when the log holds this many times more records than live keys.
_COMPACT_RATIO = 4
_MIN_COMPACT_RECORDS = 1024
# While the log is behind (a write failed), a compaction is retried at most this often.
_RETRY_S = 1.0


def _encode(op: bytes, key: BlockKey, size: int = 0) -> bytes:
    label = key.namespace.label.encode()
    parts = [op, key.fingerprint, bytes([len(label)]), label, bytes([len(key.block_hash)]),
             key.block_hash]
    if op == _STORED:
        parts.append(_SIZE.pack(size))
    body = b"".join(parts)
    return _HEAD.pack(len(body), xxhash.xxh3_64_digest(body)) + body


def _decode(body: bytes) -> tuple[bytes, BlockKey, int]:
    op, fingerprint = body[:1], body[1:17]
    label_len = body[17]
    label = body[18:18 + label_len].decode()
    pos = 18 + label_len
    hash_len = body[pos]
    block_hash = body[pos + 1:pos + 1 + hash_len]
    end = pos + 1 + hash_len
    size = 0
    if op == _STORED:
        (size,) = _SIZE.unpack_from(body, end)
        end += _SIZE.size
    if op not in (_STORED, _LEGACY_STORED, _DELETED) or len(block_hash) != hash_len \
            or end != len(body):
        raise ValueError("malformed catalog record")
    return op, BlockKey(fingerprint, Namespace.from_label(label), BlockHash(block_hash)), size


class KeyCatalog:
    """Thread-safe ledger of the blocks a daemon holds, persisted as an append-only log."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        # Per tenant, its blocks by digest in the order they were stored (oldest first): the
        # order a tenant over its stored-byte budget gives blocks up in.
        self._tenants: dict[str, OrderedDict[bytes, tuple[BlockKey, int]]] = {}
        self._tenant_of: dict[bytes, str] = {}
        self._tenant_bytes: dict[str, int] = {}
        self._tenant_cost: dict[str, int] = {}  # block_cost of each block (M4)
        self._records = 0
        self._fd = -1
        self._good_size = 0  # the log's bytes up to its last whole record
        self._behind = False  # an append failed: the log lacks changes the catalog holds
        self._retry_at = 0.0
        self.write_failures = 0
        """Appends or compactions that failed (a full disk), since start."""
        good = 0
        for op, key, size, end in self._read(path):
            good = end
            if op == _DELETED:
                self._remove(key.digest)
            else:
                self._insert(key, size)
        try:
            self._compact()
        except OSError as exc:  # a full disk at start: keep the log as it is, minus a torn tail
            self._note_failure("compact the key log at start", exc)
            self._open_for_append(truncate_to=good)

    # -- reading -----------------------------------------------------------------------------

    def __len__(self) -> int:
        with self._lock:
            return len(self._tenant_of)

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return isinstance(key, BlockKey) and key.digest in self._tenant_of

    def keys(self) -> list[BlockKey]:
        with self._lock:
            return [key for blocks in self._tenants.values() for key, _ in blocks.values()]

    def tenant_bytes(self, tenant: str) -> int:
        """Frame bytes of the blocks of `tenant` the daemon holds."""
        with self._lock:
            return self._tenant_bytes.get(tenant, 0)

    def tenant_cost(self, tenant: str) -> int:
        """What the blocks of `tenant` the daemon holds are charged (`block_cost` each)."""
        with self._lock:
            return self._tenant_cost.get(tenant, 0)

    def tenant_usage(self) -> dict[str, int]:
        with self._lock:
            return {t: n for t, n in self._tenant_bytes.items() if n}

    def oldest(self, tenant: str, nbytes: int) -> list[BlockKey]:
        """The oldest stored blocks of `tenant` whose sizes add up to at least `nbytes`."""
        out: list[BlockKey] = []
        with self._lock:
            for key, size in (self._tenants.get(tenant) or {}).values():
                if nbytes <= 0:
                    break
                out.append(key)
                nbytes -= max(size, 1)
        return out

    def tenant_blocks(self, tenant: str) -> int:
        """How many blocks of `tenant` the daemon holds."""
        with self._lock:
            return len(self._tenants.get(tenant) or ())

    def oldest_charged(self, tenant: str, over: int, cost: Callable[[int], int],
                       count: int = 0) -> list[BlockKey]:
        """The oldest stored blocks of `tenant` whose `cost(size)` add up to at least `over`,
        and at least `count` of them (M4: a tenant past its charged bytes or its block count)."""
        out: list[BlockKey] = []
        with self._lock:
            for key, size in (self._tenants.get(tenant) or {}).values():
                if over <= 0 and len(out) >= count:
                    break
                out.append(key)
                over -= cost(size)
        return out

    @property
    def behind(self) -> bool:
        """True while the log lacks changes (a write failed; a compaction will catch up)."""
        with self._lock:
            return self._behind

    # -- changes -----------------------------------------------------------------------------

    def add(self, blocks: Iterable[tuple[BlockKey, int]]) -> None:
        """Blocks now stored, with their frame sizes. Never raises (see the module doc)."""
        with self._lock:
            records = [_encode(_STORED, key, size) for key, size in blocks
                       if self._insert(key, size)]
            self._persist(records)

    def discard(self, keys: Iterable[BlockKey]) -> None:
        """Blocks deleted. Never raises."""
        with self._lock:
            self._persist([_encode(_DELETED, key) for key in keys if self._remove(key.digest)])

    def forget(self, digests: Sequence[bytes]) -> None:
        """Blocks the disk tier dropped (by key digest): its removal listener."""
        with self._lock:
            records = []
            for digest in digests:
                tenant = self._tenant_of.get(digest)
                if tenant is None:
                    continue
                key, _ = self._tenants[tenant][digest]
                self._remove(digest)
                records.append(_encode(_DELETED, key))
            self._persist(records)

    def retain(self, present: Iterable[BlockKey]) -> None:
        """Keep only `present` (after the store was asked which keys it still holds)."""
        keep = {k.digest for k in present}
        with self._lock:
            gone = [key for blocks in self._tenants.values() for d, (key, _) in blocks.items()
                    if d not in keep]
        self.discard(gone)

    def close(self) -> None:
        with self._lock:
            if self._behind:
                with contextlib.suppress(OSError):
                    self._compact()
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1

    # -- private (callers hold the lock) --------------------------------------------------------

    def _insert(self, key: BlockKey, size: int) -> bool:
        digest = key.digest
        if digest in self._tenant_of:
            return False  # no change: keep the log short
        tenant = key.namespace.tenant
        self._tenants.setdefault(tenant, OrderedDict())[digest] = (key, size)
        self._tenant_of[digest] = tenant
        self._tenant_bytes[tenant] = self._tenant_bytes.get(tenant, 0) + size
        self._tenant_cost[tenant] = self._tenant_cost.get(tenant, 0) + block_cost(size)
        return True

    def _remove(self, digest: bytes) -> bool:
        tenant = self._tenant_of.pop(digest, None)
        if tenant is None:
            return False
        blocks = self._tenants[tenant]
        _, size = blocks.pop(digest)
        self._tenant_bytes[tenant] -= size
        self._tenant_cost[tenant] -= block_cost(size)
        if not blocks:
            del self._tenants[tenant]
            del self._tenant_bytes[tenant]
            del self._tenant_cost[tenant]
        return True

    def _persist(self, records: list[bytes]) -> None:
        if self._behind:
            self._catch_up()
            return
        if not records:
            return
        data = b"".join(records)
        try:
            _write_all(self._fd, data)
        except OSError as exc:
            self._note_failure("append to the key log", exc)
            self._behind = True
            self._retry_at = time.monotonic() + _RETRY_S
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, self._good_size)  # no torn record before later ones
            return
        self._good_size += len(data)
        self._records += len(records)
        if self._records > _COMPACT_RATIO * max(len(self._tenant_of), _MIN_COMPACT_RECORDS):
            try:
                self._compact()
            except OSError as exc:  # the old log is whole: try again after more records
                self._note_failure("compact the key log", exc)
                self._records = len(self._tenant_of)

    def _catch_up(self) -> None:
        """While behind: a compaction (the whole live set), at most every _RETRY_S."""
        if time.monotonic() < self._retry_at:
            return
        try:
            self._compact()
        except OSError as exc:
            self.write_failures += 1
            _log.debug("key log still behind: %s", exc)
            self._retry_at = time.monotonic() + _RETRY_S
            return
        self._behind = False
        _log.info("key log %s caught up (%d keys)", self.path, len(self._tenant_of))

    def _compact(self) -> None:
        """Write the live keys to a temp file, fsync, rename over the log, reopen it for
        appending; on OSError the temp file is removed and the old log left as it was."""
        tmp = self.path.with_suffix(".tmp")
        data = b"".join(_encode(_STORED, key, size) for blocks in self._tenants.values()
                        for key, size in blocks.values())
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        try:
            try:
                _write_all(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, self.path)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        with contextlib.suppress(OSError):  # the rename is made; its durability is a bonus
            dir_fd = os.open(self.path.parent, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
        self._open_for_append()
        self._good_size = len(data)
        self._records = len(self._tenant_of)

    def _open_for_append(self, truncate_to: int | None = None) -> None:
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
            if truncate_to is not None:
                os.ftruncate(fd, truncate_to)
        except OSError as exc:
            raise TierError(f"cannot open key catalog {self.path}: {exc}") from exc
        if self._fd >= 0:
            os.close(self._fd)
        self._fd = fd
        if truncate_to is not None:
            self._good_size = truncate_to

    def _note_failure(self, what: str, exc: OSError) -> None:
        self.write_failures += 1
        _log.warning("cannot %s %s (%s); the catalog stays exact in memory and catches up "
                     "when the disk allows", what, self.path, exc)

    @staticmethod
    def _read(path: Path) -> Iterator[tuple[bytes, BlockKey, int, int]]:
        """(op, key, size, offset after the record) of every whole record, up to the first
        torn or corrupt one."""
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return
        except OSError as exc:
            raise TierError(f"cannot read key catalog {path}: {exc}") from exc
        pos = 0
        while pos + _HEAD.size <= len(data):
            length, checksum = _HEAD.unpack_from(data, pos)
            body = data[pos + _HEAD.size: pos + _HEAD.size + length]
            if length > _MAX_BODY or len(body) != length or xxhash.xxh3_64_digest(body) != checksum:
                return  # a torn tail from a crash: everything before it is good
            pos += _HEAD.size + length
            with contextlib.suppress(ValueError, KVKeepError, UnicodeDecodeError, struct.error):
                op, key, size = _decode(body)
                yield op, key, size, pos


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        if written <= 0:
            raise OSError("write made no progress")
        view = view[written:]
