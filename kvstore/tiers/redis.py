"""The `redis` tier: blocks in a Redis (or a Redis Cluster) the user already runs, behind the
Tier protocol.

Keys (all under `prefix`)::

    <prefix>:b:{<key digest hex>}             the frame itself (blocks up to `chunk_bytes`), or
                                              a chunk index record (larger blocks)
    <prefix>:b:{<key digest hex>}:<ver>:<i>   chunk i of a large block, version <ver>
    <prefix>:m:{<session digest hex>}         a hash {gen, data}: one session's record

The braces are Redis Cluster hash tags: a cluster places a key by the part inside them only, so
a block's index and all its chunks share one slot (one master), which is what lets a block be
written in one MULTI/EXEC and its chunks be read with one MGET on a cluster; a manifest is one
key, and its tag keeps it on one slot under any future split into more keys. A single server
ignores the braces, so one layout serves both.

`RedisConfig.nodes` (seed "host:port"s) makes the tier a cluster client (redis-py's
`RedisCluster`, hiredis-parsed like the single client): it learns the slot map from any seed,
follows MOVED and ASK redirections (a resharding in progress) and re-learns the map after a
failover. What a cluster adds to the failure cases, and what each becomes here:

- a master lost before its replica is promoted: its slots' reads and writes fail fast
  (TierUnavailable, which the store turns into a miss: the KV is recomputed); after promotion
  the replica answers, missing at most the writes it had not received yet (a MULTI/EXEC
  replicates whole, so never half a block);
- a slot being migrated: reads follow ASK (or TRYAGAIN, briefly, for a block whose keys are on
  both sides: a miss); a one-value put follows ASK too, a chunked one (a transaction, which
  redis-py retries on the source only) is refused (False) until the migration ends;
- a lookup while a master is lost: answered per master, the lost one's keys absent;
- a full master (maxmemory + noeviction): its puts are refused, its reads keep working.
Reads and lookups during CLUSTERDOWN (full coverage lost, before a promotion) miss unless the
servers run with `cluster-allow-reads-when-down yes`.

Large blocks are split into `chunk_bytes` values: Redis and redis-py slow down sharply on single
values of many MiB (~1 GB/s at 16 MiB here against ~4 GB/s at 4 MiB). A block of one value is
written by one SET NX; a larger one in one MULTI/EXEC transaction, chunks first and the index
key last, so no reader ever sees part of it;
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
from typing import Any, cast

import redis
import redis.exceptions as rx
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.retry import Retry

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
from kvstore.manifest import SessionRecord, decode_session_record
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
    """Connections in the pool (per node, on a cluster)."""
    name: str = "redis"
    nodes: tuple[str, ...] = ()
    """Redis Cluster seed nodes as "host:port" (any reachable one finds the rest); non-empty
    makes this a cluster client, and `url` is not used."""
    cluster_retries: int = 2
    """Times a cluster call is retried after a connection error or a redirection, each after
    re-learning the slot map. redis-py's default, 10 with no pause between them, turns a lost
    master into 10 connect timeouts per read (the store's restore deadline is spent on one
    block); 2 is enough to follow a failover or a moved slot."""

    @property
    def cluster(self) -> bool:
        return bool(self.nodes)


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
        self._lock = threading.Lock()
        # Typed as the single client: RedisCluster implements the same commands (routing each
        # by its key's slot), and only those are used here.
        self._conn: redis.Redis | None = client
        self._script: Any = None if client is None else client.register_script(_PUT_MANIFEST)
        self._next_connect = 0.0
        if client is None:
            with contextlib.suppress(TierUnavailable):
                self._connected()
        self._counts = {"hits": 0, "misses": 0, "puts": 0, "rejected": 0, "corrupt": 0,
                        "errors": 0, "bytes": 0}

    @property
    def _redis(self) -> redis.Redis:
        return self._connected()

    def _connected(self) -> redis.Redis:
        """The client; a cluster one is made on first use. A cluster client learns the slot
        map when it is made, so with no seed answering (the cluster down when vLLM starts)
        there is no client yet: the tier is unavailable (reads miss, puts fail) and tries
        again at most once a second, instead of failing the engine's start."""
        conn = self._conn
        if conn is not None:
            return conn
        with self._lock:
            if self._conn is None:
                now = time.monotonic()
                if now < self._next_connect:
                    raise TierUnavailable("redis cluster: no seed node answered (retrying)")
                self._next_connect = now + 1.0
                conn = self._connect(self._config)
                self._script = conn.register_script(_PUT_MANIFEST)
                self._conn = conn
            return self._conn

    @staticmethod
    def _connect(config: RedisConfig) -> redis.Redis:
        if not config.cluster:
            pool = redis.BlockingConnectionPool.from_url(
                config.url, max_connections=config.max_connections,
                socket_timeout=config.socket_timeout,
                socket_connect_timeout=config.socket_timeout)
            return redis.Redis(connection_pool=pool)
        try:
            cluster = RedisCluster(
                startup_nodes=[ClusterNode(*_host_port(node))  # type: ignore[no-untyped-call]
                               for node in config.nodes],
                retry=Retry(NoBackoff(), config.cluster_retries),
                socket_timeout=config.socket_timeout,
                socket_connect_timeout=config.socket_timeout,
                # Blocking per-node pools, like the single client: a burst of worker threads
                # waits for a connection instead of failing with MaxConnectionsError.
                connection_pool_class=redis.BlockingConnectionPool,
                max_connections=config.max_connections)
        except (rx.RedisError, rx.RedisClusterException) as exc:
            raise TierUnavailable(f"no redis cluster seed answered: {exc}") from exc
        return cast(redis.Redis, cluster)

    @property
    def name(self) -> str:
        return self._config.name

    # -- blocks -------------------------------------------------------------------------------

    def contains(self, keys: Sequence[BlockKey]) -> list[bool]:
        if not keys:
            return []
        names = [self._block(key) for key in keys]
        try:
            return self._exists(names)
        except _REDIS_ERRORS as exc:
            if not (self._config.cluster and _unreachable(exc)):
                raise self._translate("contains", exc) from exc
            self._count("errors")
        return self._exists_per_node(names)

    def _exists(self, names: list[str]) -> list[bool]:
        pipe = self._redis.pipeline(transaction=False)
        for name in names:
            pipe.exists(name)
        return [bool(n) for n in pipe.execute()]

    def _exists_per_node(self, names: list[str]) -> list[bool]:
        """A cluster pipeline fails whole when one node cannot be reached (a master lost, not
        yet replaced), and a prompt's blocks sit on every master: ask each master for its own
        keys, so the reachable ones still answer (the rest: absent, recomputed)."""
        cluster = cast(RedisCluster, self._redis)
        groups: dict[str, list[int]] = {}
        try:
            for i, name in enumerate(names):
                node = cluster.get_node_from_key(name)  # type: ignore[no-untyped-call]
                groups.setdefault(node.name, []).append(i)
        except _REDIS_ERRORS as exc:  # a slot with no known owner
            raise self._translate("contains", exc) from exc
        found = [False] * len(names)
        failures: list[rx.RedisError | rx.RedisClusterException] = []
        for indices in groups.values():
            try:
                flags = self._exists([names[i] for i in indices])
            except _REDIS_ERRORS as exc:
                failures.append(exc)
                continue
            for i, flag in zip(indices, flags, strict=True):
                found[i] = flag
        if len(failures) == len(groups):  # nobody answered: unavailable, not "absent"
            raise self._translate("contains", failures[0]) from failures[0]
        return found

    def get(self, key: BlockKey, layers: LayerRange | None = None, *,
            out: Buffer | None = None, deadline: float | None = None) -> BlockRead | None:
        _check_deadline(deadline)
        name = self._block(key)
        try:
            if layers is None:
                read = self._get_whole(key, name, out)
            else:
                read = self._get_range(key, name, layers, out)
        except _REDIS_ERRORS as exc:
            raise self._translate("get", exc) from exc
        self._count("hits" if read is not None else "misses")
        return read

    def put(self, key: BlockKey, frame: FrameBytes) -> bool:
        view, _ = checked_frame(frame, key.digest)  # segments: verified by the store's reads
        name = self._block(key)
        ttl = self._config.ttl_seconds
        step = self._config.chunk_bytes
        try:
            if len(view) <= step:
                # One SET is atomic on its own, and NX makes a re-put the no-op it must be
                # (frames are immutable per key): one round trip, and on a cluster a single-key
                # command, which redis-py follows through ASK while its slot migrates.
                stored = self._redis.set(name, view if isinstance(frame, bytes) else bytes(view),
                                         ex=ttl, nx=True)
                if not stored:
                    return True  # there already
            else:
                if self._redis.exists(name):
                    return True  # frames are immutable per key: a re-put is a no-op
                pipe = self._redis.pipeline(transaction=True)
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
        except (rx.AskError, rx.TryAgainError):
            # The block's slot is being migrated and redis-py retries a cluster transaction on
            # the source only: not admitted now (a later save of the block lands on the new
            # owner). MovedError is an AskError.
            self._count("rejected")
            return False
        except rx.ResponseError as exc:
            if _unreachable(exc):  # CLUSTERDOWN is a ResponseError too
                raise self._translate("put", exc) from exc
            if "OOM" in str(exc):
                self._count("rejected")
                return False
            self._count("errors")
            raise TierError(f"redis put failed: {exc}") from exc
        except _REDIS_ERRORS as exc:
            raise self._translate("put", exc) from exc
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
        except _REDIS_ERRORS as exc:
            raise self._translate("delete", exc) from exc

    # -- manifests ----------------------------------------------------------------------------

    def put_manifest(self, record: SessionRecord) -> None:
        try:
            self._connected()  # a cluster client (and its script) is made on first use
            self._script(keys=[self._manifest(record.key)],
                                      args=[record.generation, record.encode()])
        except _REDIS_ERRORS as exc:
            raise self._translate("put_manifest", exc) from exc

    def get_manifest(self, key: SessionKey) -> SessionRecord | None:
        try:
            data = _opt_bytes(self._redis.hget(self._manifest(key), "data"))
        except _REDIS_ERRORS as exc:
            raise self._translate("get_manifest", exc) from exc
        if data is None:
            return None
        return decode_session_record(data, expected=key)

    def delete_manifest(self, key: SessionKey) -> bool:
        try:
            return bool(self._redis.delete(self._manifest(key)))
        except _REDIS_ERRORS as exc:
            raise self._translate("delete_manifest", exc) from exc

    # -- lifecycle ----------------------------------------------------------------------------

    def stats(self) -> TierStats:
        with self._lock:
            c = dict(self._counts)
        return TierStats(self.name, 0, c["bytes"], 0, hits=c["hits"], misses=c["misses"],
                         puts=c["puts"], rejected_puts=c["rejected"], corrupt=c["corrupt"],
                         errors=c["errors"])

    def close(self) -> None:
        conn = self._conn
        if conn is None:
            return
        conn.close()
        if not self._config.cluster:  # RedisCluster.close() closes its node pools itself
            conn.connection_pool.disconnect()

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
        return f"{self._config.prefix}:b:{{{key.storage_name}}}"

    @staticmethod
    def _chunk(name: str, version: bytes, i: int) -> str:
        return f"{name}:{version.hex()}:{i}"

    def _manifest(self, key: SessionKey) -> str:
        return f"{self._config.prefix}:m:{{{key.storage_name}}}"

    def _count(self, what: str, n: int = 1) -> None:
        with self._lock:
            self._counts[what] += n

    def _translate(self, op: str, exc: rx.RedisError | rx.RedisClusterException) -> TierError:
        """A redis-py error as the kvkeep error a caller acts on (and counted). A cluster's
        CLUSTERDOWN (a master lost, no replica promoted yet) and a slot nobody serves are the
        server being unavailable, like a refused connection."""
        self._count("errors")
        if _unreachable(exc):
            return TierUnavailable(f"redis {op}: {exc}")
        return TierError(f"redis {op}: {exc}")


# RedisClusterException (slot-map and cross-slot problems) is not a RedisError.
_REDIS_ERRORS = (rx.RedisError, rx.RedisClusterException)


def _unreachable(exc: BaseException) -> bool:
    """Errors that say the data is out of reach for now, not that a command was wrong: a
    refused or timed-out connection, CLUSTERDOWN (a master lost, no replica promoted yet), a
    slot nobody serves, TRYAGAIN (a multi-key command on a slot half migrated)."""
    return isinstance(exc, rx.ConnectionError | rx.TimeoutError | rx.ClusterDownError
                      | rx.SlotNotCoveredError | rx.TryAgainError)


def _host_port(node: str) -> tuple[str, int]:
    host, sep, port = node.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise TierError(f"a redis cluster node is host:port, not {node!r}")
    return host.strip("[]"), int(port)


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


def _place(payload: bytes | memoryview, out: Buffer | None) -> bytes | memoryview:
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
    # One copy, from the reply straight into the caller's buffer.
    return BlockRead(read.header, read.layers, _place(memoryview(read.payload).cast("B"), out))
