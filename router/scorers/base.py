"""The scorer extension point: one score in [0, 1] per candidate, higher is better."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from router.context import DecisionContext
from router.membership.workers import WorkerState

__all__ = ["Scorer", "spread"]


class Scorer(Protocol):
    @property
    def name(self) -> str: ...

    def score(self, ctx: DecisionContext, candidates: Sequence[WorkerState]) -> list[float]:
        """Scores aligned with `candidates`, each in [0, 1]."""
        ...


def spread(values: Sequence[float]) -> list[float]:
    """llm-d's min-max normalisation, lower raw value = higher score: (max - v) / (max - min).

    All equal gives 1.0 to all: nobody is worse, and a constant adds nothing to the ranking.
    """
    if not values:
        return []
    hi, lo = max(values), min(values)
    if hi == lo:
        return [1.0] * len(values)
    span = hi - lo
    return [(hi - v) / span for v in values]
