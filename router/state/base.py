"""The state backend interface: worker registrations with leases, session bindings with CAS.

Two implementations: `EtcdBackend` (shared by any number of router replicas and worker agents)
and `MemoryBackend` (one process: a single router replica, tests). Consumers never poll: they
hand a sink to `follow_workers` / `follow_bindings`, which first `reset` it with a full listing
and then stream changes, re-listing after any reconnect, until cancelled.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from kvstore.cluster.hints import PrefetchHint
from kvstore.keys import SessionId
from router.membership.workers import WorkerId, WorkerInfo
from router.state.bindings import Binding, VersionedBinding

__all__ = ["WorkerSink", "BindingSink", "WorkerLease", "StateBackend"]


class WorkerSink(Protocol):
    def reset_workers(self, infos: Iterable[WorkerInfo]) -> None: ...

    def put_worker(self, info: WorkerInfo) -> None: ...

    def delete_worker(self, worker_id: WorkerId) -> None: ...


class BindingSink(Protocol):
    def reset(self, bindings: Iterable[VersionedBinding]) -> None: ...

    def put(self, vb: VersionedBinding) -> None: ...

    def delete(self, session_id: SessionId, revision: int) -> None: ...


class WorkerLease(Protocol):
    """A worker's registration, alive while refreshed. The holder refreshes every TTL/3."""

    @property
    def ttl_s(self) -> float: ...

    async def keepalive(self) -> bool:
        """Refresh; False if the lease had already expired (the caller re-registers)."""
        ...

    async def update(self, info: WorkerInfo) -> None:
        """Replace the registered record under the same lease (draining, GPU figures)."""
        ...

    async def revoke(self) -> None:
        """Deregister now: routers see the worker gone without waiting for the TTL."""
        ...


class StateBackend(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def shared(self) -> bool:
        """Whether several router processes can share this state."""
        ...

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def register_worker(self, info: WorkerInfo, ttl_s: float) -> WorkerLease: ...

    async def list_workers(self) -> list[WorkerInfo]: ...

    async def follow_workers(self, sink: WorkerSink) -> None: ...

    async def get_binding(self, session_id: SessionId) -> VersionedBinding | None: ...

    async def cas_binding(self, binding: Binding, expected_revision: int | None, ttl_s: float,
                          prefetch: PrefetchHint | None = None
                          ) -> tuple[bool, VersionedBinding | None]:
        """Write `binding` iff the stored revision is `expected_revision` (None: iff absent).

        Returns (written, binding now stored): on success the new revision, on failure the
        binding that won (or None if the session has no binding any more). `prefetch`: also
        tell the binding's worker to prefetch the session (kvstore/cluster/hints.py), in the
        same write; a backend with no shared state to carry it ignores it.
        """
        ...

    async def follow_bindings(self, sink: BindingSink) -> None: ...
