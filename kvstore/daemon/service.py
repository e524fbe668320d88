"""The gRPC handlers of a daemon: the KVStore service and the standard health service.

Handlers run on the daemon's asyncio loop; storage calls (copies, disk reads, checksums) run on a
small thread pool so that one slow disk read never stalls other streams. Every call first checks
its bearer token and that the request's namespace belongs to it.

Put verifies each frame before it reaches the store (header and segment checksums, and the key
binding against the key the client names): a malformed or corrupt frame is INVALID_ARGUMENT and
nothing of it is stored. A block is stored only once its last byte arrived, so a client that
dies mid-stream, or a daemon killed mid-put, never leaves a partial block behind.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, NoReturn, TypeVar

import grpc  # type: ignore[import-untyped, unused-ignore]
from google.protobuf.message import DecodeError, Message

from kvstore.chunk_codec import PutChunkView, decode_put_chunk, encode_get_chunk
from kvstore.daemon.auth import ANONYMOUS, AuthFailure, Principal, TokenTable, bearer_token
from kvstore.daemon.catalog import KeyCatalog
from kvstore.errors import CorruptBlock, InvalidFrame, InvalidKey, KVKeepError, TierFull
from kvstore.frame import (
    HEADER_PREFIX_BYTES,
    BlockRead,
    FrameHeader,
    LayerRange,
    header_size_from_prefix,
    verify_pieces,
)
from kvstore.keys import BlockKey, SessionKey
from kvstore.manifest import SessionManifest
from kvstore.store import TieredStore
from kvstore.tiers.base import Buffer, TierStats
from kvstore.tiers.capabilities import BorrowedBlock, PageReservation
from kvstore.wire import (
    CHUNK_BYTES,
    HEALTH_SERVICE,
    KVSTORE_SERVICE,
    MAX_FRAME_BYTES,
    MAX_KEYS_PER_CALL,
    Scope,
    layers_from_pb,
)
from proto.gen import health_pb2
from proto.gen import kvstore_pb2 as pb

__all__ = ["Counters", "KVStoreService", "HealthService", "Abort", "store_contains"]

_log = logging.getLogger(__name__)
T = TypeVar("T")
M = TypeVar("M", bound=Message)
FrameBytes = bytes | bytearray | memoryview
_Serving = health_pb2.HealthCheckResponse.ServingStatus
# Per storage thread; blocks larger than this are read into a fresh buffer instead.
_SCRATCH_BYTES = 64 << 20
# Lookups of up to this many keys run on the event loop itself (about a millisecond at most).
_INLINE_LOOKUP_KEYS = 4096


@dataclass(slots=True)
class Counters:
    """Wire and request counters since start. The service's own are mutated only on the event
    loop; the data plane keeps a second set under its lock, and Stat reports the sum."""

    put_bytes_received: int = 0
    get_bytes_sent: int = 0
    puts: int = 0
    rejected_puts: int = 0
    invalid_puts: int = 0
    gets: int = 0
    hits: int = 0
    misses: int = 0
    lookups: int = 0
    repaired_blocks: int = 0

    def plus(self, other: Counters) -> Counters:
        return Counters(*(getattr(self, f) + getattr(other, f) for f in self.__slots__))


@dataclass(frozen=True, slots=True)
class Abort:
    """A refusal: the gRPC status and message a handler ends with."""

    code: Any
    message: str


async def _abort(context: Any, code: Any, message: str) -> NoReturn:
    await context.abort(code, message)
    raise AssertionError("context.abort returned")  # grpc.aio's abort always raises


class KVStoreService:
    """The KVStore RPCs over the daemon's TieredStore (host RAM, then nvme).

    Puts apply back-pressure: a put is acknowledged only while the store's write-behind queue
    (host -> nvme) is below `max_pending_writes`, so acknowledged blocks cannot outrun the disk
    and be dropped from the queue unwritten.
    """

    def __init__(self, node_id: str, store: TieredStore, catalog: KeyCatalog, *,
                 tokens: TokenTable | None, executor: ThreadPoolExecutor,
                 max_inflight_put_bytes: int = 4 << 30, chunk_bytes: int = CHUNK_BYTES,
                 max_pending_writes: int = 64, backpressure_timeout: float = 30.0,
                 read_deadline: float = 10.0) -> None:
        self.node_id = node_id
        self.counters = Counters()
        self._store = store
        self._catalog = catalog
        self._tokens = tokens
        self._executor = executor
        self._chunk = chunk_bytes
        self._inflight_budget = max_inflight_put_bytes
        self._inflight = 0
        self._inflight_lock = threading.Lock()  # the data plane reserves from its own threads
        self._counter_sources: list[Callable[[], Counters]] = []
        self.data_port = 0
        """The bulk data plane's port (kvstore/daemon/dataplane.py), 0 when there is none."""
        self._draining = False
        self._active_puts = 0
        self._max_pending = max_pending_writes
        self._backpressure_timeout = backpressure_timeout
        self._read_deadline = read_deadline
        self._key_cache = _KeyCache()
        self._local = threading.local()

    @property
    def draining(self) -> bool:
        return self._draining

    def start_draining(self) -> None:
        """Refuse new puts from now on; streams already running finish."""
        self._draining = True

    @property
    def active_puts(self) -> int:
        return self._active_puts

    def add_counter_source(self, source: Callable[[], Counters]) -> None:
        """Counters kept elsewhere (the data plane's) that Stat adds to the service's own."""
        self._counter_sources.append(source)

    def reserve_put_bytes(self, size: int) -> bool:
        """Take `size` bytes of the in-flight put budget; False when it would overflow."""
        with self._inflight_lock:
            if self._inflight + size > self._inflight_budget:
                return False
            self._inflight += size
            return True

    def release_put_bytes(self, size: int) -> None:
        with self._inflight_lock:
            self._inflight -= size

    def key(self, scope: Scope, block_hash: bytes) -> BlockKey:
        """The BlockKey of a block hash in `scope`, interned (any thread; raises InvalidKey).

        Puts and lookups share these objects, so the tiers' dict lookups of a looked-up key
        usually find the very object they hold (an identity test, no Python-level __eq__).
        """
        return self._key_cache.keys(scope, (block_hash,))[0]

    def authenticate_token(self, token: str | None) -> Principal | AuthFailure:
        """The principal of a bearer token (everyone is ANONYMOUS when auth is off)."""
        if self._tokens is None:
            return ANONYMOUS
        return self._tokens.authenticate(token)

    def generic_handler(self) -> Any:
        # Requests arrive as raw bytes and are parsed in the handlers, so that bytes which are
        # not a protobuf message get INVALID_ARGUMENT rather than gRPC's generic INTERNAL.
        def unary(fn: Callable[[Any, Any], Any], req: Any) -> Any:
            async def handler(raw: bytes, context: Any) -> Any:
                return await fn(await _parse(req, raw, context), context)
            return grpc.unary_unary_rpc_method_handler(handler, response_serializer=_serialize)

        async def get(raw: bytes, context: Any) -> AsyncIterator[bytes]:
            request = await _parse(pb.GetRequest, raw, context)
            async for chunk in self.get(request, context):
                yield chunk

        async def put(raw: AsyncIterator[bytes], context: Any) -> pb.PutReply:
            return await self.put(_parse_put_stream(raw, context), context)

        # The bulk messages use the zero-copy codec (kvstore/chunk_codec.py): Get yields wire
        # bytes, Put reads views into the received messages.
        handlers = {
            "Put": grpc.stream_unary_rpc_method_handler(put, response_serializer=_serialize),
            "Get": grpc.unary_stream_rpc_method_handler(get, response_serializer=None),
            "Lookup": unary(self.lookup, pb.LookupRequest),
            "Delete": unary(self.delete, pb.DeleteRequest),
            "PutManifest": unary(self.put_manifest, pb.PutManifestRequest),
            "GetManifest": unary(self.get_manifest, pb.ManifestKey),
            "DeleteManifest": unary(self.delete_manifest, pb.ManifestKey),
            "Stat": unary(self.stat, pb.StatRequest),
        }
        return grpc.method_handlers_generic_handler(KVSTORE_SERVICE, handlers)

    # -- RPCs ---------------------------------------------------------------------------------

    async def put(self, requests: AsyncIterator[PutChunkView], context: Any) -> pb.PutReply:
        principal = await self._authenticate(context)
        if self._draining:
            await _abort(context, grpc.StatusCode.UNAVAILABLE, "daemon is draining")
        self._active_puts += 1
        reserved = 0
        try:
            statuses: list[pb.PutStatus] = []
            scope: Scope | None = None
            key: BlockKey | None = None
            size = 0
            parts: list[memoryview] = []
            received = 0
            async for msg in requests:
                if scope is None:
                    if msg.scope is None:
                        await _abort(context, grpc.StatusCode.INVALID_ARGUMENT,
                                     "the first message of a put must carry the scope")
                    scope = await self._scope(msg.scope, principal, context)
                if msg.block_hash:
                    if key is not None:
                        await self._invalid(context, "a block began before the last one ended")
                    size = int(msg.frame_size)
                    if size > MAX_FRAME_BYTES:
                        self.counters.invalid_puts += 1
                        await _abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED,
                                     f"frame of {size} bytes exceeds {MAX_FRAME_BYTES}")
                    if size < HEADER_PREFIX_BYTES:
                        await self._invalid(context, f"frame size {size} is too small")
                    if not self.reserve_put_bytes(size):
                        await _abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED,
                                     "too many put bytes in flight; retry later")
                    reserved += size
                    try:
                        key = self.key(scope, bytes(msg.block_hash))
                    except InvalidKey as exc:
                        await self._invalid(context, str(exc))
                    parts, received = [], 0
                elif key is None:
                    await self._invalid(context, "data outside a block")
                data = msg.data
                received += len(data)
                self.counters.put_bytes_received += len(data)
                if received > size:
                    await self._invalid(context, f"block carries more than its {size} bytes")
                if data:
                    parts.append(data)
                if received == size:
                    assert key is not None
                    # One chunk: a view into the received message, no copy. The store copies it
                    # into its own pages before put() returns.
                    frame: FrameBytes = parts[0] if len(parts) == 1 else b"".join(parts)
                    parts = []
                    outcome = await self._run(self.verify_and_store, key, frame)
                    self.release_put_bytes(size)
                    reserved -= size
                    if isinstance(outcome, Abort):
                        if outcome.code == grpc.StatusCode.INVALID_ARGUMENT:
                            self.counters.invalid_puts += 1
                        await _abort(context, outcome.code, outcome.message)
                    self.counters.puts += 1
                    if not outcome:
                        self.counters.rejected_puts += 1
                    statuses.append(pb.PUT_STATUS_STORED if outcome else pb.PUT_STATUS_NOT_ADMITTED)
                    key = None
            if key is not None:
                await self._invalid(context, "the put stream ended in the middle of a block")
            return pb.PutReply(status=statuses)
        finally:
            self.release_put_bytes(reserved)
            self._active_puts -= 1

    async def get(self, request: pb.GetRequest, context: Any) -> AsyncIterator[bytes]:
        principal = await self._authenticate(context)
        scope = await self._scope(request.scope, principal, context)
        keys = await self._keys(scope, request.block_hashes, context)
        layers: LayerRange | None = None
        if request.HasField("layers"):
            try:
                layers = layers_from_pb(request.layers)
            except ValueError as exc:
                await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        single = request.single_reply
        if single and len(keys) != 1:
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT,
                         "single_reply needs exactly one key")
        for index, key in enumerate(keys):
            self.counters.gets += 1
            outcome = await self._run(self._read_messages, key, layers, index, single)
            if isinstance(outcome, Abort):
                await _abort(context, outcome.code, outcome.message)
            if outcome is None:
                self.counters.misses += 1
                yield encode_get_chunk(b"", index=index, found=False)
                continue
            self.counters.hits += 1
            messages, sent = outcome
            self.counters.get_bytes_sent += sent
            for message in messages:
                yield message

    async def lookup(self, request: pb.LookupRequest, context: Any) -> pb.LookupReply:
        principal = await self._authenticate(context)
        scope = await self._scope(request.scope, principal, context)
        keys = await self._keys(scope, request.block_hashes, context)
        self.counters.lookups += 1
        if len(keys) <= _INLINE_LOOKUP_KEYS:
            # In-memory index probes (~0.3 us a key): cheaper than the hop to a worker thread,
            # and a lookup must not queue behind puts that wait for the disk.
            present = self._contains(keys)
        else:
            present = await self._run(self._contains, keys)
        prefix = next((i for i, hit in enumerate(present) if not hit), len(present))
        return pb.LookupReply(present=present, prefix_length=prefix)

    async def delete(self, request: pb.DeleteRequest, context: Any) -> pb.DeleteReply:
        principal = await self._authenticate(context)
        scope = await self._scope(request.scope, principal, context)
        keys = await self._keys(scope, request.block_hashes, context)
        deleted = await self._run(self._delete, keys)
        if isinstance(deleted, Abort):
            await _abort(context, deleted.code, deleted.message)
        return pb.DeleteReply(deleted=deleted)

    async def put_manifest(self, request: pb.PutManifestRequest, context: Any
                           ) -> pb.PutManifestReply:
        principal = await self._authenticate(context)
        try:
            manifest = SessionManifest.decode(request.manifest)
        except CorruptBlock as exc:
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"bad manifest: {exc}")
        if not principal.may_access(manifest.key.namespace.tenant):
            await _abort(context, grpc.StatusCode.PERMISSION_DENIED,
                         "the manifest's tenant is not granted to this token")
        if self._draining:
            await _abort(context, grpc.StatusCode.UNAVAILABLE, "daemon is draining")
        outcome = await self._run(self._store_call, self._store.put_manifest, manifest)
        if isinstance(outcome, Abort):
            await _abort(context, outcome.code, outcome.message)
        return pb.PutManifestReply()

    async def get_manifest(self, request: pb.ManifestKey, context: Any) -> pb.GetManifestReply:
        key = await self._session_key(request, context)
        outcome = await self._run(self._store_call, self._store.get_manifest, key)
        if isinstance(outcome, Abort):
            await _abort(context, outcome.code, outcome.message)
        if outcome is None:
            return pb.GetManifestReply(found=False)
        return pb.GetManifestReply(found=True, manifest=outcome.encode())

    async def delete_manifest(self, request: pb.ManifestKey, context: Any) -> pb.DeleteReply:
        key = await self._session_key(request, context)
        outcome = await self._run(self._store_call, self._store.delete_manifest, key)
        if isinstance(outcome, Abort):
            await _abort(context, outcome.code, outcome.message)
        return pb.DeleteReply(deleted=int(bool(outcome)))

    async def stat(self, request: pb.StatRequest, context: Any) -> pb.StatReply:
        await self._authenticate(context)
        outcome = await self._run(self._stats)
        if isinstance(outcome, Abort):
            await _abort(context, outcome.code, outcome.message)
        tiers, pending = outcome
        c = self.counters
        for source in self._counter_sources:
            c = c.plus(source())
        # The lowest tier holds (nearly) everything the upper ones cache: count blocks there.
        return pb.StatReply(
            node_id=self.node_id, draining=self._draining,
            blocks=max((t.blocks for t in tiers), default=0),
            bytes_used=sum(t.bytes_used for t in tiers),
            bytes_budget=sum(t.bytes_budget for t in tiers),
            put_bytes_received=c.put_bytes_received, get_bytes_sent=c.get_bytes_sent,
            puts=c.puts, rejected_puts=c.rejected_puts, invalid_puts=c.invalid_puts,
            gets=c.gets, hits=c.hits, misses=c.misses, lookups=c.lookups,
            repaired_blocks=c.repaired_blocks, data_port=self.data_port,
            pending_writes=pending,
            tiers=[pb.TierStat(name=t.name, blocks=t.blocks, bytes_used=t.bytes_used,
                               bytes_budget=t.bytes_budget, hits=t.hits, misses=t.misses,
                               puts=t.puts, rejected_puts=t.rejected_puts, corrupt=t.corrupt,
                               errors=t.errors) for t in tiers])

    # -- storage calls (on the thread pool; they return a value or an Abort) -------------------

    def verify_and_store(self, key: BlockKey, frame: FrameBytes) -> bool | Abort:
        """Verify a whole frame (checksums, size, key binding) and store it; any thread."""
        try:
            read = BlockRead.from_frame(frame)
            read.verify()
            read.verify_key(key.digest)
        except (CorruptBlock, ValueError) as exc:
            return Abort(grpc.StatusCode.INVALID_ARGUMENT, f"rejected frame: {exc}")
        if read.header.frame_size != len(frame):
            return Abort(grpc.StatusCode.INVALID_ARGUMENT,
                         f"frame of {len(frame)} bytes, its header describes "
                         f"{read.header.frame_size}")
        try:
            admitted = self._store.put(key, frame)
        except TierFull:
            admitted = False
        except KVKeepError as exc:
            _log.warning("put of %s failed: %s", key.storage_name, exc)
            return Abort(grpc.StatusCode.UNAVAILABLE, f"store failed: {exc}")
        if admitted:
            self._catalog.add((key,))
            self._wait_for_disk()
        return admitted

    def begin_put(self, key: BlockKey, size: int) -> PageReservation | None:
        """Host-tier pages to receive a `size`-byte frame into (no receive buffer, no copy),
        or None: then receive into a buffer and `verify_and_store`. Any thread."""
        try:
            return self._store.begin_put(key, size)
        except KVKeepError:
            return None

    def finish_put(self, reservation: PageReservation) -> bool | Abort:
        """`verify_and_store` for a frame received into `begin_put`'s pages: the same checks
        (header, every segment's checksum, size, key binding) before it is published; on any
        failure the pages are given back and nothing is stored. Any thread."""
        key = reservation.key
        try:
            pieces = reservation.pieces
            header = FrameHeader.unpack(_leading_bytes(pieces, HEADER_PREFIX_BYTES,
                                                       header_size_from_prefix))
            if header.frame_size != reservation.size:
                raise InvalidFrame(f"frame of {reservation.size} bytes, its header describes "
                                   f"{header.frame_size}")
            if header.key_digest != key.digest:
                raise CorruptBlock("frame is bound to a different key")
            verify_pieces(header, header.all_layers,
                          _byte_range(pieces, header.header_size, reservation.size))
        except (CorruptBlock, ValueError) as exc:
            reservation.abort()
            return Abort(grpc.StatusCode.INVALID_ARGUMENT, f"rejected frame: {exc}")
        except BaseException:
            reservation.abort()
            raise
        try:
            admitted = self._store.commit_put(reservation, header)
        except KVKeepError as exc:
            _log.warning("put of %s failed: %s", key.storage_name, exc)
            return Abort(grpc.StatusCode.UNAVAILABLE, f"store failed: {exc}")
        if admitted:
            self._catalog.add((key,))
            self._wait_for_disk()
        return admitted

    def _wait_for_disk(self) -> None:
        """Hold the ack while the write-behind queue is over its mark (see the class doc)."""
        end = time.monotonic() + self._backpressure_timeout
        while self._store.pending_writes > self._max_pending and time.monotonic() < end:
            time.sleep(0.001)

    def _read_messages(self, key: BlockKey, layers: LayerRange | None, index: int,
                       single: bool) -> tuple[list[bytes], int] | Abort | None:
        """Read a block and encode the Get messages that carry it: (messages, payload bytes).

        The store copies the payload into this worker thread's scratch buffer (touched once,
        reused: no page faults), and the messages are encoded from it right here, before the
        thread can reuse the buffer: one copy out of the store, one into the messages.
        """
        read = self.read_block(key, layers, self._scratch())
        if read is None or isinstance(read, Abort):
            return read
        chunk = self._chunk
        payload = memoryview(read.payload).cast("B")
        size = len(payload)
        # single_reply and too big for one message: no data, the client will stream it.
        first = payload[:0] if single and size > chunk else payload[:chunk]
        messages = [encode_get_chunk(first, index=index, found=True, header=read.header.pack(),
                                     layers=(read.layers.start, read.layers.stop),
                                     payload_size=size)]
        sent = len(first)
        if not single:
            for start in range(chunk, size, chunk):
                messages.append(encode_get_chunk(payload[start:start + chunk], index=index))
            sent = size
        return messages, sent

    def read_block(self, key: BlockKey, layers: LayerRange | None, scratch: Buffer
                   ) -> BlockRead | Abort | None:
        """Read a block (or the segments of `layers`) into `scratch` when it fits; any thread.

        The store verifies every segment it returns (and drops corrupt copies at their source,
        so a repair can simply put a good copy back); the client verifies again, end to end.
        """
        try:
            deadline = time.monotonic() + self._read_deadline
            read = self._store.get(key, layers, out=scratch, deadline=deadline)
            if read is None:  # a miss, or a block bigger than the scratch buffer
                read = self._store.get(key, layers, deadline=deadline)
        except ValueError as exc:  # a layer range beyond the block's layers
            return Abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except KVKeepError as exc:  # a failing tier reads as empty
            _log.warning("get of %s failed: %s", key.storage_name, exc)
            return None
        return read

    def borrow_block(self, key: BlockKey, layers: LayerRange | None, *, verify: bool = True
                     ) -> BorrowedBlock | None:
        """A block (or layer range) lent in place from the host tier, or None: then
        `read_block` (see TieredStore.borrow, and `check_borrowed` for verify=False). The
        caller must release() it; any thread."""
        try:
            return self._store.borrow(key, layers, verify=verify)
        except KVKeepError:
            return None

    def check_borrowed(self, key: BlockKey, block: BorrowedBlock) -> bool:
        """Verify a block lent unverified; a corrupt copy is dropped (TieredStore)."""
        try:
            return self._store.check_borrowed(key, block)
        except KVKeepError:
            return False

    def _scratch(self) -> bytearray:
        buf: bytearray | None = getattr(self._local, "scratch", None)
        if buf is None:
            buf = bytearray(b"\0" * _SCRATCH_BYTES)  # written once: its pages are resident
            self._local.scratch = buf
        return buf

    def _contains(self, keys: list[BlockKey]) -> list[bool]:
        return store_contains(self._store, keys)

    def _delete(self, keys: list[BlockKey]) -> int | Abort:
        try:
            deleted = self._store.delete(keys)
        except KVKeepError as exc:
            return Abort(grpc.StatusCode.UNAVAILABLE, f"delete failed: {exc}")
        self._catalog.discard(keys)
        return deleted

    def _store_call(self, fn: Callable[..., T], *args: Any) -> T | Abort:
        try:
            return fn(*args)
        except CorruptBlock as exc:
            return Abort(grpc.StatusCode.DATA_LOSS, str(exc))
        except KVKeepError as exc:
            return Abort(grpc.StatusCode.UNAVAILABLE, f"store failed: {exc}")

    def _stats(self) -> tuple[list[TierStats], int]:
        stats = self._store.stats()
        return list(stats.tiers), stats.pending_writes

    # -- helpers ------------------------------------------------------------------------------

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def _authenticate(self, context: Any) -> Principal:
        if self._tokens is None:
            return ANONYMOUS
        result = self.authenticate_token(bearer_token(context.invocation_metadata()))
        if isinstance(result, AuthFailure):
            await _abort(context, grpc.StatusCode.UNAUTHENTICATED, result.message)
        return result

    async def _scope(self, msg: pb.Scope, principal: Principal, context: Any) -> Scope:
        try:
            scope = Scope.from_pb(msg)
        except InvalidKey as exc:
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if not principal.may_access(scope.namespace.tenant):
            await _abort(context, grpc.StatusCode.PERMISSION_DENIED,
                         f"tenant {scope.namespace.tenant!r} is not granted to this token")
        return scope

    async def _session_key(self, request: pb.ManifestKey, context: Any) -> SessionKey:
        """The session a manifest call names, in a scope the caller may access."""
        scope = await self._scope(request.scope, await self._authenticate(context), context)
        try:
            return scope.session_key(request.session_id)
        except InvalidKey as exc:
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))

    async def _keys(self, scope: Scope, hashes: Any, context: Any) -> list[BlockKey]:
        if len(hashes) > MAX_KEYS_PER_CALL:
            await _abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED,
                         f"{len(hashes)} keys in one call; at most {MAX_KEYS_PER_CALL}")
        try:
            return self._key_cache.keys(scope, hashes)
        except InvalidKey as exc:
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))

    async def _invalid(self, context: Any, message: str) -> NoReturn:
        self.counters.invalid_puts += 1
        await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, message)


