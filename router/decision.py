"""What the decision pipeline takes (`RequestFeatures`, `RouteRequest`) and gives (`Decision`,
`Placement`).

Deciding is pure and synchronous: it reads the worker pool, the session binding and the prefix
indexes, and returns a `Decision`. Sending (HTTP, etcd writes) happens after, elsewhere. That
split is what lets the benchmark time a decision alone, the tests check every policy without a
network, and a simulator drive the router's own policy code.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from kvstore.keys import SessionId
from router.membership.workers import WorkerId
from router.state.bindings import VersionedBinding
from router.tenants import DEFAULT_TENANT

__all__ = ["RouteReason", "RequestFeatures", "RouteRequest", "Decision", "Placement",
           "RESTORING_REASONS", "DEFAULT_MAX_TOKENS"]

DEFAULT_MAX_TOKENS = 256
"""New tokens assumed for load accounting when a request does not bound them."""


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
class RequestFeatures:
    """What routing needs to know about one request, before any key is computed.

    The prompt comes as token ids (`prompt_tokens`: precise prefix scoring against the workers'
    KV events, and approximate scoring of their decimal text) or as text (`prompt_text`: only
    the approximate prefix score works on text, unless the session's earlier turns returned
    their token ids). The HTTP front builds one from each parsed request; a simulator builds
    them directly.

    `tenant` owns the session (another tenant's request for it is refused) and `cache_salt`
    roots its prefix keys: vLLM keys its cache by the salt, so the router's indexes do too,
    and one tenant's cached prefix never steers (or shows in) another's routing.
    """

    model: str
    session_id: SessionId | None = None
    prompt_tokens: tuple[int, ...] | None = None
    prompt_text: str | None = None
    max_tokens: int | None = None
    tenant: str = DEFAULT_TENANT
    cache_salt: str | None = None

    @property
    def text(self) -> str:
        """The text approximate prefix keys are cut from (token ids in decimal, when only they
        are known: what the HTTP front does for a token-id prompt)."""
        if self.prompt_text is not None:
            return self.prompt_text
        return " ".join(map(str, self.prompt_tokens)) if self.prompt_tokens else ""

    @property
    def estimated_tokens(self) -> int:
        """Prompt + new tokens, for load accounting (4 characters a token when untokenized)."""
        prompt = len(self.prompt_tokens) if self.prompt_tokens is not None \
            else len(self.prompt_text or "") // 4
        return prompt + (self.max_tokens if self.max_tokens is not None else DEFAULT_MAX_TOKENS)


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """The facts about one request that the pipeline reads, keys computed once.

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
    tenant: str = DEFAULT_TENANT
    key_root: int = 0
    """The root both key chains start from (`router.indexer.keys.salt_root` of the cache
    salt): a session's next-turn keys are chained from it too."""


@dataclass(frozen=True, slots=True)
class Decision:
    """Where to send a request, and why.

    `previous` is the worker the session leaves (migration, failover, resumption): the new
    worker's connector is told to restore the session's KV from the store.
    """

    worker: WorkerId
    reason: RouteReason
    previous: WorkerId | None = None

    @property
    def restore(self) -> bool:
        return self.reason in RESTORING_REASONS


@dataclass(frozen=True, slots=True)
class Placement:
    """A decision plus the session binding in force after committing it: what is sent."""

    decision: Decision
    binding: VersionedBinding | None
    route: RouteRequest
    pending: bool = False
    """A new session whose binding is written once the worker accepts the request
    (`RouterCore.accepted`), not before: a request that no worker takes creates nothing."""

    @property
    def worker(self) -> WorkerId:
        return self.decision.worker

    @property
    def restore_from(self) -> WorkerId | None:
        """The worker the session's KV was on, when it has to be restored here."""
        if self.decision.previous is not None:
            return self.decision.previous
        return self.binding.binding.restore_from if self.binding is not None else None

    @property
    def label(self) -> str:
        """What happened, for `X-KVKeep-Route`: a pending restore reports why it moved."""
        if self.decision.reason is RouteReason.STICKY and self.restore_from is not None \
                and self.binding is not None:
            return self.binding.binding.reason
        return self.decision.reason.value
