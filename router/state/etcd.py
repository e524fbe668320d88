"""etcd state: worker registrations under leases, session bindings changed by transactions.

Layout under a prefix (default `/kvkeep`):
- `{prefix}/workers/{worker_id}`: `WorkerInfo` JSON, attached to the worker agent's lease. The
  key vanishes when the lease expires (TTL to TTL + 0.5 s after the last keepalive) or is
  revoked, and every router replica's watch sees the DELETE: that is worker death.
- `{prefix}/sessions/{session_id}`: `Binding` JSON. Written only in a transaction that compares
  the key's mod revision with the one the writer read (version 0 for a new session), so
  replicas never split a session.

Session TTLs use one lease per time bucket (a quarter TTL wide, living TTL + a quarter): a
lease per session would cost a lease grant per new session and a keepalive per active one;
a bucket costs one grant per quarter TTL. A binding in use is re-written into the current bucket
by `SessionTable.touch`.

aetcd has no background keepalive: whoever holds a lease refreshes it (`EtcdLease.keepalive`,
every TTL/3 from the worker agent).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aetcd  # type: ignore[import-untyped]
import aetcd.rpc  # type: ignore[import-untyped]

from kvstore.errors import ConfigError
from kvstore.etcd import EtcdSpec, etcd_client, etcd_spec
from kvstore.keys import SessionId
from router.bindings import Binding, VersionedBinding
from router.errors import StateUnavailable
from router.state.base import BindingSink, WorkerLease, WorkerSink
from router.workers import WorkerId, WorkerInfo

__all__ = ["EtcdBackend", "EtcdLease"]

log = logging.getLogger(__name__)

_BACKOFF_S = (0.1, 0.2, 0.5, 1.0, 2.0)
# Errors that mean "etcd is unreachable or the call failed", translated to StateUnavailable.
_ETCD_ERRORS = (aetcd.ClientError, aetcd.rpc.AioRpcError, OSError, asyncio.TimeoutError)


@dataclass(slots=True)
class EtcdLease:
    backend: EtcdBackend
    key: bytes
    info: WorkerInfo
    ttl: float
    lease_id: int

    @property
    def ttl_s(self) -> float:
        return self.ttl

    async def keepalive(self) -> bool:
        client = await self.backend.client()
        try:
            reply = await client.refresh_lease(self.lease_id)
        except _ETCD_ERRORS as exc:
            raise StateUnavailable(f"lease keepalive failed: {exc}") from exc
        return reply is not None and int(reply.TTL) > 0

    async def update(self, info: WorkerInfo) -> None:
        client = await self.backend.client()
        self.info = info
        try:
            await client.put(self.key, info.to_json(), lease=self.lease_id)
        except _ETCD_ERRORS as exc:
            raise StateUnavailable(f"worker update failed: {exc}") from exc

    async def revoke(self) -> None:
        client = await self.backend.client()
        try:
            await client.revoke_lease(self.lease_id)
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
    _client: Any = None
    _dials: int = 0
    _bucket_leases: dict[int, int] = field(default_factory=dict)
    _bucket_lock: asyncio.Lock | None = None

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
        try:
            await client.close()
        except _ETCD_ERRORS:
            log.debug("etcd close failed", exc_info=True)

    async def close(self) -> None:
        if self._client is not None:
            client, self._client = self._client, None
            try:
                await client.close()
            except _ETCD_ERRORS:
                log.debug("etcd close failed", exc_info=True)

    # --- workers ---------------------------------------------------------------------------
    async def register_worker(self, info: WorkerInfo, ttl_s: float) -> WorkerLease:
        client = await self.client()
        key = self.workers_prefix + info.worker_id.encode()
        try:
            lease = await client.lease(max(1, math.ceil(ttl_s)))
            await client.put(key, info.to_json(), lease=lease.id)
        except _ETCD_ERRORS as exc:
            raise StateUnavailable(f"worker registration failed: {exc}") from exc
        return EtcdLease(self, key, info, ttl_s, int(lease.id))

    async def list_workers(self) -> list[WorkerInfo]:
        client = await self.client()
        try:
            result = await client.get_prefix(self.workers_prefix)
        except _ETCD_ERRORS as exc:
            raise StateUnavailable(f"listing workers failed: {exc}") from exc
        return [WorkerInfo.from_json(kv.value) for kv in result]

    async def follow_workers(self, sink: WorkerSink) -> None:
        prefix = self.workers_prefix

        loop = asyncio.get_running_loop()
        leaving: dict[WorkerId, asyncio.TimerHandle] = {}

        def reset(kvs: list[Any]) -> None:
            infos = [info for kv in kvs if (info := _worker(kv.value)) is not None]
            for info in infos:
                if (timer := leaving.pop(info.worker_id, None)) is not None:
                    timer.cancel()
            sink.reset_workers(infos)

        def gone(worker: WorkerId) -> None:
            leaving.pop(worker, None)
            sink.delete_worker(worker)

        def put(kv: Any) -> None:
            info = _worker(kv.value)
            if info is not None:
                if (timer := leaving.pop(info.worker_id, None)) is not None:
                    timer.cancel()  # re-registered in time: it never left
                sink.put_worker(info)

        def delete(kv: Any) -> None:
            worker = WorkerId(kv.key[len(prefix):].decode())
            if self.worker_delete_grace_s <= 0:
                sink.delete_worker(worker)
            elif worker not in leaving:
                leaving[worker] = loop.call_later(self.worker_delete_grace_s, gone, worker)

        try:
            await self._follow(prefix, reset, put, delete)
        finally:
            for timer in leaving.values():
                timer.cancel()

    # --- bindings --------------------------------------------------------------------------
    async def get_binding(self, session_id: SessionId) -> VersionedBinding | None:
        client = await self.client()
        try:
            kv = await client.get(self.sessions_prefix + session_id.encode())
        except _ETCD_ERRORS as exc:
            raise StateUnavailable(f"reading session failed: {exc}") from exc
        if kv is None:
            return None
        return VersionedBinding(Binding.from_json(kv.value), int(kv.mod_revision))

    async def cas_binding(self, binding: Binding, expected_revision: int | None, ttl_s: float
                          ) -> tuple[bool, VersionedBinding | None]:
        client = await self.client()
        key = self.sessions_prefix + binding.session_id.encode()
        tx = client.transactions
        compare = (tx.version(key) == 0 if expected_revision is None
                   else tx.mod(key) == expected_revision)
        try:
            lease_id = await self._session_lease(ttl_s)
            ok, responses = await client.transaction(
                compare=[compare],
                success=[tx.put(key, binding.to_json(), lease=lease_id)],
                failure=[tx.get(key)],
            )
        except _ETCD_ERRORS as exc:
            raise StateUnavailable(f"session CAS failed: {exc}") from exc
        if ok:
            return True, VersionedBinding(binding, int(responses[0].response_put.header.revision))
        found = responses[0] if responses else []
        if not found:
            return False, None
        value, meta = found[0]
        return False, VersionedBinding(Binding.from_json(value), int(meta.mod_revision))

    async def follow_bindings(self, sink: BindingSink) -> None:
        def reset(kvs: list[Any]) -> None:
            sink.reset([vb for kv in kvs if (vb := _binding(kv)) is not None])

        def put(kv: Any) -> None:
            vb = _binding(kv)
            if vb is not None:
                sink.put(vb)

        def delete(kv: Any) -> None:
            sid = SessionId(kv.key[len(self.sessions_prefix):].decode())
            sink.delete(sid, int(kv.mod_revision))

        await self._follow(self.sessions_prefix, reset, put, delete)

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

    async def _follow(self, prefix: bytes, reset: Callable[[list[Any]], None],
                      put: Callable[[Any], None], delete: Callable[[Any], None]) -> None:
        """List, then watch from the listing's revision; on any failure, back off and redo.

        Re-listing after a reconnect (rather than resuming the watch) also covers a compacted
        revision and events missed while etcd was away.
        """
        failures = 0
        while True:
            try:
                client = await self.client()
                listing = await client.get_prefix(prefix)
                reset(list(listing))
                revision = int(listing.header.revision)
                watch = await client.watch_prefix(prefix, start_revision=revision + 1)
                failures = 0
                async for event in watch:
                    if event.kind == "DELETE":
                        delete(event.kv)
                    else:
                        put(event.kv)
                raise StateUnavailable("etcd watch ended")
            except (*_ETCD_ERRORS, StateUnavailable) as exc:
                delay = _BACKOFF_S[min(failures, len(_BACKOFF_S) - 1)]
                failures += 1
                log.warning("etcd watch on %s failed (%s); retrying in %.1fs",
                            prefix.decode(), exc, delay)
                if failures > 1:  # twice in a row: this endpoint may be the trouble
                    await self._next_endpoint()
                await asyncio.sleep(delay)


def _worker(raw: bytes) -> WorkerInfo | None:
    try:
        return WorkerInfo.from_json(raw)
    except ConfigError:
        log.warning("skipping malformed worker record %r", raw[:100])
        return None


def _binding(kv: Any) -> VersionedBinding | None:
    try:
        return VersionedBinding(Binding.from_json(kv.value), int(kv.mod_revision))
    except ConfigError:
        log.warning("skipping malformed binding %r", kv.key[:100])
        return None

