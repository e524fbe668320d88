"""Load scorers: queue depth, KV-cache utilisation, in-flight tokens, llm-d's load-aware."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from router.context import DecisionContext
from router.membership.workers import WorkerState
from router.scorers.base import spread

__all__ = ["QueueScorer", "QueueRatioScorer", "KVUtilizationScorer", "InflightTokensScorer",
           "LoadAwareScorer"]


@dataclass(frozen=True, slots=True)
class QueueScorer:
    """(maxQ - q) / (maxQ - minQ) over outstanding requests (running + waiting + optimistic)."""

    name: str = "queue"

    def score(self, ctx: DecisionContext, candidates: Sequence[WorkerState]) -> list[float]:
        return spread([w.queue for w in candidates])


@dataclass(frozen=True, slots=True)
class QueueRatioScorer:
    """1 - q / maxQ over outstanding requests: how much shorter a worker's queue is than the
    longest, as a share of it. Unlike llm-d's min-max (`queue`), it keeps the scale: 2 vs 10
    requests is 0.8 apart, 240 vs 256 only 0.06, where min-max makes both a full 1.0 and so
    lets a one-request difference outweigh a cached prefix on saturated workers."""

    name: str = "queue-ratio"

    def score(self, ctx: DecisionContext, candidates: Sequence[WorkerState]) -> list[float]:
        queues = [w.queue for w in candidates]
        top = max(queues, default=0)
        if top <= 0:
            return [1.0] * len(candidates)
        return [1.0 - q / top for q in queues]


@dataclass(frozen=True, slots=True)
class KVUtilizationScorer:
    """1 - KV-cache usage."""

    name: str = "kv-utilization"

    def score(self, ctx: DecisionContext, candidates: Sequence[WorkerState]) -> list[float]:
        return [1.0 - min(1.0, max(0.0, w.kv_usage)) for w in candidates]


@dataclass(frozen=True, slots=True)
class InflightTokensScorer:
    """Min-max over the tokens (prompt + max new) this replica has in flight per worker: a
    request count treats a 10-token and a 10k-token request alike; tokens do not."""

    name: str = "inflight-tokens"

    def score(self, ctx: DecisionContext, candidates: Sequence[WorkerState]) -> list[float]:
        return spread([w.inflight_tokens for w in candidates])


@dataclass(frozen=True, slots=True)
class LoadAwareScorer:
    """llm-d's load-aware scorer: 0.5 * (1 - min(q, cap) / cap); 0.5 at best by design."""

    cap: int = 128
    name: str = "load-aware"

    def score(self, ctx: DecisionContext, candidates: Sequence[WorkerState]) -> list[float]:
        cap = self.cap
        return [0.5 * (1.0 - min(w.waiting, cap) / cap) for w in candidates]
