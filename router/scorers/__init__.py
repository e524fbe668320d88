"""Scorers: each rates every candidate in [0, 1]; a policy sums them with weights."""

from router.scorers.affinity import SessionAffinityScorer
from router.scorers.base import Scorer, spread
from router.scorers.load import (
    InflightTokensScorer,
    KVUtilizationScorer,
    LoadAwareScorer,
    QueueScorer,
)
from router.scorers.prefix import ApproxPrefixScorer, BestPrefixScorer, PrecisePrefixScorer

__all__ = ["Scorer", "spread", "SessionAffinityScorer", "ApproxPrefixScorer",
           "PrecisePrefixScorer", "BestPrefixScorer", "QueueScorer", "KVUtilizationScorer",
           "InflightTokensScorer", "LoadAwareScorer", "SCORERS"]

# Names usable in `--weights name=w,...`.
SCORERS: dict[str, type[Scorer]] = {
    "affinity": SessionAffinityScorer,
    "prefix": ApproxPrefixScorer,
    "precise-prefix": PrecisePrefixScorer,
    "best-prefix": BestPrefixScorer,
    "queue": QueueScorer,
    "kv-utilization": KVUtilizationScorer,
    "inflight-tokens": InflightTokensScorer,
    "load-aware": LoadAwareScorer,
}
