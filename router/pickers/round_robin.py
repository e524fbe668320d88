"""Round robin (the baseline every router is compared with) and least-utilised ranking."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from router.membership.workers import WorkerState

__all__ = ["RoundRobinPicker", "LeastUtilisedPicker"]


@dataclass(slots=True)
class RoundRobinPicker:
    """Ignores scores; rotates over the candidates by worker id so the order is stable while
    membership changes."""

    name: str = "round-robin"
    _counter: itertools.count[int] = field(default_factory=itertools.count)

    def rank(self, candidates: Sequence[WorkerState], scores: Sequence[float]
             ) -> list[WorkerState]:
        if not candidates:
            return []
        ordered = sorted(candidates, key=lambda w: w.worker_id)
        start = next(self._counter) % len(ordered)
        return ordered[start:] + ordered[:start]


@dataclass(frozen=True, slots=True)
class LeastUtilisedPicker:
    """Lowest (KV usage, queue, in-flight tokens) first; used when every worker is over a soft
    threshold, so a new session lands where it waits least rather than behind a hot worker."""

    name: str = "least-utilised"

    def rank(self, candidates: Sequence[WorkerState], scores: Sequence[float]
             ) -> list[WorkerState]:
        return sorted(candidates, key=lambda w: (w.queue, w.kv_usage, w.inflight_tokens))