class _KeyCache:
    """BlockKeys by scope and block hash, so repeated lookups skip key construction.

    Building a BlockKey (validation and a blake2b digest) costs ~2 us; routers and schedulers
    ask about the same prefixes over and over, and a 1,000-key lookup must take milliseconds.
    Puts take their keys from here too, so the keys the tiers hold are these very objects.
    Bounded: cleared whole when it reaches `limit` keys (no LRU bookkeeping on the hot path).
    Thread-safe (the data plane's threads and the event loop share it).
    """

    def __init__(self, limit: int = 1 << 20) -> None:
        self._limit = limit
        self._size = 0
        self._by_scope: dict[tuple[bytes, str, str], dict[bytes, BlockKey]] = {}
        self._lock = threading.Lock()

    def keys(self, scope: Scope, hashes: Any) -> list[BlockKey]:
        ident = (scope.fingerprint, scope.namespace.tenant, scope.namespace.salt)
        with self._lock:
            cache = self._by_scope.get(ident)
            if cache is None:
                cache = self._by_scope[ident] = {}
            get = cache.get
            out = [get(raw) for raw in hashes]
            # (`None in out` would call BlockKey.__eq__ on every element.)
            missing = [i for i, key in enumerate(out) if key is None]
            for i in missing:
                raw = hashes[i]
                if self._size >= self._limit:
                    self._by_scope = {ident: {}}
                    cache = self._by_scope[ident]
                    self._size = 0
                key = cache.get(raw)
                if key is None:
                    key = cache[raw] = scope.key(bytes(raw))
                    self._size += 1
                out[i] = key
            return out  # type: ignore[return-value]


