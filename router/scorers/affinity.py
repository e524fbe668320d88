"""Session affinity: 1 for the worker the session is bound to, 0 elsewhere."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from router.context import DecisionContext
from router.membership.workers import WorkerState

__all__ = ["SessionAffinityScorer"]


@dataclass(frozen=True, slots=True)
class SessionAffinityScorer:
    name: str = "affinity"

    def score(self, ctx: DecisionContext, candidates: Sequence[WorkerState]) -> list[float]:
        bound = ctx.bound
        return [1.0 if w.worker_id == bound else 0.0 for w in candidates]
