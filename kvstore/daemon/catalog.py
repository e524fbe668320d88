"""The daemon's catalog of the block keys it stores, so it can re-replicate them.

Tiers index blocks by key digest and frames only carry that digest, but pushing a block to a
peer needs its full key (fingerprint, namespace, block hash): the peer verifies the frame against
it. So the daemon appends each key it stores to `keys.log` in its data dir and each delete as a
tombstone. On start the log is read up to the first torn or corrupt record (a crash mid-append),
compacted to the live keys, and rewritten atomically.

The log is flushed to the OS after every append, not fsync'd: a SIGKILL'd daemon loses nothing,
and after a power loss the few keys missing from the catalog are still held by their other
replicas, which will re-replicate them. Entries for blocks the store has since evicted are
pruned when a repair pass finds them gone.

Record: u32 body length | 8-byte xxh3-64 of body | body = op (b"P" or b"D") | fingerprint (16) |
u8 namespace-label length | label | u8 hash length | block hash.
"""

from __future__ import annotations

import contextlib
import os
import struct
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import BinaryIO

import xxhash

from kvstore.errors import KVKeepError, TierError
from kvstore.keys import BlockHash, BlockKey, Namespace

__all__ = ["KeyCatalog"]

_HEAD = struct.Struct("<I8s")
_MAX_BODY = 1 + 16 + 1 + 255 + 1 + 255
_PUT, _DEL = b"P", b"D"
# Compact when the log holds this many times more records than live keys.
_COMPACT_RATIO = 4


def _encode(op: bytes, key: BlockKey) -> bytes:
    label = key.namespace.label.encode()
    body = b"".join((op, key.fingerprint, bytes([len(label)]), label,
                     bytes([len(key.block_hash)]), key.block_hash))
    return _HEAD.pack(len(body), xxhash.xxh3_64_digest(body)) + body


def _decode(body: bytes) -> tuple[bytes, BlockKey]:
    op, fingerprint = body[:1], body[1:17]
    label_len = body[17]
    label = body[18:18 + label_len].decode()
    pos = 18 + label_len
    hash_len = body[pos]
    block_hash = body[pos + 1:pos + 1 + hash_len]
    if op not in (_PUT, _DEL) or len(block_hash) != hash_len or pos + 1 + hash_len != len(body):
        raise ValueError("malformed catalog record")
    return op, BlockKey(fingerprint, Namespace.from_label(label), BlockHash(block_hash))


class KeyCatalog:
    """Thread-safe set of stored keys, persisted as an append-only log."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._lock = threading.Lock()
        self._keys: dict[bytes, BlockKey] = {}
        self._records = 0
        for op, key in self._read(path):
            if op == _PUT:
                self._keys[key.digest] = key
            else:
                self._keys.pop(key.digest, None)
        self._file: BinaryIO = self._rewrite()

    def __len__(self) -> int:
        with self._lock:
            return len(self._keys)

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return isinstance(key, BlockKey) and key.digest in self._keys

    def keys(self) -> list[BlockKey]:
        with self._lock:
            return list(self._keys.values())

    def add(self, keys: Iterable[BlockKey]) -> None:
        self._append(_PUT, keys)

    def discard(self, keys: Iterable[BlockKey]) -> None:
        self._append(_DEL, keys)

    def retain(self, present: Iterable[BlockKey]) -> None:
        """Keep only `present` (after the store was asked which keys it still holds)."""
        keep = {k.digest for k in present}
        with self._lock:
            gone = [k for d, k in self._keys.items() if d not in keep]
        self.discard(gone)

    def close(self) -> None:
        with self._lock:
            self._file.close()

    def _append(self, op: bytes, keys: Iterable[BlockKey]) -> None:
        with self._lock:
            records = []
            for key in keys:
                present = key.digest in self._keys
                if (op == _PUT) == present:
                    continue  # no change: keep the log short
                if op == _PUT:
                    self._keys[key.digest] = key
                else:
                    del self._keys[key.digest]
                records.append(_encode(op, key))
            if not records:
                return
            try:
                self._file.write(b"".join(records))
                self._file.flush()
            except (OSError, ValueError) as exc:
                raise TierError(f"cannot append to key catalog {self._path}: {exc}") from exc
            self._records += len(records)
            if self._records > _COMPACT_RATIO * max(len(self._keys), 1024):
                self._file.close()
                self._file = self._rewrite()

    def _rewrite(self) -> BinaryIO:
        """Write the live keys to a temp file, fsync, rename over the log; reopen for append."""
        tmp = self._path.with_suffix(".tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(b"".join(_encode(_PUT, k) for k in self._keys.values()))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self._path)
            fd = os.open(self._path.parent, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            self._records = len(self._keys)
            return open(self._path, "ab")
        except OSError as exc:
            raise TierError(f"cannot write key catalog {self._path}: {exc}") from exc

    @staticmethod
    def _read(path: Path) -> Iterator[tuple[bytes, BlockKey]]:
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
            with contextlib.suppress(ValueError, KVKeepError, UnicodeDecodeError):
                yield _decode(body)
            pos += _HEAD.size + length
