"""etcd state: worker registrations under leases, session bindings changed by transactions.

Layout under a prefix (default `/kvkeep`):
- `{prefix}/workers/{worker_id}`: `WorkerInfo` JSON, attached to the worker agent's lease. The
  key vanishes when the lease expires (TTL to TTL + 0.5 s after the last keepalive) or is
  revoked, and every router replica's watch sees the DELETE: that is worker death.
- `{prefix}/sessions/{session_id}`: `Binding` JSON. Written only in a transaction that compares
  the key's mod revision with the one the writer read (version 0 for a new session), so
  replicas never split a session.
- `{prefix}/prefetch/{worker_id}/{session_id}`: `PrefetchHint` JSON, written in the transaction
  that moves a session to `worker_id` at failover, on the binding's lease: that worker's
  connector watches its own prefix and warms its host tier (kvstore/cluster/hints.py).

Session TTLs use one lease per time bucket (a quarter TTL wide, living TTL + a quarter): a
lease per session would cost a lease grant per new session and a keepalive per active one;
a bucket costs one grant per quarter TTL. A binding in use is re-written into the current bucket
by `SessionTable.touch`.

aetcd has no background keepalive: whoever holds a lease refreshes it (`EtcdLease.keepalive`,
every TTL/3 from the worker agent), and the refresh also reads the key back and writes it again
if anyone changed it (kvstore/cluster/lease.py).

Both watches are the control plane's `PrefixWatcher` (kvstore/cluster/watcher.py): a record is
believed only while attached to a lease, only under the key its id names (a copy of `w1` under
`workers/zzz` is refused, so deleting it cannot matter and a restart cannot resurrect it), and
every field is type-checked; a record that fails is skipped and counted (`rejected`, and
`kvkeep_router_etcd_records_ignored_total` once `export_metrics` is called), never fatal to
the watch.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import aetcd  # type: ignore[import-untyped]
import aetcd.rpc  # type: ignore[import-untyped]
from prometheus_client import CollectorRegistry
from prometheus_client import Counter as PromCounter

from kvstore.cluster.hints import PrefetchHint, hint_key
from kvstore.cluster.lease import LeaseKeeper
from kvstore.cluster.records import EtcdRecord
from kvstore.cluster.watcher import PrefixWatcher
from kvstore.errors import UntrustedRegistration
from kvstore.etcd import EtcdSpec, etcd_client, etcd_spec
from kvstore.keys import SessionId
from router.errors import StateUnavailable
from router.membership.workers import MalformedWorker, WorkerId, WorkerInfo
from router.state.base import BindingSink, WorkerLease, WorkerSink
from router.state.bindings import Binding, MalformedBinding, VersionedBinding

__all__ = ["EtcdBackend", "EtcdLease"]

log = logging.getLogger(__name__)

# Errors that mean "etcd is unreachable or the call failed", translated to StateUnavailable.
_ETCD_ERRORS = (aetcd.ClientError, aetcd.rpc.AioRpcError, OSError, asyncio.TimeoutError)


class EtcdLease:
    """A worker's registration: the control plane's lease keeper (kvstore/cluster/lease.py)
    on the backend's client. Each keepalive also reads the key back and rewrites it when
    someone else changed or deleted it under the live lease."""

    __slots__ = ("_keeper", "backend", "info")

    def __init__(self, backend: EtcdBackend, keeper: LeaseKeeper, info: WorkerInfo) -> None:
        self.backend = backend
        self._keeper = keeper
        self.info = info

    @property
    def ttl_s(self) -> float:
        return self._keeper.ttl_s

    @property
    def lease_id(self) -> int:
        return self._keeper.lease_id or 0

    @property
    def rewrites(self) -> int:
        """Times the key was found tampered with (or gone) under the live lease, and rewritten."""
        return self._keeper.rewrites

    async def keepalive(self) -> bool:
        try:
            return await self._keeper.refresh(await self.backend.client())
        except _ETCD_ERRORS as exc:
            raise StateUnavailable(f"lease keepalive failed: {exc}") from exc

    async def update(self, info: WorkerInfo) -> None:
        self.info = info
        value = info.to_json()
        try:
            await self._keeper.replace(await self.backend.client(), lambda _lease: value)
        except _ETCD_ERRORS as exc:
            raise StateUnavailable(f"worker update failed: {exc}") from exc

    async def revoke(self) -> None:
        try:
            await self._keeper.revoke(await self.backend.client())
        except _ETCD_ERRORS as exc:
            raise StateUnavailable(f"lease revoke failed: {exc}") from exc


@dataclass(slots=True)
class EtcdBackend:
    """`etcd`: a URL, or an `EtcdSpec` with TLS and credentials (kvstore/etcd/spec.py)."""

    etcd: EtcdSpec | str
    prefix: str = "/kvkeep"
    # Short: a request that has to record a binding waits this long when etcd is away before
    # it is routed unrecorded.
    timeout_s: float = 2.0
    # A worker whose registration is deleted and put again within this long never leaves.
    # When etcd stalls (paused, a slow disk, a leader election) past the workers' lease TTL,
    # it expires every lease at once on resuming and each live agent re-registers within
    # ~10-100 ms: acting on those deletes would drop every healthy worker for that moment
    # (requests answered 503, sessions rebound). A worker that is really gone leaves this much
    # later than its lease: a small price next to its TTL.
    worker_delete_grace_s: float = 1.0
    rejected: Counter[tuple[str, str]] = field(default_factory=Counter)
    """Records skipped, by (prefix: workers or sessions, reason): malformed (deep nesting,
    wrong field types, binary), no-lease (written by hand), wrong-key (a value claiming
    another key's id), sink-error."""
    _rejected_metric: Any = None
    _client: Any = None
    _dials: int = 0
    _bucket_leases: dict[int, int] = field(default_factory=dict)
    _bucket_lock: asyncio.Lock | None = None
    binding_breaker_s: float = 2.0
    """After a binding write fails for want of etcd, the next ones fail at once for this long
    instead of each waiting `timeout_s` (an etcd outage must not add seconds to every new
    session's first token; the binding is simply not recorded, as on any failure)."""
    _etcd_down_until: float = 0.0

    def __post_init__(self) -> None:
        self.etcd = etcd_spec(self.etcd)

    @property
    def name(self) -> str:
        return f"etcd {etcd_spec(self.etcd).describe()}"

    @property
    def shared(self) -> bool:
        return True

    @property
    def workers_prefix(self) -> bytes:
        return f"{self.prefix.rstrip('/')}/workers/".encode()

    @property
    def sessions_prefix(self) -> bytes:
        return f"{self.prefix.rstrip('/')}/sessions/".encode()

    async def start(self) -> None:
        await self.client()

    async def client(self) -> Any:
        if self._client is None:
            self._client = etcd_client(self.etcd, self._dials, timeout=self.timeout_s)
        return self._client

    async def _next_endpoint(self) -> None:
        """After a failure, with several endpoints: the next client dials the next one."""
        if len(etcd_spec(self.etcd).endpoints) < 2 or self._client is None:
            return
        client, self._client = self._client, None
        self._dials += 1
        await self._close_client(client)

    async def close(self) -> None:
        if self._client is not None:
            client, self._client = self._client, None
            await self._close_client(client)

    async def _close_client(self, client: Any) -> None:
        """Close `client`, waiting at most `timeout_s`: a close shuts aetcd's watch stream
        down through grpc, whose confirmation can be lost (router/tasks.cancel_and_wait)."""
        closing = asyncio.ensure_future(client.close())
        done, _ = await asyncio.wait({closing}, timeout=self.timeout_s)
        if not done:
            log.warning("etcd client close did not end within %.1fs; abandoned",
                        self.timeout_s)
        elif not closing.cancelled() and (exc := closing.exception()) is not None:
            if not isinstance(exc, _ETCD_ERRORS):
                raise exc
            log.debug("etcd close failed: %s", exc)

    def export_metrics(self, registry: CollectorRegistry) -> None:
        """Count skipped records in `registry` too (the router's own), as
        `kvkeep_router_etcd_records_ignored_total{prefix, reason}`."""
        self._rejected_metric = PromCounter(
            "kvkeep_router_etcd_records_ignored",
            "etcd records ignored by the router's watches, by prefix (workers, sessions) and "
            "reason (malformed, no-lease, wrong-key, sink-error)",
            ["prefix", "reason"], registry=registry)
        for (kind, reason), n in self.rejected.items():
            self._rejected_metric.labels(kind, reason).inc(n)

    def _count(self, kind: str, reason: str) -> None:
        self.rejected[kind, reason] += 1
        if self._rejected_metric is not None:
            self._rejected_metric.labels(kind, reason).inc()

    # --- workers ---------------------------------------------------------------------------
    async def register_worker(self, info: WorkerInfo, ttl_s: float) -> WorkerLease:
        client = await self.client()
        value = info.to_json()
        keeper = LeaseKeeper(self.workers_prefix + info.worker_id.encode(), lambda _: value,
                             ttl_s, timeout=self.timeout_s, what="worker registration")
        try:
            await keeper.register(client)
        except _ETCD_ERRORS as exc:
            raise StateUnavailable(f"worker registration failed: {exc}") from exc
        return EtcdLease(self, keeper, info)

    async def list_workers(self) -> list[WorkerInfo]:
        """The registered workers that pass the watch's checks (the others are skipped)."""
        client = await self.client()
        try:
            result = await client.get_prefix(self.workers_prefix)
        except _ETCD_ERRORS as exc:
            raise StateUnavailable(f"listing workers failed: {exc}") from exc
        infos = []
        for kv in result:
            try:
                record = EtcdRecord.of(self.workers_prefix, kv)
                info = _decode_worker(record)
                if not record.lease:
                    raise UntrustedRegistration("no-lease", record.name)
            except Exception as exc:  # one bad record is skipped, never fatal
                self._count("workers", getattr(exc, "reason", "malformed"))
                continue
            infos.append(info)
        return infos

    async def follow_workers(self, sink: WorkerSink) -> None:
        """Registrations count only while attached to a lease and only under the key their
        id names (`WorkerInfo.from_json`); a vanished one leaves after the grace."""
        await PrefixWatcher(
            _BackendClients(self), self.workers_prefix, _decode_worker, _WorkerSinkAdapter(sink),
            what="worker registration", require_lease=True,
            grace_s=self.worker_delete_grace_s, timeout=self.timeout_s,
            on_reject=lambda reason: self._count("workers", reason)).run()

    # --- bindings --------------------------------------------------------------------------
    async def get_binding(self, session_id: SessionId) -> VersionedBinding | None:
        client = await self.client()
        try:
            kv = await client.get(self.sessions_prefix + session_id.encode())
        except _ETCD_ERRORS as exc:
            raise StateUnavailable(f"reading session failed: {exc}") from exc
        if kv is None:
            return None
        return self._stored_binding(kv.value, session_id, int(kv.mod_revision))

    async def cas_binding(self, binding: Binding, expected_revision: int | None, ttl_s: float,
                          prefetch: PrefetchHint | None = None
                          ) -> tuple[bool, VersionedBinding | None]:
        wait = self._etcd_down_until - time.monotonic()
        if wait > 0:
            raise StateUnavailable(f"session CAS skipped: etcd failed a write moments ago "
                                   f"(trying again in {wait:.1f}s)")
        client = await self.client()
        key = self.sessions_prefix + binding.session_id.encode()
        tx = client.transactions
        compare = (tx.version(key) == 0 if expected_revision is None
                   else tx.mod(key) == expected_revision)
        for attempt in (1, 2):
            try:
                lease_id = await self._session_lease(ttl_s)
                writes = [tx.put(key, binding.to_json(), lease=lease_id)]
                if prefetch is not None:
                    writes.append(tx.put(
                        hint_key(self.prefix, binding.worker_id, binding.session_id),
                        prefetch.to_json(), lease=lease_id))
                ok, responses = await client.transaction(
                    compare=[compare],
                    success=writes,
                    failure=[tx.get(key)],
                )
                break
            except _ETCD_ERRORS as exc:
                if attempt == 1 and _lease_gone(exc):
                    # The bucket lease was revoked (or etcd restored from a snapshot): a new
                    # one, at once, rather than failing every write until the bucket rolls.
                    self._bucket_leases = {}
                    continue
                self._etcd_down_until = time.monotonic() + self.binding_breaker_s
                raise StateUnavailable(f"session CAS failed: {exc}") from exc
        self._etcd_down_until = 0.0
        if ok:
            return True, VersionedBinding(binding, int(responses[0].response_put.header.revision))
        found = responses[0] if responses else []
        if not found:
            return False, None
        value, meta = found[0]
        return False, self._stored_binding(value, binding.session_id, int(meta.mod_revision))

    async def follow_bindings(self, sink: BindingSink) -> None:
        """Bindings count only under the key their session names and only with a lease (the
        routers write every one under a bucket lease)."""
        await PrefixWatcher(
            _BackendClients(self), self.sessions_prefix, _decode_binding,
            _BindingSinkAdapter(sink), what="session binding", require_lease=True,
            timeout=self.timeout_s,
            on_reject=lambda reason: self._count("sessions", reason)).run()

    def _stored_binding(self, raw: bytes, session_id: SessionId, revision: int
                        ) -> VersionedBinding | None:
        """A binding read back directly; a malformed one is as good as none (counted)."""
        try:
            return VersionedBinding(Binding.from_json(raw, session_id), revision)
        except MalformedBinding as exc:
            self._count("sessions", exc.reason)
            log.warning("ignoring the stored binding of %r: %s", session_id[:100], exc)
            return None

    # --- private ---------------------------------------------------------------------------
    async def _session_lease(self, ttl_s: float) -> int:
        width = max(1.0, ttl_s / 4)
        bucket = int(time.time() // width)
        lease_id = self._bucket_leases.get(bucket)
        if lease_id is not None:
            return lease_id
        if self._bucket_lock is None:
            self._bucket_lock = asyncio.Lock()
        async with self._bucket_lock:
            lease_id = self._bucket_leases.get(bucket)
            if lease_id is None:
                client = await self.client()
                lease = await client.lease(math.ceil(ttl_s + width))
                lease_id = int(lease.id)
                # Older buckets' leases stay granted in etcd until they expire on their own.
                self._bucket_leases = {bucket: lease_id}
        return lease_id


def _lease_gone(exc: BaseException) -> bool:
    """etcd's answer to a write under a lease it does not have (revoked, expired early, or a
    restore from a snapshot)."""
    return "lease not found" in str(exc).lower()


class _BackendClients:
    """The watcher's client is the backend's own; after two failures in a row, the next
    endpoint's."""

    def __init__(self, backend: EtcdBackend) -> None:
        self._backend = backend

    async def acquire(self) -> Any:
        return await self._backend.client()

    async def release(self, client: Any, *, failures: int) -> None:
        if failures > 1:  # twice in a row: this endpoint may be the trouble
            await self._backend._next_endpoint()


def _decode_worker(record: EtcdRecord) -> WorkerInfo:
    try:
        return WorkerInfo.from_json(record.value, record.name)
    except MalformedWorker as exc:
        raise UntrustedRegistration(exc.reason, str(exc)) from None


def _decode_binding(record: EtcdRecord) -> VersionedBinding:
    try:
        return VersionedBinding(Binding.from_json(record.value, record.name),
                                record.mod_revision)
    except MalformedBinding as exc:
        raise UntrustedRegistration(exc.reason, str(exc)) from None


class _WorkerSinkAdapter:
    __slots__ = ("_sink",)

    def __init__(self, sink: WorkerSink) -> None:
        self._sink = sink

    def reset(self, items: Mapping[str, WorkerInfo]) -> None:
        self._sink.reset_workers(list(items.values()))

    def put(self, name: str, item: WorkerInfo) -> None:
        self._sink.put_worker(item)

    def delete(self, name: str, revision: int) -> None:
        self._sink.delete_worker(WorkerId(name))


class _BindingSinkAdapter:
    __slots__ = ("_sink",)

    def __init__(self, sink: BindingSink) -> None:
        self._sink = sink

    def reset(self, items: Mapping[str, VersionedBinding]) -> None:
        self._sink.reset(items.values())

    def put(self, name: str, item: VersionedBinding) -> None:
        self._sink.put(item)

    def delete(self, name: str, revision: int) -> None:
        self._sink.delete(SessionId(name), revision)
