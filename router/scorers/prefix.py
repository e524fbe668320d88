"""Prefix-cache scorers: matched leading blocks / total blocks of the prompt.

`ApproxPrefixScorer` reads the routing history (prompt text chunks); `PrecisePrefixScorer`
reads the KV-event index (token blocks, weighted by tier, with blocks in a shared kvkeep store
counted for every worker). Both are llm-d's formula.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from router.context import DecisionContext
from router.indexer.events import MEDIUM_WEIGHTS, SHARED
from router.membership.workers import WorkerState

__all__ = ["ApproxPrefixScorer", "PrecisePrefixScorer", "BestPrefixScorer"]


@dataclass(frozen=True, slots=True)
class ApproxPrefixScorer:
    name: str = "prefix"

    def score(self, ctx: DecisionContext, candidates: Sequence[WorkerState]) -> list[float]:
        total = len(ctx.request.prefix_keys)
        if total == 0:
            return [0.0] * len(candidates)
        matches = ctx.approx_matches()
        if not matches:
            return [0.0] * len(candidates)
        return [matches.get(w.worker_id, 0) / total for w in candidates]


@dataclass(frozen=True, slots=True)
class PrecisePrefixScorer:
    """`storage_weight`: what a block a worker can restore from storage (kvkeep's store on its
    node or shared) counts for, against 1.0 for a block in its own device cache."""

    storage_weight: float = MEDIUM_WEIGHTS["STORAGE"]
    name: str = "precise-prefix"

    def score(self, ctx: DecisionContext, candidates: Sequence[WorkerState]) -> list[float]:
        total = len(ctx.request.block_keys)
        if total == 0:
            return [0.0] * len(candidates)
        matches = ctx.precise_matches(self.storage_weight)
        if not matches:
            return [0.0] * len(candidates)
        anywhere = matches.get(SHARED, 0.0)  # blocks in a store every worker can restore from
        return [min(1.0, matches.get(w.worker_id, anywhere) / total) for w in candidates]


@dataclass(frozen=True, slots=True)
class BestPrefixScorer:
    """The precise score where the KV-event index knows the prompt's blocks, else the
    approximate one: one prefix signal, as llm-d configures it, never counted twice."""

    storage_weight: float = MEDIUM_WEIGHTS["STORAGE"]
    name: str = "best-prefix"

    def score(self, ctx: DecisionContext, candidates: Sequence[WorkerState]) -> list[float]:
        if ctx.request.block_keys and ctx.precise_matches(self.storage_weight):
            return PrecisePrefixScorer(self.storage_weight).score(ctx, candidates)
        return ApproxPrefixScorer().score(ctx, candidates)
