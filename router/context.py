"""The per-decision context that filters, scorers and pickers share.

Prefix matches are computed lazily and once: two scorers that both need them (and a policy that
needs none) cost what they should.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from router.decision import RouteRequest
from router.indexer.events import KVBlockIndex
from router.indexer.history import RoutingHistory
from router.workers import WorkerId

__all__ = ["DecisionContext"]


@dataclass(slots=True)
class DecisionContext:
    request: RouteRequest
    now: float
    bound: WorkerId | None = None
    history: RoutingHistory | None = None
    blocks: KVBlockIndex | None = None
    _approx: dict[WorkerId, int] | None = field(default=None, repr=False)
    _precise: dict[WorkerId, float] | None = field(default=None, repr=False)

    def approx_matches(self) -> dict[WorkerId, int]:
        """Leading prompt chunks each worker was routed before (routing history)."""
        if self._approx is None:
            keys = self.request.prefix_keys
            self._approx = self.history.match(keys) if self.history and keys else {}
        return self._approx

    def precise_matches(self) -> dict[WorkerId, float]:
        """Tier-weighted leading token blocks each worker holds (KV events)."""
        if self._precise is None:
            keys = self.request.block_keys
            self._precise = self.blocks.match(keys) if self.blocks and keys else {}
        return self._precise
