"""The filter extension point: keep the candidate workers a request may go to."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from router.context import DecisionContext
from router.membership.workers import WorkerState

__all__ = ["Filter"]


class Filter(Protocol):
    """Returns the subset of `candidates` that passes, in the same order."""

    @property
    def name(self) -> str: ...

    def apply(self, ctx: DecisionContext, candidates: Sequence[WorkerState]
              ) -> list[WorkerState]: ...
