"""What the decision pipeline takes (`RouteRequest`) and gives (`Decision`).

Deciding is pure and synchronous: it reads the worker pool, the session binding and the prefix
indexes, and returns a `Decision`. Sending (HTTP, etcd writes) happens after, elsewhere. That
split is what lets the benchmark time a decision alone and the tests check every policy without
a network.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from kvstore.keys import SessionId
from router.workers import WorkerId

__all__ = ["RouteReason", "RouteRequest", "Decision"]


class RouteReason(StrEnum):
    """Why a request goes where it goes; echoed to the client in `X-KVKeep-Route`."""

    STATELESS = "stateless"  # no session: prefix and load alone
    NEW = "new"  # first request of a session
    STICKY = "sticky"  # the session's worker
    MIGRATED = "migrated"  # the session's worker is overloaded: moved, KV restored from the store
    FAILOVER = "failover"  # the session's worker is dead or failing: moved, KV restored
    RESUMED = "resumed"  # a broken stream continues here


RESTORING_REASONS = frozenset({RouteReason.MIGRATED, RouteReason.FAILOVER, RouteReason.RESUMED})


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """The facts about one request that routing needs, computed once while parsing it.

    `prefix_keys` are chained hashes of the prompt text in fixed-size chunks (approximate prefix
    matching against the router's routing history); `block_keys` are chained hashes of full
    token blocks, known only when the prompt's token ids are (a token-id prompt, or a session
    whose earlier turns returned their ids), matched against the workers' KV events.
    """

    model: str
    session_id: SessionId | None = None
    prefix_keys: tuple[int, ...] = ()
    block_keys: tuple[int, ...] = ()
    tokens: int = 0
    exclude: frozenset[WorkerId] = frozenset()


@dataclass(frozen=True, slots=True)
class Decision:
    """Where to send a request, ranked fallbacks, and why.

    `previous` is the worker the session leaves (migration, failover, resumption): the new
    worker's connector is told to restore the session's KV from the store.
    """

    worker: WorkerId
    fallbacks: tuple[WorkerId, ...]
    reason: RouteReason
    previous: WorkerId | None = None

    @property
    def restore(self) -> bool:
        return self.reason in RESTORING_REASONS
