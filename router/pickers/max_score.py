"""Max-score picker: highest weighted score first, ties broken at random (llm-d shuffles first),
so equally good workers share load instead of the first-listed one taking every tie."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from router.membership.workers import WorkerState

__all__ = ["MaxScorePicker"]


@dataclass(slots=True)
class MaxScorePicker:
    rng: random.Random = field(default_factory=random.Random)
    name: str = "max-score"

    def rank(self, candidates: Sequence[WorkerState], scores: Sequence[float]
             ) -> list[WorkerState]:
        if not scores:  # no scorer (every weight 0): all equally good, a random order
            scores = [0.0] * len(candidates)
        elif len(scores) != len(candidates):
            raise ValueError(f"{len(scores)} scores for {len(candidates)} candidates")
        order = list(range(len(candidates)))
        self.rng.shuffle(order)
        # sort is stable: after the shuffle, equal scores come out in random order.
        order.sort(key=scores.__getitem__, reverse=True)
        return [candidates[i] for i in order]
