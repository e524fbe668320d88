"""The picker extension point: rank the candidates; the first is the choice, the rest are
fallbacks tried in order if sending to it fails before the response starts."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from router.membership.workers import WorkerState

__all__ = ["Picker"]


class Picker(Protocol):
    @property
    def name(self) -> str: ...

    def rank(self, candidates: Sequence[WorkerState], scores: Sequence[float]
             ) -> list[WorkerState]:
        """`candidates` best first; `scores` aligned with them (may be ignored)."""
        ...