class HealthService:
    """grpc.health.v1.Health: SERVING until the daemon starts draining."""

    def __init__(self) -> None:
        self._status = _Serving.NOT_SERVING
        self._changed = asyncio.Condition()

    @property
    def serving(self) -> bool:
        return bool(self._status == _Serving.SERVING)

    async def set_serving(self, serving: bool) -> None:
        async with self._changed:
            self._status = _Serving.SERVING if serving else _Serving.NOT_SERVING
            self._changed.notify_all()

    def generic_handler(self) -> Any:
        return grpc.method_handlers_generic_handler(HEALTH_SERVICE, {
            "Check": grpc.unary_unary_rpc_method_handler(
                self.check, request_deserializer=health_pb2.HealthCheckRequest.FromString,
                response_serializer=_serialize),
            "Watch": grpc.unary_stream_rpc_method_handler(
                self.watch, request_deserializer=health_pb2.HealthCheckRequest.FromString,
                response_serializer=_serialize),
        })

    async def check(self, request: health_pb2.HealthCheckRequest, context: Any
                    ) -> health_pb2.HealthCheckResponse:
        if request.service not in ("", KVSTORE_SERVICE):
            await _abort(context, grpc.StatusCode.NOT_FOUND, f"unknown service {request.service}")
        return health_pb2.HealthCheckResponse(status=self._status)

    async def watch(self, request: health_pb2.HealthCheckRequest, context: Any
                    ) -> AsyncIterator[health_pb2.HealthCheckResponse]:
        if request.service not in ("", KVSTORE_SERVICE):
            yield health_pb2.HealthCheckResponse(status=_Serving.SERVICE_UNKNOWN)
            return
        last = None
        while True:
            async with self._changed:
                if last == self._status:
                    await self._changed.wait()
                last = self._status
            yield health_pb2.HealthCheckResponse(status=last)


