"""What the scheduler half remembers about each request it has seen."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from connectors.vllm.metadata import LoadSpec
from connectors.vllm.params import RestoreParams
from kvstore.keys import Namespace

if TYPE_CHECKING:
    from vllm.v1.request import Request

__all__ = ["TrackedRequest", "LookupAnswer", "PendingProbe", "FlushState"]

FlushState = Literal["none", "wanted", "sent"]


@dataclass(frozen=True, slots=True)
class LookupAnswer:
    """How many blocks of [first, first + count) the store held as a prefix, and when asked
    (`time.monotonic()`)."""

    first: int
    count: int
    hit: int
    at: float

    def answers(self, first: int, count: int) -> bool:
        return (self.first, self.count) == (first, count)


@dataclass(frozen=True, slots=True)
class PendingProbe:
    """A lookup of [first, first + count) sent at `sent_at` (to the worker half, or to the
    background lookup thread), unanswered; `inline_tiers`: the store tier of each block of the
    prefix the in-memory tiers were found to hold when it was sent (what a late answer falls
    back to, and what the decision prices)."""

    first: int
    count: int
    sent_at: float
    inline_tiers: tuple[int, ...] = ()

    @property
    def inline_hit(self) -> int:
        return len(self.inline_tiers)

    def asks(self, first: int, count: int) -> bool:
        return (self.first, self.count) == (first, count)


@dataclass(slots=True)
class TrackedRequest:
    request: Request
    namespace: Namespace
    params: RestoreParams
    started_us: int
    """Wall-clock microseconds when the connector first saw the request (orders manifests)."""
    group_ids: list[list[int]] = field(default_factory=list)
    """Per KV cache group (`connectors.vllm.groups`), the paged block id of each block index
    (vLLM's null block where a sliding window freed it)."""
    local_blocks: int = 0
    lookup: LookupAnswer | None = None
    probe: PendingProbe | None = None
    pending_loads: tuple[LoadSpec, ...] = ()
    """To send with the next step's metadata (one per KV cache group)."""
    planned: int = 0
    """Blocks [0, planned) have a save planned, done, or found present."""
    hold_until_tokens: int = 0
    """After a failed save, no new plan before this many computed tokens (no hot retry)."""
    saved: set[int] = field(default_factory=set)
    saved_prefix: int = 0
    manifest_blocks: int = 0
    generation: int = 0
    finished: bool = False
    finished_at: float = 0.0
    """`time.monotonic()` when vLLM finished it (how long its late save reports are waited for)."""
    flush: FlushState = "none"
    """A finished request's last blocks: to be saved before vLLM frees them."""
    load_async: bool = False
    """How its restore loads, decided with its lookup (`load_mode`, and for "auto" where the
    restored blocks lie)."""
    loading_async: bool = False
    load_failed: bool = False
    """Its load failed as a whole (`failed_recving`, several KV cache groups): vLLM computes
    it from the start, and it is not offered a restore again."""
    restored_blocks: int = 0
    """Blocks of this request whose KV came from the store (over all of its loads)."""
    published_blocks: int = 0
    """The saved prefix announced in a KV event so far."""
    hint_checked: bool = False
    """A hinted restore's first lookup was compared with what it asked for."""

    @property
    def request_id(self) -> str:
        return str(self.request.request_id)

    @property
    def block_count(self) -> int:
        """Block indices vLLM has allocated for it (every group has an entry for each)."""
        return len(self.group_ids[0]) if self.group_ids else 0

    @property
    def saves_in_flight(self) -> bool:
        """Blocks planned for saving that have not been reported yet."""
        return self.saved_prefix < self.planned and len(self.saved) < self.planned
