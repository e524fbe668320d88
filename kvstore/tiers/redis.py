"""The `redis` tier: blocks in a Redis the user already runs, behind the Tier protocol.

Keys (all under `prefix`)::

    <prefix>:b:<key digest hex>             the frame itself (blocks up to `chunk_bytes`), or a
                                            chunk index record (larger blocks)
    <prefix>:b:<key digest hex>:<ver>:<i>   chunk i of a large block, version <ver>
    <prefix>:m:<session digest hex>         a hash {gen, data}: one session manifest

Large blocks are split into `chunk_bytes` values: Redis and redis-py slow down sharply on single
values of many MiB (~1 GB/s at 16 MiB here against ~4 GB/s at 4 MiB). A block is written in one
MULTI/EXEC transaction, chunks first and the index key last, so no reader ever sees part of it;
chunk keys carry a random version so a re-put can never mix chunks of two writes. If Redis
evicts a chunk on its own (maxmemory policies act per key), the block reads as a miss and the
leftovers are deleted.

Layer-range reads fetch the header with one GETRANGE and then only the byte range of the wanted
segments (GETRANGE within each chunk it spans), like the other tiers. Reads return unverified
`BlockRead`s: the TieredStore verifies each one, once, before use (deleting a corrupt copy).
"""

from __future__ import annotations

import contextlib
import os
import struct
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis
import redis.exceptions as rx

from kvstore.errors import (
    CorruptBlock,
    DeadlineExceeded,
    TierError,
    TierUnavailable,
)
from kvstore.frame import (
    HEADER_PREFIX_BYTES,
    MAGIC,
    BlockRead,
    FrameBytes,
    FrameHeader,
    LayerRange,
    checked_frame,
)
from kvstore.keys import BlockKey, SessionKey
from kvstore.manifest import SessionManifest
from kvstore.tiers.base import Buffer, TierStats

__all__ = ["RedisConfig", "RedisTier"]

_INDEX_MAGIC = b"KVKC"
# magic | version (8 random bytes) | chunk count u32 | frame size u64 | chunk bytes u32
_INDEX = struct.Struct("<4s8sIQI")
_PROBE_BYTES = 64 << 10  # one GETRANGE gets the header of any real block
_PUT_MANIFEST = """
local cur = redis.call('HGET', KEYS[1], 'gen')
if cur and tonumber(cur) > tonumber(ARGV[1]) then return 0 end
redis.call('HSET', KEYS[1], 'gen', ARGV[1], 'data', ARGV[2])
return 1
"""


@dataclass(frozen=True, slots=True)
class RedisConfig:
    url: str = "redis://127.0.0.1:6379/0"
    prefix: str = "kvkeep"
    chunk_bytes: int = 4 << 20
    ttl_seconds: int | None = None
    """Expire blocks this long after their last write (None: rely on Redis' maxmemory policy)."""
    socket_timeout: float = 5.0
    max_connections: int = 32
    name: str = "redis"


@dataclass(frozen=True, slots=True)
class _Index:
    version: bytes
    chunks: int
    size: int
    chunk_bytes: int


