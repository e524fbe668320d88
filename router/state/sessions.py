"""Session -> worker bindings, shared by every router replica through the state backend.

A binding changes only by compare-and-swap on its revision, so two replicas that decide
differently for one session at the same moment cannot both win: the loser reads the winner's
binding and routes there. Every replica keeps a full cache of the bindings, fed by a watch, so
decisions read memory (microseconds) and only a *change* of binding costs a backend round trip.

Bindings expire after `ttl_s` without use. A binding in use is re-written once per quarter TTL
(`touch`), not per request, so a busy session costs the backend almost nothing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

from kvstore.cluster.hints import PrefetchHint
from kvstore.keys import SessionId
from router.membership.workers import WorkerId
from router.state.base import StateBackend
from router.state.bindings import Binding, VersionedBinding
from router.tenants import DEFAULT_TENANT

__all__ = ["Binding", "VersionedBinding", "SessionTable"]

log = logging.getLogger(__name__)


@dataclass(slots=True)
class SessionTable:
    """The local cache of all bindings plus CAS writes through the backend.

    The cache is a sink of the backend's binding watch (`reset`, `put`, `delete`) and also
    updated directly by this replica's own successful writes, so a replica reads its own writes
    before the watch echoes them.
    """

    backend: StateBackend
    ttl_s: float = 3600.0
    clock: Callable[[], float] = field(default=time.time, repr=False)
    conflicts: int = 0
    _cache: dict[SessionId, VersionedBinding] = field(default_factory=dict)
    _by_worker: dict[WorkerId, set[SessionId]] = field(default_factory=dict)
    _by_owner: dict[str, int] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self._cache)

    def owned_by(self, tenant: str) -> int:
        """Bindings of `tenant`'s sessions (every replica's, as the watch shows them)."""
        return self._by_owner.get(tenant, 0)

    def get(self, session_id: SessionId) -> VersionedBinding | None:
        return self._cache.get(session_id)

    def bound_to(self, worker: WorkerId) -> list[SessionId]:
        return list(self._by_worker.get(worker, ()))

    async def fetch(self, session_id: SessionId) -> VersionedBinding | None:
        """Read through to the backend (used where the watch may lag, e.g. after a conflict)."""
        current = await self.backend.get_binding(session_id)
        self._store(session_id, current)
        return current

    async def bind(self, session_id: SessionId, worker: WorkerId, model: str, *,
                   expected: VersionedBinding | None, reason: str,
                   restore_from: WorkerId | None, owner: str = DEFAULT_TENANT,
                   prefetch: bool = False, salt: str | None = None
                   ) -> tuple[bool, VersionedBinding | None]:
        """CAS the session onto `worker`. Returns (won, binding now in force).

        `expected` is what the decision was based on (None: the session must be new, and
        `owner` creates it; a moved session keeps its owner). On a lost race the winner's
        binding comes back and the caller routes there instead. `prefetch`: the move also
        writes a prefetch hint for `worker` (kvstore/cluster/hints.py), naming the session's
        cache `salt`: a failover, where the next turn has not arrived yet.
        """
        epoch = expected.binding.epoch + 1 if expected is not None else 0
        if expected is not None:
            owner = expected.binding.owner
        binding = Binding(session_id, worker, model, epoch, restore_from, reason,
                          self._now(), owner)
        hint = (PrefetchHint(session_id, model, epoch, binding.updated, salt) if prefetch
                else None)
        won, current = await self.backend.cas_binding(
            binding, expected.revision if expected is not None else None, self.ttl_s, hint)
        if not won:
            self.conflicts += 1
        self._store(session_id, current)
        return won, current

    async def touch(self, current: VersionedBinding, *, settle: bool = False) -> None:
        """Renew a binding's TTL if a quarter of it has passed; `settle` also clears the restore
        hint after a successful request on the new worker. Losing the CAS is fine: someone else
        wrote a newer binding."""
        if not self.needs_touch(current, settle=settle):
            return
        b = current.binding
        renewed = replace(b, restore_from=None if settle else b.restore_from,
                          updated=self._now())
        _, now = await self.backend.cas_binding(renewed, current.revision, self.ttl_s)
        self._store(b.session_id, now)

    def needs_touch(self, current: VersionedBinding, *, settle: bool = False) -> bool:
        b = current.binding
        return (settle and b.restore_from is not None) or \
            self._now() - b.updated >= self.ttl_s / 4

    # --- sink of the backend's watch -------------------------------------------------------
    def reset(self, bindings: Iterable[VersionedBinding]) -> None:
        self._cache.clear()
        self._by_worker.clear()
        self._by_owner.clear()
        for vb in bindings:
            self._store(vb.binding.session_id, vb)

    def put(self, vb: VersionedBinding) -> None:
        self._store(vb.binding.session_id, vb)

    def delete(self, session_id: SessionId, revision: int) -> None:
        old = self._cache.get(session_id)
        if old is None or old.revision <= revision:
            self._store(session_id, None)

    # --- private ---------------------------------------------------------------------------
    def _now(self) -> float:
        return self.clock()

    def _store(self, session_id: SessionId, vb: VersionedBinding | None) -> None:
        old = self._cache.get(session_id)
        if old is not None and vb is not None and vb.revision < old.revision:
            return  # a watch event older than what this replica already wrote
        if old is not None:
            peers = self._by_worker.get(old.worker_id)
            if peers is not None:
                peers.discard(session_id)
                if not peers:
                    del self._by_worker[old.worker_id]
            owner = old.binding.owner
            left = self._by_owner.get(owner, 0) - 1
            if left > 0:
                self._by_owner[owner] = left
            else:
                self._by_owner.pop(owner, None)
        if vb is None:
            self._cache.pop(session_id, None)
            return
        self._cache[session_id] = vb
        self._by_worker.setdefault(vb.worker_id, set()).add(session_id)
        owner = vb.binding.owner
        self._by_owner[owner] = self._by_owner.get(owner, 0) + 1
