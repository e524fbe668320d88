"""Routing policies: compositions of filters, weighted scorers and a picker, plus the session
rules (stickiness, migration). Selected by name; weights and thresholds come from config.

- `kvkeep` (default): sticky sessions that migrate off an overloaded worker (their KV is
  restored from the store), new sessions kept off workers over the KV-utilisation, queue and
  GPU thresholds, and scored by precise prefix 3, approximate prefix 2, queue 2, KV utilisation
  2 and in-flight tokens 1.
- Baselines: `round-robin`; `least-loaded` (queue and in-flight tokens); `session-only`
  (sticky forever, new sessions round robin: the plain stickiness Dynamo's replay found worse
  than round robin); `llm-d` (prefix 3, queue 2, KV utilisation 2, no session rules).
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass, field

from kvstore.errors import ConfigError
from router.filters import Filter, GpuFilter, KVThresholdFilter, QueueThresholdFilter
from router.pickers import MaxScorePicker, Picker, RoundRobinPicker
from router.scorers import SCORERS, Scorer

__all__ = ["Thresholds", "Policy", "POLICIES", "DEFAULT_WEIGHTS", "build_policy",
           "parse_weights"]

POLICIES = ("kvkeep", "round-robin", "least-loaded", "session-only", "llm-d")

DEFAULT_WEIGHTS: Mapping[str, Mapping[str, float]] = {
    "kvkeep": {"precise-prefix": 3.0, "prefix": 2.0, "queue": 2.0, "kv-utilization": 2.0,
               "inflight-tokens": 1.0},
    "round-robin": {},
    "least-loaded": {"queue": 1.0, "inflight-tokens": 1.0},
    "session-only": {},
    # llm-d's defaults: prefix 3, queue 2, KV utilisation 2. It runs one prefix scorer,
    # precise where KV events exist and approximate otherwise: "best-prefix" is that.
    "llm-d": {"best-prefix": 3.0, "queue": 2.0, "kv-utilization": 2.0},
}


@dataclass(frozen=True, slots=True)
class Thresholds:
    """The load thresholds of the `kvkeep` policy (and saturation, for all policies).

    - `kv_new_session`: a worker at or above this KV-cache usage starts no new session (85 %).
    - `queue_new_session`: nor one with this many outstanding requests.
    - `max_waiting`: a worker with this many queued requests is saturated; when all are, the
      router answers 429 rather than deepen the queues.
    - `migrate_waiting` / `migrate_imbalance` / `migrate_ratio`: a session leaves its worker
      when that worker has this many requests waiting (and another has fewer), or has both
      `migrate_imbalance` more and `migrate_ratio` times as many outstanding requests as the
      least-loaded candidate. Below these, stickiness wins: its KV is there. Defaults come
      from the policy replay in `benchmarks/router.py` (waiting 2, imbalance 4, ratio 1.5
      halved mean TTFT against waiting 4, imbalance 8, and beat round robin's p99).
    - `migrate_cooldown_s`: a binding younger than this does not migrate. Replicas see load
      differently for a moment; without it, one replica could move a session another bound
      milliseconds earlier, before its first request even ran.
    """

    kv_new_session: float = 0.85
    queue_new_session: int = 32
    max_waiting: int = 64
    migrate_waiting: int = 2
    migrate_imbalance: int = 4
    migrate_ratio: float = 1.5
    migrate_cooldown_s: float = 2.0
    gpu_max_temp_c: float = 85.0
    gpu_max_mem_frac: float = 0.97

    def __post_init__(self) -> None:
        if not 0.0 < self.kv_new_session <= 1.0:
            raise ConfigError("kv threshold must be in (0, 1]")
        if min(self.queue_new_session, self.max_waiting, self.migrate_waiting,
               self.migrate_imbalance) < 1:
            raise ConfigError("queue thresholds must be >= 1")
        if self.migrate_ratio < 1.0:
            raise ConfigError("migrate ratio must be >= 1")


@dataclass(frozen=True, slots=True)
class Policy:
    name: str
    scorers: tuple[tuple[Scorer, float], ...]
    picker: Picker
    sticky: bool
    migrate: bool
    soft_filters: tuple[Filter, ...]
    thresholds: Thresholds = field(default_factory=Thresholds)
    # Picker used for new sessions when the scorers are empty or the policy says so.
    fallbacks: int = 2


def parse_weights(spec: str) -> dict[str, float]:
    """`"prefix=3,queue=2"` -> {"prefix": 3.0, "queue": 2.0}; unknown names are an error."""
    weights: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, sep, value = part.partition("=")
        name = name.strip()
        if not sep or name not in SCORERS:
            raise ConfigError(f"bad weight {part!r}: use name=value with name in "
                              f"{sorted(SCORERS)}")
        try:
            weights[name] = float(value)
        except ValueError as exc:
            raise ConfigError(f"bad weight value in {part!r}") from exc
        if weights[name] < 0:
            raise ConfigError(f"negative weight in {part!r}")
    return weights


def build_policy(name: str = "kvkeep", *, weights: Mapping[str, float] | None = None,
                 thresholds: Thresholds | None = None, rng: random.Random | None = None
                 ) -> Policy:
    """The named policy; `weights` replace its default weights (a name missing keeps its
    default, weight 0 drops a scorer)."""
    if name not in POLICIES:
        raise ConfigError(f"unknown policy {name!r}; choose from {', '.join(POLICIES)}")
    th = thresholds or Thresholds()
    merged = dict(DEFAULT_WEIGHTS[name])
    merged.update(weights or {})
    scorers = tuple((SCORERS[n](), w) for n, w in merged.items() if w > 0)
    rng = rng or random.Random()
    if name == "round-robin":
        return Policy(name, (), RoundRobinPicker(), sticky=False, migrate=False,
                      soft_filters=(), thresholds=th)
    if name == "session-only":
        return Policy(name, (), RoundRobinPicker(), sticky=True, migrate=False,
                      soft_filters=(), thresholds=th)
    if name in ("least-loaded", "llm-d"):
        return Policy(name, scorers, MaxScorePicker(rng), sticky=False, migrate=False,
                      soft_filters=(), thresholds=th)
    soft: tuple[Filter, ...] = (
        KVThresholdFilter(th.kv_new_session),
        QueueThresholdFilter(th.queue_new_session),
        GpuFilter(th.gpu_max_temp_c, th.gpu_max_mem_frac),
    )
    return Policy(name, scorers, MaxScorePicker(rng), sticky=True, migrate=True,
                  soft_filters=soft, thresholds=th)
