"""The transport-neutral core of a daemon: every decision a block or control call needs.

Both fronts, gRPC (grpc_front.py) and the TCP data plane (tcp_front.py), only translate: they
parse their wire into the core's arguments, call it, and write its answer, or the `Refusal` it
raised, back in their wire's terms (kvstore/net/refusal.py numbers the reasons for both). So
both admit and refuse exactly the same things, and count them in one set of counters:

- auth: `authenticate` (a bearer token, or none when auth is off) and `scope` (its tenant must
  be granted to the token); nothing touches the store before both pass.
- limits: keys per call, frame sizes (kvstore/net/limits.py).
- admission and budgets: `admit_put_call` (a draining daemon refuses new puts; streams already
  running finish), then per block `begin_put`, which takes the frame's bytes from the in-flight
  put budget and returns where to receive it (`IncomingBlock`). Its `commit` verifies the whole
  frame (header, every segment's checksum, size, key binding) before anything is stored, so a
  malformed or corrupt frame is INVALID_ARGUMENT and nothing of it is stored; a block is stored
  only once its last byte arrived, so a client that dies mid-put leaves nothing behind.
- back-pressure: a put is acknowledged only while the store's write-behind queue (host ->
  nvme) is below `max_pending_writes`, so acknowledged blocks cannot outrun the disk and be
  dropped from the queue unwritten.
- reads: `open_read` lends a block's pages in place from host RAM (key binding checked before,
  segment checksums right after they are sent: the client verifies every block anyway, and
  hashing first would put ~0.1 ms per 4 MiB on the critical path; a copy that fails is dropped
  at once, so the next read finds the nvme copy or a replica), else reads it, verified, into a
  pooled scratch buffer.

Every method is synchronous and thread-safe: the gRPC front runs the slow ones (copies, disk
reads, checksums) on the daemon's thread pool; the TCP front calls them from its connection
threads.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import TypeVar

from kvstore.daemon.auth import ANONYMOUS, AuthFailure, Principal, TokenTable
from kvstore.daemon.block_io import (
    SCRATCH_BYTES,
    IncomingBlock,
    OutgoingBlock,
    ScratchPool,
    byte_range,
)
from kvstore.daemon.catalog import KeyCatalog
from kvstore.daemon.key_cache import KeyCache
from kvstore.errors import CorruptBlock, InvalidKey, KVKeepError, TierFull
from kvstore.frame import (
    HEADER_PREFIX_BYTES,
    FrameHeader,
    LayerRange,
    checked_frame,
    header_size_from_prefix,
    verify_pieces,
)
from kvstore.keys import BlockKey, SessionKey
from kvstore.manifest import SessionManifest
from kvstore.net.limits import MAX_FRAME_BYTES, MAX_KEYS_PER_CALL
from kvstore.net.refusal import Refusal, RefusalReason
from kvstore.net.scope import Scope
from kvstore.store import TieredStore
from kvstore.tiers.base import TierStats

__all__ = ["BlockServiceCore", "Counters", "ServiceStatus", "store_contains"]

_log = logging.getLogger(__name__)
R = RefusalReason
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Counters:
    """Wire and request counters since start (both fronts together)."""

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


_COUNTER_NAMES = tuple(f.name for f in fields(Counters))


@dataclass(frozen=True, slots=True)
class ServiceStatus:
    """What Stat reports."""

    node_id: str
    draining: bool
    counters: Counters
    tiers: tuple[TierStats, ...]
    pending_writes: int
    data_port: int


class BlockServiceCore:
    """Auth, limits, budgets, admission, reads and back-pressure over the daemon's store."""

    def __init__(self, node_id: str, store: TieredStore, catalog: KeyCatalog, *,
                 tokens: TokenTable | None, max_inflight_put_bytes: int = 4 << 30,
                 max_pending_writes: int = 64, backpressure_timeout: float = 30.0,
                 read_deadline: float = 10.0, scratch_buffers: int = 8) -> None:
        self.node_id = node_id
        self.data_port = 0
        """The TCP data plane's port (tcp_front.py), 0 when there is none."""
        self._store = store
        self._catalog = catalog
        self._tokens = tokens
        self._inflight_budget = max_inflight_put_bytes
        self._inflight = 0
        self._max_pending = max_pending_writes
        self._backpressure_timeout = backpressure_timeout
        self._read_deadline = read_deadline
        self._draining = False
        self._keys = KeyCache()
        self._scratch = ScratchPool(SCRATCH_BYTES, scratch_buffers)
        self._lock = threading.Lock()  # the counters and the in-flight budget
        self._counts = dict.fromkeys(_COUNTER_NAMES, 0)

    # -- state and counters -------------------------------------------------------------------

    @property
    def draining(self) -> bool:
        return self._draining

    def start_draining(self) -> None:
        """Refuse new puts from now on; streams already running finish."""
        self._draining = True

    def count(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                self._counts[name] += delta

    def counters(self) -> Counters:
        with self._lock:
            return Counters(**self._counts)

    # -- who and where ------------------------------------------------------------------------

    def authenticate(self, token: str | None) -> Principal:
        """The principal of a bearer token (everyone is ANONYMOUS when auth is off)."""
        if self._tokens is None:
            return ANONYMOUS
        result = self._tokens.authenticate(token)
        if isinstance(result, AuthFailure):
            raise Refusal(R.UNAUTHENTICATED, result.message)
        return result

    def scope(self, principal: Principal, fingerprint: bytes, tenant: str, salt: str) -> Scope:
        """A scope from the wire, once valid and granted to `principal`."""
        try:
            scope = Scope.parse(fingerprint, tenant, salt)
        except InvalidKey as exc:
            raise Refusal(R.INVALID_ARGUMENT, f"bad scope: {exc}") from None
        if not principal.may_access(scope.namespace.tenant):
            raise Refusal(R.PERMISSION_DENIED,
                          f"tenant {scope.namespace.tenant!r} is not granted to this token")
        return scope

    def keys(self, scope: Scope, hashes: Sequence[bytes]) -> list[BlockKey]:
        """The BlockKeys of `hashes` in `scope`, interned (see KeyCache)."""
        if len(hashes) > MAX_KEYS_PER_CALL:
            raise Refusal(R.RESOURCE_EXHAUSTED,
                          f"{len(hashes)} keys in one call; at most {MAX_KEYS_PER_CALL}")
        try:
            return self._keys.keys(scope, hashes)
        except InvalidKey as exc:
            raise Refusal(R.INVALID_ARGUMENT, str(exc)) from None

    def key(self, scope: Scope, block_hash: bytes) -> BlockKey:
        return self.keys(scope, (block_hash,))[0]

    def session_key(self, scope: Scope, session_id: str) -> SessionKey:
        try:
            return scope.session_key(session_id)
        except InvalidKey as exc:
            raise Refusal(R.INVALID_ARGUMENT, str(exc)) from None

    # -- puts ---------------------------------------------------------------------------------

    def admit_put_call(self) -> None:
        """Refuse a new put call (a stream, a request) while draining."""
        if self._draining:
            raise Refusal(R.UNAVAILABLE, "daemon is draining")

    def check_frame_size(self, size: int) -> None:
        if size > MAX_FRAME_BYTES:
            self.count(invalid_puts=1)
            raise Refusal(R.RESOURCE_EXHAUSTED, f"frame of {size} bytes exceeds {MAX_FRAME_BYTES}")
        if size < HEADER_PREFIX_BYTES:
            raise self.invalid_put(f"frame size {size} is too small")

    def invalid_put(self, message: str) -> Refusal:
        """The refusal of a malformed put (counted), for the caller to raise."""
        self.count(invalid_puts=1)
        return Refusal(R.INVALID_ARGUMENT, message)

    def begin_put(self, scope: Scope, block_hash: bytes, size: int) -> IncomingBlock:
        """Admit a `size`-byte frame for a block: where to receive it, its bytes taken from the
        in-flight put budget until it is committed or aborted."""
        self.check_frame_size(size)
        try:
            key = self.key(scope, block_hash)
        except Refusal as refusal:
            raise self.invalid_put(refusal.message) from None
        with self._lock:
            if self._inflight + size > self._inflight_budget:
                raise Refusal(R.RESOURCE_EXHAUSTED, "too many put bytes in flight; retry later")
            self._inflight += size
        try:
            reservation = self._store.begin_put(key, size)
        except KVKeepError:
            reservation = None  # received into a buffer instead, and stored by `put`
        return IncomingBlock(key, size, reservation=reservation, pool=self._scratch,
                             commit=self._commit, release=lambda: self._release_budget(size))

    def _release_budget(self, size: int) -> None:
        with self._lock:
            self._inflight -= size

    def _commit(self, incoming: IncomingBlock) -> bool:
        """Verify a received frame and store it (IncomingBlock.commit)."""
        key = incoming.key
        try:
            if incoming.reservation is not None:
                admitted = self._publish(incoming)
            else:
                admitted = self._store_frame(key, incoming.frame)
        except (CorruptBlock, ValueError) as exc:  # InvalidFrame is both
            raise self.invalid_put(f"rejected frame: {exc}") from None
        except KVKeepError as exc:
            _log.warning("put of %s failed: %s", key.storage_name, exc)
            raise Refusal(R.UNAVAILABLE, f"store failed: {exc}") from None
        self.count(puts=1, rejected_puts=0 if admitted else 1)
        if admitted:
            self._catalog.add((key,))
            self._wait_for_disk()
        return admitted

    def _publish(self, incoming: IncomingBlock) -> bool:
        """The checks `_store_frame` makes, on a frame received into reserved pages; on any
        failure the pages are given back and nothing is stored."""
        reservation = incoming.reservation
        assert reservation is not None
        try:
            pieces = reservation.pieces
            prefix = b"".join(byte_range(pieces, 0, HEADER_PREFIX_BYTES))
            header = FrameHeader.unpack(b"".join(byte_range(
                pieces, 0, header_size_from_prefix(prefix))))
            if header.frame_size != incoming.size:
                raise CorruptBlock(f"frame of {incoming.size} bytes, its header describes "
                                   f"{header.frame_size}")
            if header.key_digest != incoming.key.digest:
                raise CorruptBlock("frame is bound to a different key")
            verify_pieces(header, header.all_layers,
                          byte_range(pieces, header.header_size, incoming.size))
        except BaseException:
            reservation.abort()
            raise
        return self._store.commit_put(reservation, header)

    def _store_frame(self, key: BlockKey, frame: memoryview) -> bool:
        checked_frame(frame, key.digest, segments=True)
        try:
            return self._store.put(key, frame)
        except TierFull:
            return False

    def _wait_for_disk(self) -> None:
        """Hold the ack while the write-behind queue is over its mark (see the module doc)."""
        end = time.monotonic() + self._backpressure_timeout
        while self._store.pending_writes > self._max_pending and time.monotonic() < end:
            time.sleep(0.001)

    # -- reads --------------------------------------------------------------------------------

    def open_read(self, key: BlockKey, layers: tuple[int, int] | None) -> OutgoingBlock | None:
        """The block (or the segments of `layers`) to send, or None on a miss (counted);
        the caller must `finish()` it once sent."""
        try:
            span = None if layers is None else LayerRange(*layers)
        except ValueError as exc:
            raise Refusal(R.INVALID_ARGUMENT, str(exc)) from None
        self.count(gets=1)
        outgoing = self._borrow(key, span) or self._read(key, span)
        self.count(**({"hits": 1} if outgoing is not None else {"misses": 1}))
        return outgoing

    def _borrow(self, key: BlockKey, layers: LayerRange | None) -> OutgoingBlock | None:
        try:
            block = self._store.borrow(key, layers, verify=False)
        except KVKeepError:
            return None
        if block is None:
            return None

        def check() -> bool:
            try:
                ok = self._store.check_borrowed(key, block)
            except KVKeepError:
                ok = False
            if not ok:
                _log.warning("a corrupt copy of %s was lent out (dropped now; the client's own "
                             "check rejects it)", key.storage_name)
            return ok
        return OutgoingBlock.borrowed(block, check)

    def _read(self, key: BlockKey, layers: LayerRange | None) -> OutgoingBlock | None:
        """A verified read from any tier, into a scratch buffer when it fits one."""
        scratch = self._scratch.take(SCRATCH_BYTES)
        try:
            deadline = time.monotonic() + self._read_deadline
            read = self._store.get(key, layers, out=scratch, deadline=deadline)
            if read is None:  # a miss, or a block bigger than the scratch buffer
                read = self._store.get(key, layers, deadline=deadline)
        except ValueError as exc:  # a layer range beyond the block's layers
            self._scratch.give(scratch)
            raise Refusal(R.INVALID_ARGUMENT, str(exc)) from None
        except KVKeepError as exc:  # a failing tier reads as empty
            _log.warning("get of %s failed: %s", key.storage_name, exc)
            read = None
        if read is None:
            self._scratch.give(scratch)
            return None

        def finish() -> bool:
            self._scratch.give(scratch)
            return True
        return OutgoingBlock(read.header, read.layers, [memoryview(read.payload).cast("B")],
                             finish)

    # -- control calls ------------------------------------------------------------------------

    def lookup(self, keys: list[BlockKey]) -> list[bool]:
        self.count(lookups=1)
        return store_contains(self._store, keys)

    def delete(self, keys: list[BlockKey]) -> int:
        try:
            deleted = self._store.delete(keys)
        except KVKeepError as exc:
            raise Refusal(R.UNAVAILABLE, f"delete failed: {exc}") from None
        self._catalog.discard(keys)
        return deleted

    def put_manifest(self, principal: Principal, encoded: bytes) -> None:
        try:
            manifest = SessionManifest.decode(encoded)
        except CorruptBlock as exc:
            raise Refusal(R.INVALID_ARGUMENT, f"bad manifest: {exc}") from None
        if not principal.may_access(manifest.key.namespace.tenant):
            raise Refusal(R.PERMISSION_DENIED,
                          "the manifest's tenant is not granted to this token")
        self.admit_put_call()
        self._store_call(self._store.put_manifest, manifest)

    def get_manifest(self, key: SessionKey) -> SessionManifest | None:
        return self._store_call(self._store.get_manifest, key)

    def delete_manifest(self, key: SessionKey) -> bool:
        return self._store_call(self._store.delete_manifest, key)

    def status(self) -> ServiceStatus:
        stats = self._store_call(self._store.stats)
        return ServiceStatus(self.node_id, self._draining, self.counters(), tuple(stats.tiers),
                             stats.pending_writes, self.data_port)

    @staticmethod
    def _store_call(fn: Callable[..., T], *args: object) -> T:
        try:
            return fn(*args)
        except CorruptBlock as exc:
            raise Refusal(R.DATA_LOSS, str(exc)) from None
        except KVKeepError as exc:
            raise Refusal(R.UNAVAILABLE, f"store failed: {exc}") from None


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