class RedisTier:
    """Implements the `Tier` protocol on a Redis server. Thread-safe (a blocking pool)."""

    def __init__(self, config: RedisConfig | None = None, *,
                 client: redis.Redis | None = None) -> None:
        self._config = config or RedisConfig()
        if self._config.chunk_bytes < _PROBE_BYTES:
            raise TierError(f"chunk_bytes must be at least {_PROBE_BYTES}")
        pool = redis.BlockingConnectionPool.from_url(
            self._config.url, max_connections=self._config.max_connections,
            socket_timeout=self._config.socket_timeout,
            socket_connect_timeout=self._config.socket_timeout)
        self._redis: redis.Redis = client or redis.Redis(connection_pool=pool)
        self._put_manifest_script = self._redis.register_script(_PUT_MANIFEST)
        self._lock = threading.Lock()
        self._counts = {"hits": 0, "misses": 0, "puts": 0, "rejected": 0, "corrupt": 0,
                        "errors": 0, "bytes": 0}

    @property
    def name(self) -> str:
        return self._config.name

    # -- blocks -------------------------------------------------------------------------------

    def contains(self, keys: Sequence[BlockKey]) -> list[bool]:
        if not keys:
            return []
        try:
            pipe = self._redis.pipeline(transaction=False)
            for key in keys:
                pipe.exists(self._block(key))
            return [bool(n) for n in pipe.execute()]
        except rx.RedisError as exc:
            raise self._translate("contains", exc) from exc

    def get(self, key: BlockKey, layers: LayerRange | None = None, *,
            out: Buffer | None = None, deadline: float | None = None) -> BlockRead | None:
        _check_deadline(deadline)
        name = self._block(key)
        try:
            if layers is None:
                read = self._get_whole(key, name, out)
            else:
                read = self._get_range(key, name, layers, out)
        except rx.RedisError as exc:
            raise self._translate("get", exc) from exc
        self._count("hits" if read is not None else "misses")
        return read

    def put(self, key: BlockKey, frame: FrameBytes) -> bool:
        view, _ = checked_frame(frame, key.digest)  # segments: verified by the store's reads
        name = self._block(key)
        ttl = self._config.ttl_seconds
        step = self._config.chunk_bytes
        try:
            if self._redis.exists(name):
                return True  # frames are immutable per key: a re-put is a no-op
            pipe = self._redis.pipeline(transaction=True)
            if len(view) <= step:
                pipe.set(name, view if isinstance(frame, bytes) else bytes(view), ex=ttl)
            else:
                version = os.urandom(8)
                chunks = (len(view) + step - 1) // step
                for i in range(chunks):
                    pipe.set(self._chunk(name, version, i), bytes(view[i * step:(i + 1) * step]),
                             ex=ttl)
                pipe.set(name, _INDEX.pack(_INDEX_MAGIC, version, chunks, len(view), step),
                         ex=ttl)
            pipe.execute()
        except rx.OutOfMemoryError:
            self._count("rejected")
            return False
        except rx.ResponseError as exc:
            if "OOM" in str(exc):
                self._count("rejected")
                return False
            self._count("errors")
            raise TierError(f"redis put failed: {exc}") from exc
        except (rx.ConnectionError, rx.TimeoutError) as exc:
            self._count("errors")
            raise TierUnavailable(f"redis unreachable: {exc}") from exc
        except rx.RedisError as exc:
            self._count("errors")
            raise TierError(f"redis put failed: {exc}") from exc
        self._count("puts")
        self._count("bytes", len(view))
        return True

    def delete(self, keys: Sequence[BlockKey]) -> int:
        if not keys:
            return 0
        try:
            names = [self._block(k) for k in keys]
            pipe = self._redis.pipeline(transaction=False)
            for name in names:
                pipe.getrange(name, 0, _INDEX.size - 1)
            heads = pipe.execute()
            doomed: list[str] = []
            present = 0
            for name, head in zip(names, heads, strict=True):
                if not head:
                    continue
                present += 1
                doomed.append(name)
                index = _parse_index(head)
                if index is not None:
                    doomed.extend(self._chunk(name, index.version, i)
                                  for i in range(index.chunks))
            if doomed:
                self._redis.delete(*doomed)
            return present
        except rx.RedisError as exc:
            raise self._translate("delete", exc) from exc

    # -- manifests ----------------------------------------------------------------------------

    def put_manifest(self, manifest: SessionManifest) -> None:
        try:
            self._put_manifest_script(keys=[self._manifest(manifest.key)],
                                      args=[manifest.generation, manifest.encode()])
        except rx.RedisError as exc:
            raise self._translate("put_manifest", exc) from exc

    def get_manifest(self, key: SessionKey) -> SessionManifest | None:
        try:
            data = _opt_bytes(self._redis.hget(self._manifest(key), "data"))
        except rx.RedisError as exc:
            raise self._translate("get_manifest", exc) from exc
        if data is None:
            return None
        return SessionManifest.decode(data, expected=key)

    def delete_manifest(self, key: SessionKey) -> bool:
        try:
            return bool(self._redis.delete(self._manifest(key)))
        except rx.RedisError as exc:
            raise self._translate("delete_manifest", exc) from exc

    # -- lifecycle ----------------------------------------------------------------------------

    def stats(self) -> TierStats:
        with self._lock:
            c = dict(self._counts)
        return TierStats(self.name, 0, c["bytes"], 0, hits=c["hits"], misses=c["misses"],
                         puts=c["puts"], rejected_puts=c["rejected"], corrupt=c["corrupt"],
                         errors=c["errors"])

    def close(self) -> None:
        self._redis.close()
        self._redis.connection_pool.disconnect()

    # -- private ------------------------------------------------------------------------------

    def _get_whole(self, key: BlockKey, name: str, out: Buffer | None) -> BlockRead | None:
        head = _opt_bytes(self._redis.get(name))
        if head is None:
            return None
        index = _parse_index(head)
        if index is None:
            return _read_from(head, None, out)
        chunks = [_opt_bytes(c) for c in self._redis.mget(
            [self._chunk(name, index.version, i) for i in range(index.chunks)])]
        if any(c is None for c in chunks):
            self._lost_chunks(key)
            return None
        buf = _buffer(index.size, out)
        pos = 0
        for chunk in chunks:
            assert chunk is not None
            buf[pos:pos + len(chunk)] = chunk
            pos += len(chunk)
        if pos != index.size:
            self._lost_chunks(key)
            return None
        return _read_from(buf, None, None)

    def _get_range(self, key: BlockKey, name: str, layers: LayerRange, out: Buffer | None
                   ) -> BlockRead | None:
        head = _bytes(self._redis.getrange(name, 0, _PROBE_BYTES - 1))
        if not head:
            return None
        index = _parse_index(head)
        if index is None:
            header = self._header(head, lambda a, b: _bytes(self._redis.getrange(name, a, b - 1)))
            start, stop = header.span(layers)
            payload = _bytes(self._redis.getrange(name, start, stop - 1))
            if len(payload) != stop - start:
                raise CorruptBlock("stored frame is shorter than its header says")
            return BlockRead(header, layers, _place(payload, out))
        chunk_names = [self._chunk(name, index.version, i) for i in range(index.chunks)]
        step = index.chunk_bytes

        def fetch(a: int, b: int) -> bytes:
            pipe = self._redis.pipeline(transaction=False)
            for i in range(a // step, (b - 1) // step + 1):
                lo, hi = max(a, i * step), min(b, (i + 1) * step)
                pipe.getrange(chunk_names[i], lo - i * step, hi - i * step - 1)
            return b"".join(_bytes(part) for part in pipe.execute())

        header = self._header(fetch(0, min(_PROBE_BYTES, index.size)), fetch)
        start, stop = header.span(layers)
        payload = fetch(start, stop)
        if len(payload) != stop - start:
            self._lost_chunks(key)
            return None
        return BlockRead(header, layers, _place(payload, out))

    @staticmethod
    def _header(head: bytes, fetch: Any) -> FrameHeader:
        size = _header_size(head)
        if size > len(head):
            head = fetch(0, size)
        return FrameHeader.unpack(head)

    def _lost_chunks(self, key: BlockKey) -> None:
        """Redis evicted part of a large block: the rest is useless, drop it."""
        self._count("corrupt")
        with contextlib.suppress(TierError):
            self.delete([key])

    def _block(self, key: BlockKey) -> str:
        return f"{self._config.prefix}:b:{key.storage_name}"

    @staticmethod
    def _chunk(name: str, version: bytes, i: int) -> str:
        return f"{name}:{version.hex()}:{i}"

    def _manifest(self, key: SessionKey) -> str:
        return f"{self._config.prefix}:m:{key.storage_name}"

    def _count(self, what: str, n: int = 1) -> None:
        with self._lock:
            self._counts[what] += n

    def _translate(self, op: str, exc: rx.RedisError) -> TierError:
        """A redis-py error as the kvkeep error a caller acts on (and counted)."""
        self._count("errors")
        if isinstance(exc, rx.ConnectionError | rx.TimeoutError):
            return TierUnavailable(f"redis {op}: {exc}")
        return TierError(f"redis {op}: {exc}")


def _check_deadline(deadline: float | None) -> None:
    if deadline is not None and time.monotonic() >= deadline:
        raise DeadlineExceeded("redis get started past its deadline")


def _bytes(value: object) -> bytes:
    """redis-py is typed for decoded strings too; this client never decodes."""
    if not isinstance(value, bytes):
        raise CorruptBlock(f"redis returned {type(value).__name__}, not bytes")
    return value


def _opt_bytes(value: object) -> bytes | None:
    return None if value is None else _bytes(value)


def _parse_index(head: bytes) -> _Index | None:
    if head[:4] != _INDEX_MAGIC:
        return None
    if len(head) < _INDEX.size:
        raise CorruptBlock("truncated chunk index record")
    _, version, chunks, size, step = _INDEX.unpack_from(head, 0)
    if chunks < 1 or step < 1 or size > chunks * step:
        raise CorruptBlock("implausible chunk index record")
    return _Index(version, chunks, size, step)


def _header_size(head: bytes) -> int:
    if head[:4] != MAGIC or len(head) < HEADER_PREFIX_BYTES:
        raise CorruptBlock("stored value is not a block frame")
    (size,) = struct.unpack_from("<I", head, 6)
    return int(size)


def _buffer(size: int, out: Buffer | None) -> memoryview:
    if out is not None:
        view = memoryview(out).cast("B")
        if len(view) < size:
            raise ValueError(f"output buffer of {len(view)} bytes, block needs {size}")
        return view[:size]
    return memoryview(bytearray(size))


def _place(payload: bytes, out: Buffer | None) -> bytes | memoryview:
    if out is None:
        return payload
    view = _buffer(len(payload), out)
    view[:] = payload
    return view


def _read_from(frame: bytes | memoryview, layers: LayerRange | None, out: Buffer | None
               ) -> BlockRead:
    read = BlockRead.from_frame(frame, layers)
    if out is None:
        return read
    return BlockRead(read.header, read.layers, _place(bytes(read.payload), out)
                     if not isinstance(read.payload, bytes) else _place(read.payload, out))
