"""Routing policies: compositions of soft filters, weighted scorers and a picker, plus the
session rules (stickiness, migration) and the thresholds they use.

A `PolicySpec` says what a policy is made of, by name (what a config file holds: see
`router/policy_file.py`); `PolicySpec.build` turns it into the `Policy` objects the scheduler
runs. The presets, selected by `--policy`:

- `kvkeep` (default): sticky sessions that migrate off an overloaded worker (their KV is
  restored from the store); every placement kept off workers over the GPU thresholds, session
  placements also off workers over the KV-utilisation and queue thresholds; scored by best
  prefix 3 (precise from KV events, text prompts tokenized through a worker's `/tokenize`;
  a block the worker can restore from the store counts 0.5), queue ratio 2 and KV
  utilisation 2.
- Baselines: `round-robin`; `random` (llm-d's blog's baseline); `least-loaded` (queue and
  in-flight tokens); `session-only` (sticky forever, new sessions round robin: the plain
  stickiness Dynamo's replay found worse than round robin); `llm-d` (prefix 3, queue 2, KV
  utilisation 2, no session rules).
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

from kvstore.errors import ConfigError
from router.filters import (
    BoundedLoadFilter,
    Filter,
    GpuFilter,
    KVThresholdFilter,
    QueueThresholdFilter,
)
from router.pickers import (
    LeastUtilisedPicker,
    MaxScorePicker,
    Picker,
    RandomPicker,
    RoundRobinPicker,
)
from router.scorers import SCORERS, Scorer
from router.tokenize.prompts import TokenizeSpec

__all__ = ["Thresholds", "Policy", "ScorerSpec", "PolicySpec", "POLICIES", "DEFAULT_WEIGHTS",
           "SOFT_FILTERS", "PICKERS", "policy_preset", "build_policy", "parse_weights"]

POLICIES = ("kvkeep", "round-robin", "random", "least-loaded", "session-only", "llm-d")


@dataclass(frozen=True, slots=True)
class Thresholds:
    """The load thresholds of the session rules and soft filters (and saturation, for all).

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
    - `gpu_max_temp_c` / `gpu_max_mem_frac`: a worker whose GPU (NVML, where reported) is this
      hot or this full starts no new session.
    - `load_factor`: the `bounded-load` filter's bound, as a multiple of the mean outstanding
      requests a worker may reach with the request (1.25, the value the bounded-load
      consistent hashing paper and HAProxy's `hash-balance-factor` examples use).
    """

    kv_new_session: float = 0.85
    queue_new_session: int = 32
    max_waiting: int = 512
    migrate_waiting: int = 2
    migrate_imbalance: int = 4
    migrate_ratio: float = 1.5
    migrate_cooldown_s: float = 2.0
    gpu_max_temp_c: float = 85.0
    gpu_max_mem_frac: float = 0.97
    load_factor: float = 1.25

    def __post_init__(self) -> None:
        if not 0.0 < self.kv_new_session <= 1.0:
            raise ConfigError(f"kv_new_session must be in (0, 1], not {self.kv_new_session}")
        for name in ("queue_new_session", "max_waiting", "migrate_waiting", "migrate_imbalance"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, not {getattr(self, name)}")
        if self.migrate_ratio < 1.0:
            raise ConfigError(f"migrate_ratio must be >= 1, not {self.migrate_ratio}")
        if self.migrate_cooldown_s < 0:
            raise ConfigError(f"migrate_cooldown_s must be >= 0, not {self.migrate_cooldown_s}")
        if self.gpu_max_temp_c <= 0:
            raise ConfigError(f"gpu_max_temp_c must be > 0, not {self.gpu_max_temp_c}")
        if not 0.0 < self.gpu_max_mem_frac <= 1.0:
            raise ConfigError(f"gpu_max_mem_frac must be in (0, 1], not {self.gpu_max_mem_frac}")
        if self.load_factor < 1.0:
            raise ConfigError(f"load_factor must be >= 1, not {self.load_factor}")


@dataclass(frozen=True, slots=True)
class Policy:
    """A built policy: the objects the scheduler runs."""

    name: str
    scorers: tuple[tuple[Scorer, float], ...]
    picker: Picker
    sticky: bool
    migrate: bool
    soft_filters: tuple[Filter, ...]
    thresholds: Thresholds = field(default_factory=Thresholds)
    session_filters: tuple[Filter, ...] = ()
    """Soft filters for placing a session (new, migrated, failed over) only, after
    `soft_filters`, which every placement passes."""


# Soft filters by name, each configured from the thresholds.
SOFT_FILTERS: Mapping[str, Callable[[Thresholds], Filter]] = {
    "kv-threshold": lambda th: KVThresholdFilter(th.kv_new_session),
    "queue-threshold": lambda th: QueueThresholdFilter(th.queue_new_session),
    "gpu": lambda th: GpuFilter(th.gpu_max_temp_c, th.gpu_max_mem_frac),
    "bounded-load": lambda th: BoundedLoadFilter(th.load_factor),
}
# Pickers by name; the random source breaks ties.
PICKERS: Mapping[str, Callable[[random.Random], Picker]] = {
    "max-score": MaxScorePicker,
    "random": RandomPicker,
    "round-robin": lambda rng: RoundRobinPicker(),
    "least-utilised": lambda rng: LeastUtilisedPicker(),
}


@dataclass(frozen=True, slots=True)
class ScorerSpec:
    """One scorer by name (`router.scorers.SCORERS`), its weight and its parameters (the
    scorer's own fields, e.g. `load-aware`'s `cap`). Weight 0 leaves it out."""

    name: str
    weight: float
    parameters: tuple[tuple[str, float], ...] = ()


@dataclass(frozen=True, slots=True)
class PolicySpec:
    """What a policy is made of, by name; validated on construction (errors name the part).

    `filters` are the soft filters every placement the scheduler ranks passes (stateless
    requests, new sessions, moves), `session_filters` those only session placements pass
    after them (`SOFT_FILTERS`); `picker` ranks the scored candidates (`PICKERS`); `sticky`
    keeps a session on its worker, `migrate` lets it leave an overloaded one; `tokenize`
    says how text prompts get token ids for the scorers that match token blocks.
    """

    name: str
    scorers: tuple[ScorerSpec, ...]
    filters: tuple[str, ...]
    picker: str
    sticky: bool
    migrate: bool
    thresholds: Thresholds = field(default_factory=Thresholds)
    tokenize: TokenizeSpec = field(default_factory=TokenizeSpec)
    session_filters: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for i, scorer in enumerate(self.scorers):
            _check_scorer(i, scorer)
        for section, names in (("filters", self.filters),
                               ("session_filters", self.session_filters)):
            for i, name in enumerate(names):
                if name not in SOFT_FILTERS:
                    raise ConfigError(f"{section}[{i}]: unknown filter {name!r}; choose from "
                                      f"{', '.join(SOFT_FILTERS)}")
        if self.picker not in PICKERS:
            raise ConfigError(f"picker: unknown picker {self.picker!r}; choose from "
                              f"{', '.join(PICKERS)}")
        if self.migrate and not self.sticky:
            raise ConfigError("sessions.migrate needs sessions.sticky")

    @property
    def weights(self) -> dict[str, float]:
        return {s.name: s.weight for s in self.scorers}

    @property
    def reads_token_blocks(self) -> bool:
        """Whether a scorer matches the prompt's token blocks (so text prompts are worth
        tokenizing: `tokenize`)."""
        return any(s.weight > 0 and s.name in _TOKEN_SCORERS for s in self.scorers)

    def with_weights(self, weights: Mapping[str, float]) -> PolicySpec:
        """These weights over the spec's: a scorer named keeps its place and parameters, a new
        one is appended, weight 0 drops one."""
        given = dict(weights)
        scorers = [replace(s, weight=given.pop(s.name)) if s.name in given else s
                   for s in self.scorers]
        scorers += [ScorerSpec(name, weight) for name, weight in given.items()]
        return replace(self, scorers=tuple(scorers))

    def build(self, rng: random.Random | None = None) -> Policy:
        rng = rng or random.Random()
        th = self.thresholds
        scorers = tuple((SCORERS[s.name](**dict(s.parameters)), s.weight)
                        for s in self.scorers if s.weight > 0)
        return Policy(self.name, scorers, PICKERS[self.picker](rng), sticky=self.sticky,
                      migrate=self.migrate,
                      soft_filters=tuple(SOFT_FILTERS[f](th) for f in self.filters),
                      thresholds=th,
                      session_filters=tuple(SOFT_FILTERS[f](th) for f in self.session_filters))


_TOKEN_SCORERS = frozenset({"precise-prefix", "best-prefix"})


def _check_scorer(index: int, scorer: ScorerSpec) -> None:
    where = f"scorers[{index}]"
    cls = SCORERS.get(scorer.name)
    if cls is None:
        raise ConfigError(f"{where}.name: unknown scorer {scorer.name!r}; choose from "
                          f"{', '.join(SCORERS)}")
    if scorer.weight < 0:
        raise ConfigError(f"{where}.weight: negative weight {scorer.weight} for {scorer.name}")
    known = {f.name: f.default for f in dataclasses.fields(cls)  # type: ignore[arg-type]
             if f.name != "name"}
    for key, value in scorer.parameters:
        if key not in known:
            raise ConfigError(f"{where}.parameters.{key}: {scorer.name} has no parameter "
                              f"{key!r}" + (f"; it has {', '.join(known)}" if known else ""))
        if not isinstance(value, int | float) or isinstance(value, bool) or \
                (isinstance(known[key], int) and not isinstance(value, int)):
            raise ConfigError(f"{where}.parameters.{key}: {value!r} is not a valid "
                              f"{type(known[key]).__name__}")


_PRESETS: Mapping[str, PolicySpec] = {
    # One prefix signal (precise from KV events, text prompts tokenized; approximate where
    # the index knows nothing), the store's blocks at the storage weight, and a load score
    # that keeps its scale: see the module docstring and benchmarks/sim/README.md.
    "kvkeep": PolicySpec(
        "kvkeep",
        (ScorerSpec("best-prefix", 3.0, (("storage_weight", 0.5),)), ScorerSpec("queue-ratio", 2.0),
         ScorerSpec("kv-utilization", 2.0)),
        ("gpu",), "max-score", sticky=True, migrate=True,
        session_filters=("kv-threshold", "queue-threshold")),
    "round-robin": PolicySpec("round-robin", (), (), "round-robin", sticky=False,
                              migrate=False),
    "random": PolicySpec("random", (), (), "random", sticky=False, migrate=False),
    "least-loaded": PolicySpec("least-loaded", (ScorerSpec("queue", 1.0),
                                                ScorerSpec("inflight-tokens", 1.0)),
                               (), "max-score", sticky=False, migrate=False),
    "session-only": PolicySpec("session-only", (), (), "round-robin", sticky=True,
                               migrate=False),
    # llm-d's defaults: prefix 3, queue 2, KV utilisation 2. It runs one prefix scorer,
    # precise where KV events exist and approximate otherwise: "best-prefix" is that.
    "llm-d": PolicySpec("llm-d", (ScorerSpec("best-prefix", 3.0), ScorerSpec("queue", 2.0),
                                  ScorerSpec("kv-utilization", 2.0)),
                        (), "max-score", sticky=False, migrate=False),
}
assert tuple(_PRESETS) == POLICIES

DEFAULT_WEIGHTS: Mapping[str, Mapping[str, float]] = {
    name: spec.weights for name, spec in _PRESETS.items()}


def policy_preset(name: str = "kvkeep") -> PolicySpec:
    """The named preset's spec (`POLICIES`)."""
    spec = _PRESETS.get(name)
    if spec is None:
        raise ConfigError(f"unknown policy {name!r}; choose from {', '.join(POLICIES)}")
    return spec


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
    """The named preset, built; `weights` replace its default weights (a name missing keeps
    its default, weight 0 drops a scorer)."""
    spec = policy_preset(name).with_weights(weights or {})
    if thresholds is not None:
        spec = replace(spec, thresholds=thresholds)
    return spec.build(rng)
