"""Scorers: each rates every candidate in [0, 1]; a policy sums them with weights."""

from router.scorers.affinity import SessionAffinityScorer
from router.scorers.base import Scorer, spread
from router.scorers.load import (
    InflightTokensScorer,
    KVUtilizationScorer,
    LoadAwareScorer,
    QueueRatioScorer,
    QueueScorer,
)
from router.scorers.prefix import ApproxPrefixScorer, BestPrefixScorer, PrecisePrefixScorer

__all__ = ["Scorer", "spread", "SessionAffinityScorer", "ApproxPrefixScorer",
           "PrecisePrefixScorer", "BestPrefixScorer", "QueueScorer", "QueueRatioScorer",
           "KVUtilizationScorer", "InflightTokensScorer", "LoadAwareScorer", "SCORERS"]

# Names usable in `--weights name=w,...`.
SCORERS: dict[str, type[Scorer]] = {
    "affinity": SessionAffinityScorer,
    "prefix": ApproxPrefixScorer,
    "precise-prefix": PrecisePrefixScorer,
    "best-prefix": BestPrefixScorer,
    "queue": QueueScorer,
    "queue-ratio": QueueRatioScorer,
    "kv-utilization": KVUtilizationScorer,
    "inflight-tokens": InflightTokensScorer,
    "load-aware": LoadAwareScorer,
}
