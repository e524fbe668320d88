"""Hard filters: a worker failing these can never take the request."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from router.context import DecisionContext
from router.membership.workers import WorkerState

__all__ = ["UsableFilter", "ModelFilter", "ExcludeFilter"]


@dataclass(frozen=True, slots=True)
class UsableFilter:
    """Alive (lease held), not draining, not suspect after repeated connection failures."""

    name: str = "usable"

    def apply(self, ctx: DecisionContext, candidates: Sequence[WorkerState]
              ) -> list[WorkerState]:
        now = ctx.now
        return [w for w in candidates if w.usable(now)]


@dataclass(frozen=True, slots=True)
class ModelFilter:
    """Serves the requested model."""

    name: str = "model"

    def apply(self, ctx: DecisionContext, candidates: Sequence[WorkerState]
              ) -> list[WorkerState]:
        model = ctx.request.model
        return [w for w in candidates if model in w.info.models]


@dataclass(frozen=True, slots=True)
class ExcludeFilter:
    """Not one the request already failed on (retries and resumption)."""

    name: str = "exclude"

    def apply(self, ctx: DecisionContext, candidates: Sequence[WorkerState]
              ) -> list[WorkerState]:
        exclude = ctx.request.exclude
        if not exclude:
            return list(candidates)
        return [w for w in candidates if w.worker_id not in exclude]
