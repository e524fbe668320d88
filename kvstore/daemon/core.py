"""The transport-neutral core of a daemon: every decision a block or control call needs.

Both fronts, gRPC (grpc_front.py) and the TCP data plane (tcp_front.py), only translate: they
parse their wire into the core's arguments, call it, and write its answer, or the `Refusal` it
raised, back in their wire's terms (kvstore/net/refusal.py numbers the reasons for both). So
both admit and refuse exactly the same things, and count them in one set of counters:

- auth: `authenticate` (a bearer token, or none when auth is off) and `scope` (its tenant must
  be granted to the token); nothing touches the store before both pass.
- limits: keys per call, frame sizes (kvstore/net/limits.py).
- admission and budgets (kvstore/daemon/budgets.py): `admit_put_call` (a draining daemon
  refuses new puts; streams already running finish), `put_stream` (one of the tenant's put
  streams, held for the call), then per block `begin_put`: refused while the disk tier is full
  (RESOURCE_EXHAUSTED, which clients take as "not here" without opening their breaker), else
  the frame's bytes are taken from the tenant's and the daemon's in-flight put budgets and it
  gets where to receive the frame (`IncomingBlock`, with the deadline its bytes must arrive
  by). Free RAM pages only: a declared frame evicts nothing before its bytes arrive. Its
  `commit` verifies the whole frame (header, every segment's checksum, size, key binding)
  before anything is stored, so a malformed or corrupt frame is INVALID_ARGUMENT and nothing of
  it is stored; a block is stored only once its last byte arrived, so a client that dies
  mid-put leaves nothing behind. A tenant past its stored bytes then gives up its oldest
  blocks.
- per-block state: the catalog follows the disk tier's removals (kvstore/daemon/catalog.py),
  and puts do not fill the key cache, so a daemon's memory does not grow with the blocks it
  ever stored.
- back-pressure: a put is acknowledged only while the store's write-behind queue (host ->
  nvme) is below `max_pending_writes` blocks, `max_pending_bytes` bytes' worth of blocks of its
  size, and half the blocks of that size the RAM tier holds, so acknowledged blocks can neither
  outrun the disk and be dropped from the queue unwritten, nor be evicted from RAM before the
  write-behind has copied them down. A put whose copy could not be queued, or whose wait for
  the disk passed `backpressure_timeout`, is refused (RESOURCE_EXHAUSTED, counted), never
  acknowledged (M3). `commit` waits (`wait_for_disk`, blocking: the TCP front's own connection
  thread, woken as the writer finishes each batch) unless the caller waits itself
  (`IncomingBlock.wait_for_disk = False`): the gRPC front waits on its event loop, so a
  tenant's slow disk holds no thread of the executor every tenant's reads share (M2).
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
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Protocol, TypeVar, runtime_checkable

from kvstore.daemon.auth import ANONYMOUS, AuthFailure, Principal, TokenTable
from kvstore.daemon.block_io import (
    SCRATCH_BYTES,
    IncomingBlock,
    OutgoingBlock,
    ScratchPool,
    byte_range,
)
from kvstore.daemon.budgets import DaemonLimits, PutBudgets, TenantLimits, block_cost
from kvstore.daemon.catalog import KeyCatalog
from kvstore.daemon.counters import COUNTER_NAMES, Counters, ServiceStatus
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
from kvstore.manifest import SessionRecord, decode_session_record
from kvstore.net.limits import MAX_FRAME_BYTES, MAX_KEYS_PER_CALL
from kvstore.net.refusal import Refusal, RefusalReason
from kvstore.net.scope import Scope
from kvstore.store import TieredStore

__all__ = ["BlockServiceCore", "Counters", "ServiceStatus", "DiskTier", "store_contains"]

_log = logging.getLogger(__name__)
R = RefusalReason
# RAM kept free for frames declared and not yet arrived (a sixteenth of the RAM tier, at most
# this): puts in flight at once are received straight into free pages; beyond it, a frame is
# received into a buffer and copied in once it has arrived, which is when it may evict.
_KEEP_FREE_MAX = 256 << 20
T = TypeVar("T")
MAX_GENERATION_AHEAD_US = 30 * 86_400 * 1_000_000
"""How far ahead of the wall clock a session record's generation may be: a month, far beyond any
clock skew or router epoch head start (a minute per epoch), far below 2**62 (M7)."""


def _charged(principal: Principal | None) -> str | None:
    """The name budgets are charged to besides the tenant: the token (M6). None with auth
    off (ANONYMOUS: loopback only, every caller the same)."""
    return None if principal is None or principal is ANONYMOUS else principal.name


@runtime_checkable
class DiskTier(Protocol):
    """A tier that knows when its disk is full and tells who follows its contents what it
    dropped (the nvme tier)."""

    @property
    def admitting(self) -> bool: ...

    def subscribe_removals(self, listener: Callable[[Sequence[bytes]], None]) -> None: ...


class BlockServiceCore:
    """Auth, limits, budgets, admission, reads and back-pressure over the daemon's store.

    `limits` default to `DaemonLimits.scaled` over the store's first tier's budget (RAM) and
    its disk tier's; `max_inflight_put_bytes` alone sets a single shared put budget (one
    tenant may hold all of it), as before per-tenant budgets.
    """

    def __init__(self, node_id: str, store: TieredStore, catalog: KeyCatalog, *,
                 tokens: TokenTable | None, limits: DaemonLimits | None = None,
                 max_inflight_put_bytes: int | None = None, max_pending_writes: int = 512,
                 max_pending_bytes: int | None = 256 << 20,
                 backpressure_timeout: float = 30.0, read_deadline: float = 10.0,
                 scratch_buffers: int = 8, key_cache_limit: int = 1 << 16) -> None:
        self.node_id = node_id
        self.data_port = 0
        """The TCP data plane's port (tcp_front.py), 0 when there is none."""
        self._store = store
        self._catalog = catalog
        self._tokens = tokens
        budgets = [t.stats().bytes_budget for t in store.tiers]
        disks = [t for t in store.tiers if isinstance(t, DiskTier)]
        self._disk = disks[-1] if disks else None
        if self._disk is not None:
            self._disk.subscribe_removals(catalog.forget)
        if limits is None:
            if max_inflight_put_bytes is not None:
                limits = DaemonLimits(max_inflight_put_bytes, TenantLimits(
                    max_inflight_put_bytes, 1 << 20, None))
            else:
                limits = DaemonLimits.scaled(budgets[0], budgets[-1])
        self._budgets = PutBudgets(limits)
        self._max_pending = max_pending_writes
        self._max_pending_bytes = max_pending_bytes
        self._ram_budget, self._ram_page = budgets[0], int(getattr(store.tiers[0],
                                                                   "page_bytes", 1))
        keep_free = getattr(store.tiers[0], "keep_free", None)
        if callable(keep_free):  # room for declared frames, so that they need not evict
            keep_free(min(limits.tenant.put_bytes, budgets[0] // 16, _KEEP_FREE_MAX))
        self._backpressure_timeout = backpressure_timeout
        self._read_deadline = read_deadline
        self._draining = False
        self._keys = KeyCache(key_cache_limit)
        self._scratch = ScratchPool(SCRATCH_BYTES, scratch_buffers)
        self._lock = threading.Lock()  # the counters
        self._counts = dict.fromkeys(COUNTER_NAMES, 0)

    # -- state and counters -------------------------------------------------------------------

    @property
    def draining(self) -> bool:
        return self._draining

    def start_draining(self) -> None:
        """Refuse new puts from now on; streams already running finish."""
        self._draining = True

    @property
    def limits(self) -> DaemonLimits:
        return self._budgets.limits

    @property
    def budgets(self) -> PutBudgets:
        return self._budgets

    @property
    def cached_keys(self) -> int:
        """Keys in the key cache (bounded by `key_cache_limit`)."""
        return len(self._keys)

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

    def keys(self, scope: Scope, hashes: Sequence[bytes], *, remember: bool = True
             ) -> list[BlockKey]:
        """The BlockKeys of `hashes` in `scope`, interned (see KeyCache) when `remember`:
        lookups, which ask about the same prefixes over and over. Block reads and writes move
        far more bytes than a key costs to build, and would fill the cache with keys asked
        for once."""
        if len(hashes) > MAX_KEYS_PER_CALL:
            raise Refusal(R.RESOURCE_EXHAUSTED,
                          f"{len(hashes)} keys in one call; at most {MAX_KEYS_PER_CALL}")
        try:
            return self._keys.keys(scope, hashes, remember=remember)
        except InvalidKey as exc:
            raise Refusal(R.INVALID_ARGUMENT, str(exc)) from None

    def key(self, scope: Scope, block_hash: bytes) -> BlockKey:
        """The key of one block to read (not remembered: see `keys`)."""
        return self.keys(scope, (block_hash,), remember=False)[0]

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

    @contextmanager
    def put_stream(self, scope: Scope, principal: Principal | None = None) -> Iterator[None]:
        """Hold one of the scope's tenant's (and the token's, M6) put streams while a put call
        runs; refused (RESOURCE_EXHAUSTED) when the tenant or the token holds all of them."""
        tenant, charged = scope.namespace.tenant, _charged(principal)
        try:
            self._budgets.open_stream(tenant, charged)
        except Refusal:
            self.count(refused_puts=1)
            raise
        try:
            yield
        finally:
            self._budgets.close_stream(tenant, charged)

    @contextmanager
    def read_stream(self, scope: Scope, principal: Principal | None = None) -> Iterator[None]:
        """Hold one of the tenant's (and the token's) read streams while a read call runs
        (M1); refused (RESOURCE_EXHAUSTED) when all are held."""
        tenant, charged = scope.namespace.tenant, _charged(principal)
        try:
            self._budgets.open_read(tenant, charged)
        except Refusal:
            self.count(refused_reads=1)
            raise
        try:
            yield
        finally:
            self._budgets.close_read(tenant, charged)

    @contextmanager
    def read_bytes(self, scope: Scope, size: int, principal: Principal | None = None
                   ) -> Iterator[None]:
        """Hold `size` bytes of the tenant's (and the token's) read budget while a block is
        being sent (M1): the pages it pins, or the buffer it was read into."""
        tenant, charged = scope.namespace.tenant, _charged(principal)
        try:
            self._budgets.take_read_bytes(tenant, size, charged)
        except Refusal:
            self.count(refused_reads=1)
            raise
        try:
            yield
        finally:
            self._budgets.give_read_bytes(tenant, size, charged)

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

    def begin_put(self, scope: Scope, block_hash: bytes, size: int,
                  principal: Principal | None = None) -> IncomingBlock:
        """Admit a `size`-byte frame for a block: where to receive it (free pages only: it
        evicts nothing before it arrives), and by when (`IncomingBlock.deadline`); its bytes
        are taken from the tenant's and the daemon's in-flight put budgets until it is
        committed or aborted. Refused while the disk is full."""
        self.check_frame_size(size)
        try:
            key = self._keys.keys(scope, (block_hash,), remember=False)[0]
        except InvalidKey as exc:
            raise self.invalid_put(str(exc)) from None
        self.check_disk()
        tenant, charged = scope.namespace.tenant, _charged(principal)
        try:
            charge = self._budgets.take_bytes(tenant, size, charged)
        except Refusal:
            self.count(refused_puts=1)
            raise
        try:
            reservation = self._store.begin_put(key, size, evict=False)
        except KVKeepError:
            reservation = None  # received into a buffer instead, and stored by `put`
        deadline = time.monotonic() + self._budgets.limits.put_deadline(size)
        return IncomingBlock(key, size, reservation=reservation, pool=self._scratch,
                             commit=self._commit, deadline=deadline,
                             release=lambda: self._budgets.give_bytes(tenant, charge, charged))

    def check_disk(self) -> None:
        """Refuse a write while the disk tier is full (RESOURCE_EXHAUSTED): an ack would leave
        the block in RAM only, to be lost when it is evicted. Reads go on."""
        if self._disk is not None and not self._disk.admitting:
            self.count(refused_puts=1, disk_full_refusals=1)
            raise Refusal(R.RESOURCE_EXHAUSTED, "disk full: not admitting writes now")

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
        except TierFull as exc:  # in RAM, but its copy to disk could not be queued (M3)
            self.count(refused_puts=1, dropped_copy_refusals=1)
            raise Refusal(R.RESOURCE_EXHAUSTED, f"not durable, not acknowledged: {exc}"
                          ) from None
        except KVKeepError as exc:
            _log.warning("put of %s failed: %s", key.storage_name, exc)
            raise Refusal(R.UNAVAILABLE, f"store failed: {exc}") from None
        self.count(puts=1, rejected_puts=0 if admitted else 1)
        if admitted:
            self._catalog.add(((key, incoming.size),))
            self._enforce_stored_bytes(key)
            if incoming.wait_for_disk:
                self.wait_for_disk(incoming.size)
        return admitted

    def _enforce_stored_bytes(self, stored: BlockKey) -> None:
        """A tenant past its stored bytes (each block charged `block_cost`: its file-system
        blocks and its entry, M4) or past its block count gives up its oldest blocks (never the
        one just stored, never another tenant's)."""
        limits = self._budgets.limits
        tenant = stored.namespace.tenant
        over = (0 if limits.tenant.stored_bytes is None
                else self._catalog.tenant_cost(tenant) - limits.tenant.stored_bytes)
        extra = (0 if limits.max_blocks is None
                 else self._catalog.tenant_blocks(tenant) - limits.max_blocks)
        if over <= 0 and extra <= 0:
            return
        victims = [k for k in self._catalog.oldest_charged(
            tenant, over, block_cost, max(extra, 0))
                   if k.digest != stored.digest]
        if victims:
            self._store.delete(victims)
            self._catalog.discard(victims)
            self.count(tenant_evicted_blocks=len(victims))

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
        _, header = checked_frame(frame, key.digest, segments=True)
        # Into pages the first tier evicts for it, then `commit_put`, which tells a dropped
        # write-behind copy (TierFull: refused, never acknowledged) from a full tier (False).
        reservation = self._store.begin_put(key, len(frame), evict=True)
        if reservation is not None:
            pos = 0
            for dst in reservation.pieces:
                dst[:] = frame[pos:pos + len(dst)]
                pos += len(dst)
            return self._store.commit_put(reservation, header)
        # No pages (the tier holds it already, or cannot lend them): `put` keeps a copy for
        # the write-behind when the first tier does not take it, so True is durable there.
        try:
            return self._store.put(key, frame)
        except TierFull:
            return False

    # -- back-pressure (M2, M3) ---------------------------------------------------------------

    def backpressure_mark(self, size: int) -> int:
        """The write-behind depth past which a put of `size` bytes is not acknowledged yet (see
        the module doc)."""
        page = max(self._ram_page, 1)
        held = max(-(-size // page), 1) * page  # the RAM a block of `size` takes
        marks = [self._max_pending, self._ram_budget // held // 2]
        if self._max_pending_bytes is not None:
            marks.append(self._max_pending_bytes // held)
        return max(1, min(marks))

    def when_disk_within(self, mark: int, wake: Callable[[], None]) -> Callable[[], None]:
        """Call `wake` once the write-behind queue is at most `mark` deep (at once if it is);
        returns what cancels the call. For the gRPC front's event loop (see wait_for_disk)."""
        return self._store.when_pending_writes_at_most(mark, wake)

    @property
    def backpressure_timeout(self) -> float:
        return self._backpressure_timeout

    def backpressure_refusal(self) -> Refusal:
        """The refusal of a put whose ack waited `backpressure_timeout` for the disk (counted):
        acknowledging it anyway would let acknowledged blocks outrun the disk (M3)."""
        self.count(refused_puts=1, backpressure_refusals=1)
        return Refusal(R.RESOURCE_EXHAUSTED,
                       f"the disk is {self._store.pending_writes} writes behind for "
                       f"{self._backpressure_timeout:g}s: not acknowledged; retry later")

    def wait_for_disk(self, size: int) -> None:
        """Hold the ack while the write-behind queue is over its mark; refuse once it stayed
        there `backpressure_timeout`. Blocking: for the TCP front's own connection threads;
        the gRPC front waits on its event loop instead (never on the shared executor, M2)."""
        if not self._store.wait_pending_writes(self.backpressure_mark(size),
                                               self._backpressure_timeout):
            raise self.backpressure_refusal()

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
        return self._store.holds(keys)  # a caller's: the write-behind gives way to it

    def delete(self, keys: list[BlockKey]) -> int:
        try:
            deleted = self._store.delete(keys)
        except KVKeepError as exc:
            raise Refusal(R.UNAVAILABLE, f"delete failed: {exc}") from None
        self._catalog.discard(keys)
        return deleted

    def put_manifest(self, principal: Principal, encoded: bytes) -> None:
        """Store a session's record: a KV manifest or a conversation record (kvstore/
        manifest.py), each checked by its own decoder, and both by tenant and generation."""
        try:
            record = decode_session_record(encoded)
        except CorruptBlock as exc:
            raise Refusal(R.INVALID_ARGUMENT, f"bad manifest: {exc}") from None
        if not principal.may_access(record.key.namespace.tenant):
            raise Refusal(R.PERMISSION_DENIED,
                          "the manifest's tenant is not granted to this token")
        # Generations are wall-clock microseconds plus a minute per router epoch (connectors/
        # vllm/manifests.py, router/conversations/records.py): one far ahead of the clock would
        # pin the session, every later write silently losing to it (M7).
        ahead = record.generation - time.time_ns() // 1000
        if ahead > MAX_GENERATION_AHEAD_US:
            self.count(invalid_puts=1)
            raise Refusal(R.INVALID_ARGUMENT,
                          f"manifest generation {record.generation} is {ahead / 1e6:.0f}s "
                          f"ahead of this daemon's clock (at most "
                          f"{MAX_GENERATION_AHEAD_US // 1_000_000}s)")
        self.admit_put_call()
        self.check_disk()
        self._store_call(self._store.put_manifest, record)

    def get_manifest(self, key: SessionKey) -> SessionRecord | None:
        """Whatever kind of record the key holds: the daemon serves bytes, the reader asks
        for a kind."""
        return self._store_call(self._store.get_record, key)

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
    """Which keys some tier holds: one batched `contains` per tier, asking only for misses.
    For the daemon's own background work (replication, the catalog's check at start): unlike
    `TieredStore.holds`, which callers' lookups use, it does not hold the write-behind back."""
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
