"""In-process state: one router replica only (nothing is shared, nothing survives a restart).

Same semantics as etcd where the router depends on them: a global revision counter for CAS,
leases that expire `ttl_s` after the last keepalive, watches that deliver every change in
order. A reaper task expires leases and idle bindings every 100 ms (`reap`, which a caller
without an event loop, such as a simulator on its own clock, may call itself).
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvstore.cluster.hints import PrefetchHint
from kvstore.keys import SessionId
from router.membership.workers import WorkerId, WorkerInfo
from router.state.base import BindingSink, WorkerLease, WorkerSink
from router.state.bindings import Binding, VersionedBinding

__all__ = ["MemoryBackend", "MemoryLease"]

_REAP_INTERVAL_S = 0.1


@dataclass(slots=True)
class MemoryLease:
    backend: MemoryBackend
    worker_id: WorkerId
    ttl: float
    expires: float
    revoked: bool = False

    @property
    def ttl_s(self) -> float:
        return self.ttl

    async def keepalive(self) -> bool:
        current = self.backend._leases.get(self.worker_id)
        if self.revoked or current is not self:
            return False
        self.expires = self.backend.clock() + self.ttl
        return True

    async def update(self, info: WorkerInfo) -> None:
        if self.backend._leases.get(self.worker_id) is self:
            self.backend._put_worker(info)

    async def revoke(self) -> None:
        self.revoked = True
        if self.backend._leases.get(self.worker_id) is self:
            self.backend._drop_worker(self.worker_id)


@dataclass(slots=True)
class MemoryBackend:
    clock: Callable[[], float] = field(default=time.monotonic)
    _revision: int = 0
    _workers: dict[WorkerId, WorkerInfo] = field(default_factory=dict)
    _leases: dict[WorkerId, MemoryLease] = field(default_factory=dict)
    _bindings: dict[SessionId, tuple[VersionedBinding, float]] = field(default_factory=dict)
    _worker_sinks: list[WorkerSink] = field(default_factory=list)
    _binding_sinks: list[BindingSink] = field(default_factory=list)
    # (deadline, revision, session): a binding re-written since has a newer revision and its
    # old entry is skipped, so expiry costs O(log n) per write instead of a scan per tick.
    _expiry: list[tuple[float, int, SessionId]] = field(default_factory=list)
    _reaper: asyncio.Task[None] | None = None

    @property
    def name(self) -> str:
        return "memory"

    @property
    def shared(self) -> bool:
        return False

    async def start(self) -> None:
        if self._reaper is None:
            self._reaper = asyncio.get_running_loop().create_task(self._reap(), name="state-reaper")

    async def close(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
            self._reaper = None

    # --- workers ---------------------------------------------------------------------------
    async def register_worker(self, info: WorkerInfo, ttl_s: float) -> WorkerLease:
        lease = MemoryLease(self, info.worker_id, ttl_s, self.clock() + ttl_s)
        self._leases[info.worker_id] = lease
        self._put_worker(info)
        return lease

    async def list_workers(self) -> list[WorkerInfo]:
        return list(self._workers.values())

    async def follow_workers(self, sink: WorkerSink) -> None:
        sink.reset_workers(list(self._workers.values()))
        self._worker_sinks.append(sink)
        try:
            await asyncio.Event().wait()
        finally:
            self._worker_sinks.remove(sink)

    # --- bindings --------------------------------------------------------------------------
    async def get_binding(self, session_id: SessionId) -> VersionedBinding | None:
        entry = self._bindings.get(session_id)
        return entry[0] if entry is not None else None

    async def cas_binding(self, binding: Binding, expected_revision: int | None, ttl_s: float,
                          prefetch: PrefetchHint | None = None
                          ) -> tuple[bool, VersionedBinding | None]:
        # `prefetch` is dropped: a connector learns hints from etcd, and there is none here.
        entry = self._bindings.get(binding.session_id)
        current = entry[0] if entry is not None else None
        if (current.revision if current is not None else None) != expected_revision:
            return False, current
        self._revision += 1
        vb = VersionedBinding(binding, self._revision)
        deadline = self.clock() + ttl_s
        self._bindings[binding.session_id] = (vb, deadline)
        heapq.heappush(self._expiry, (deadline, vb.revision, binding.session_id))
        for sink in list(self._binding_sinks):
            sink.put(vb)
        return True, vb

    async def follow_bindings(self, sink: BindingSink) -> None:
        self.attach_bindings(sink)
        try:
            await asyncio.Event().wait()
        finally:
            self._binding_sinks.remove(sink)

    def attach_bindings(self, sink: BindingSink) -> None:
        """Feed `sink` every binding change from now on, synchronously (what `follow_bindings`
        does, without a task to run it: for a caller without an event loop)."""
        sink.reset([vb for vb, _ in self._bindings.values()])
        self._binding_sinks.append(sink)

    # --- private ---------------------------------------------------------------------------
    def _put_worker(self, info: WorkerInfo) -> None:
        self._revision += 1
        self._workers[info.worker_id] = info
        for sink in list(self._worker_sinks):
            sink.put_worker(info)

    def _drop_worker(self, worker_id: WorkerId) -> None:
        self._leases.pop(worker_id, None)
        if self._workers.pop(worker_id, None) is not None:
            self._revision += 1
            for sink in list(self._worker_sinks):
                sink.delete_worker(worker_id)

    def reap(self) -> None:
        """Expire the leases and bindings whose time (on `clock`) has come."""
        now = self.clock()
        for worker_id, lease in list(self._leases.items()):
            if lease.expires <= now:
                self._drop_worker(worker_id)
        heap = self._expiry
        while heap and heap[0][0] <= now:
            _, revision, sid = heapq.heappop(heap)
            entry = self._bindings.get(sid)
            if entry is None or entry[0].revision != revision:
                continue
            del self._bindings[sid]
            self._revision += 1
            for sink in list(self._binding_sinks):
                sink.delete(sid, self._revision)

    async def _reap(self) -> None:
        while True:
            await asyncio.sleep(_REAP_INTERVAL_S)
            self.reap()