def store_contains(store: TieredStore, keys: list[BlockKey]) -> list[bool]:
    """Which keys some tier holds: one batched `contains` per tier, asking only for misses."""
    found = [False] * len(keys)
    for tier in store.tiers:
        ask = [i for i, hit in enumerate(found) if not hit]
        if not ask:
            break
        try:
            flags = tier.contains([keys[i] for i in ask])
        except KVKeepError as exc:  # a failing tier is an empty one
            _log.warning("contains on tier %s failed: %s", tier.name, exc)
            continue
        for i, hit in zip(ask, flags, strict=False):
            if hit:
                found[i] = True
    return found


def _byte_range(pieces: list[memoryview], start: int, stop: int) -> list[memoryview]:
    """Views of bytes [start, stop) of the concatenation of `pieces`."""
    out = []
    pos = 0
    for piece in pieces:
        end = pos + len(piece)
        if end > start and pos < stop:
            out.append(piece[max(start - pos, 0): min(stop, end) - pos])
        pos = end
        if pos >= stop:
            break
    return out


def _leading_bytes(pieces: list[memoryview], prefix: int, size_of: Callable[[bytes], int]
                   ) -> bytes:
    """The frame header at the start of `pieces`: its size is read from its first `prefix`
    bytes with `size_of` (which raises InvalidFrame), then that many bytes are gathered."""
    size = size_of(b"".join(_byte_range(pieces, 0, prefix)))
    return b"".join(_byte_range(pieces, 0, size))


def _serialize(message: Any) -> bytes:
    return bytes(message.SerializeToString())


async def _parse(cls: type[M], raw: bytes, context: Any) -> M:
    try:
        return cls.FromString(raw)
    except DecodeError as exc:
        await _abort(context, grpc.StatusCode.INVALID_ARGUMENT,
                     f"not a {cls.DESCRIPTOR.name} message: {exc}")


async def _parse_put_stream(raw: AsyncIterator[bytes], context: Any
                            ) -> AsyncIterator[PutChunkView]:
    async for item in raw:
        try:
            chunk = decode_put_chunk(item)
        except InvalidFrame as exc:
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"bad PutChunk: {exc}")
        yield chunk

