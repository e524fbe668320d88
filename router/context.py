"""The per-decision context that filters, scorers and pickers share.

Prefix matches are computed lazily and once: two scorers that both need them (and a policy that
needs none) cost what they should.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from router.decision import RouteRequest
from router.indexer.events import KVBlockIndex
from router.indexer.history import RoutingHistory
from router.membership.workers import WorkerId

__all__ = ["DecisionContext"]


@dataclass(slots=True)
class DecisionContext:
    request: RouteRequest
    now: float
    bound: WorkerId | None = None
    history: RoutingHistory | None = None
    blocks: KVBlockIndex | None = None
    _approx: dict[WorkerId, int] | None = field(default=None, repr=False)
    _precise: dict[float | None, dict[WorkerId, float]] = field(default_factory=dict, repr=False)

    def approx_matches(self) -> dict[WorkerId, int]:
        """Leading prompt chunks each worker was routed before (routing history)."""
        if self._approx is None:
            keys = self.request.prefix_keys
            self._approx = self.history.match(keys) if self.history and keys else {}
        return self._approx

    def precise_matches(self, storage_weight: float | None = None) -> dict[WorkerId, float]:
        """Tier-weighted leading token blocks each worker holds (KV events); `storage_weight`
        overrides the index's weight of blocks in storage (kvkeep's store included)."""
        found = self._precise.get(storage_weight)
        if found is None:
            keys = self.request.block_keys
            found = self.blocks.match(keys, storage_weight) if self.blocks and keys else {}
            self._precise[storage_weight] = found
        return found
