"""Random ranking: the baseline llm-d's blog compares its schedulers with, and what a
Kubernetes Service with many endpoints approximates."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from router.membership.workers import WorkerState

__all__ = ["RandomPicker"]


@dataclass(slots=True)
class RandomPicker:
    """Ignores scores: a uniformly random order, from the policy's own random source (so a
    seeded run is repeatable)."""

    rng: random.Random = field(default_factory=random.Random)
    name: str = "random"

    def rank(self, candidates: Sequence[WorkerState], scores: Sequence[float]
             ) -> list[WorkerState]:
        order = list(candidates)
        self.rng.shuffle(order)
        return order
