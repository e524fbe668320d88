"""What a cluster benchmark run does: the model, the cluster's KV size, the workloads, the load.

Everything is llm-d's inference-scheduling benchmark scaled down to three CPU workers
(`../shared/docs/routing-benchmarks.md`): groups of prompts that share a long system prompt,
sized so that the prefixes alone fill about 73 % of the cluster's KV cache (llm-d's 150 groups x
(6000 + 5 x 1200) tokens against 8 x 307,328). Round robin then needs every group's prefix on
every worker, which does not fit, while prefix-aware routing keeps each group on one worker,
which does. The KV cache is sized from the workload, not the other way round, so any workload
shape gives the same pressure.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvstore.errors import ConfigError

__all__ = ["ModelShape", "MODELS", "Stage", "SharedPrefix", "MultiTurn", "AiperfLoad", "Plan",
           "quick_plan", "full_plan", "LLMD_PREFIX_FRACTION"]

# llm-d's 73-capacity case: 150 x (6000 + 5 x 1200) / (8 x 307,328) tokens.
LLMD_PREFIX_FRACTION = 150 * (6000 + 5 * 1200) / (8 * 307_328)


@dataclass(frozen=True, slots=True)
class ModelShape:
    """A random-weight Llama built locally (`deploy.local.model.build_tiny_llama`)."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def kv_bytes_per_token(self, dtype_bytes: int = 4) -> int:
        """K and V of every layer for one token (the workers run float32)."""
        return self.layers * 2 * self.kv_heads * self.head_dim * dtype_bytes

    def build_args(self) -> dict[str, int]:
        return {"layers": self.layers, "hidden": self.hidden, "heads": self.heads,
                "kv_heads": self.kv_heads, "intermediate": self.intermediate}


# `tiny` is the test suite's model: a 720-token prefill costs about as much as the engine's
# step overhead on this CPU, so a prefix hit saves little and routing hardly shows. `small`
# (about 13M parameters) makes the same prefill ~10x dearer than a cached one (measured
# ~180-300 ms against ~15 ms here), the regime llm-d's GPUs are in with 7200-token prompts.
MODELS = {
    "tiny": ModelShape("tiny", layers=2, hidden=128, heads=4, kv_heads=2, intermediate=256),
    "small": ModelShape("small", layers=4, hidden=512, heads=8, kv_heads=2, intermediate=1536),
}


@dataclass(frozen=True, slots=True)
class Stage:
    """Poisson arrivals at `rate` requests/s for `duration_s` seconds."""

    rate: float
    duration_s: int

    def __post_init__(self) -> None:
        if self.rate <= 0 or self.duration_s <= 0:
            raise ConfigError(f"a load stage needs rate > 0 and duration > 0, got {self}")

    @property
    def requests(self) -> float:
        return self.rate * self.duration_s


@dataclass(frozen=True, slots=True)
class SharedPrefix:
    """inference-perf's `shared_prefix` data: `groups` system prompts, each followed by
    `prompts_per_group` different questions; every prompt generated up front, shuffled once."""

    groups: int
    prompts_per_group: int
    system_tokens: int
    question_tokens: int
    output_tokens: int
    seed: int = 1

    def __post_init__(self) -> None:
        if min(self.groups, self.prompts_per_group, self.system_tokens, self.question_tokens,
               self.output_tokens) < 1:
            raise ConfigError(f"shared prefix workload: every size must be >= 1, got {self}")

    @property
    def prompt_tokens(self) -> int:
        return self.system_tokens + self.question_tokens

    @property
    def resident_tokens(self) -> int:
        """KV tokens that keep every group's prefix and questions cached (llm-d's formula)."""
        return self.groups * (self.system_tokens + self.prompts_per_group * self.question_tokens)


@dataclass(frozen=True, slots=True)
class MultiTurn:
    """inference-perf's `shared_prefix` data with `enable_multi_turn_chat`: every prompt is a
    session (sent with an `X-Session-Id` header) whose next turn is its previous prompt, the
    answer, and a new prompt of the same group. Turns of a session never overlap."""

    groups: int
    sessions_per_group: int
    system_tokens: int
    question_tokens: int
    output_tokens: int
    seed: int = 2

    @property
    def sessions(self) -> int:
        return self.groups * self.sessions_per_group

    @property
    def turn_tokens(self) -> int:
        """What one turn adds to a session's prompt: a new prompt and the answer."""
        return self.system_tokens + self.question_tokens + self.output_tokens

    def turns(self, stages: tuple[Stage, ...]) -> int:
        return math.ceil(sum(s.requests for s in stages) / self.sessions)

    def longest_prompt(self, stages: tuple[Stage, ...]) -> int:
        return self.turns(stages) * self.turn_tokens


@dataclass(frozen=True, slots=True)
class AiperfLoad:
    """aiperf's shared-prefix options: a pool of `prefixes` prompts of `prefix_tokens`, one
    picked at random per request, followed by `question_tokens` of fresh text."""

    prefixes: int
    prefix_tokens: int
    question_tokens: int
    output_tokens: int
    rate: float
    requests: int
    seed: int = 3


@dataclass(frozen=True, slots=True)
class Plan:
    model: ModelShape
    shared_prefix: SharedPrefix
    shared_prefix_stages: tuple[Stage, ...]
    multi_turn: MultiTurn
    multi_turn_stages: tuple[Stage, ...]
    aiperf: AiperfLoad
    workers: int = 3
    block_size: int = 32
    max_model_len: int = 2048
    prefix_fraction: float = LLMD_PREFIX_FRACTION
    kill_after_s: float = 12.0
    """In the kill run, seconds after the load starts when one worker is SIGKILLed."""
    kill_worker: str = "w2"
    host_tier_bytes: int = 64 << 20
    """The connector's RAM tier in each worker: what a worker keeps of evicted blocks."""
    seconds_per_request_budget: float = 6.0
    """A tool run is stopped after its load time plus this much per request (plus a minute)."""
    notes: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        if self.workers < 2:
            raise ConfigError("the cluster benchmark needs >= 2 workers (one is killed)")
        if self.block_size % 32:
            raise ConfigError("vLLM's CPU backend needs a block size that is a multiple of 32")
        longest = self.multi_turn.longest_prompt(self.multi_turn_stages)
        if longest + self.multi_turn.output_tokens > self.max_model_len:
            raise ConfigError(
                f"multi-turn sessions would reach {longest} prompt tokens "
                f"({self.multi_turn.turns(self.multi_turn_stages)} turns of "
                f"{self.multi_turn.turn_tokens}), over max_model_len {self.max_model_len}: "
                "fewer requests or more sessions")
        if self.kv_tokens_per_worker < self.max_model_len:
            raise ConfigError(f"{self.kv_tokens_per_worker} KV tokens per worker cannot hold "
                              f"one {self.max_model_len}-token sequence")
        if not self.kill_worker.startswith("w") or not 1 <= int(self.kill_worker[1:]) <= \
                self.workers:
            raise ConfigError(f"kill_worker {self.kill_worker!r} is not one of w1..w{self.workers}")

    @property
    def kv_tokens_per_worker(self) -> int:
        """KV cache per worker such that the shared prefixes are `prefix_fraction` of the
        cluster's, rounded up to whole blocks."""
        tokens = self.shared_prefix.resident_tokens / (self.prefix_fraction * self.workers)
        return math.ceil(tokens / self.block_size) * self.block_size

    @property
    def kv_cache_bytes(self) -> int:
        return self.kv_tokens_per_worker * self.model.kv_bytes_per_token()

    def load_timeout_s(self, stages: tuple[Stage, ...]) -> float:
        return (sum(s.duration_s for s in stages) + 60.0
                + self.seconds_per_request_budget * sum(s.requests for s in stages))

    def describe(self) -> dict[str, object]:
        sp, mt, ap = self.shared_prefix, self.multi_turn, self.aiperf
        return {
            "model": {"name": self.model.name, **self.model.build_args(),
                      "kv_bytes_per_token": self.model.kv_bytes_per_token(), "dtype": "float32"},
            "workers": self.workers, "block_size": self.block_size,
            "max_model_len": self.max_model_len,
            "kv_tokens_per_worker_planned": self.kv_tokens_per_worker,
            "prefix_fraction_of_cluster_kv": round(self.prefix_fraction, 3),
            "shared_prefix": {"groups": sp.groups, "prompts_per_group": sp.prompts_per_group,
                              "system_tokens": sp.system_tokens,
                              "question_tokens": sp.question_tokens,
                              "output_tokens": sp.output_tokens, "seed": sp.seed,
                              "resident_tokens": sp.resident_tokens,
                              "stages": [[s.rate, s.duration_s]
                                         for s in self.shared_prefix_stages]},
            "multi_turn": {"sessions": mt.sessions, "groups": mt.groups,
                           "system_tokens": mt.system_tokens,
                           "question_tokens": mt.question_tokens,
                           "output_tokens": mt.output_tokens, "seed": mt.seed,
                           "turns_per_session": mt.turns(self.multi_turn_stages),
                           "longest_prompt_tokens": mt.longest_prompt(self.multi_turn_stages),
                           "stages": [[s.rate, s.duration_s] for s in self.multi_turn_stages]},
            "aiperf_shared_prefix": {"prefixes": ap.prefixes, "prefix_tokens": ap.prefix_tokens,
                                     "question_tokens": ap.question_tokens,
                                     "output_tokens": ap.output_tokens, "rate": ap.rate,
                                     "requests": ap.requests, "seed": ap.seed},
            "kill": {"worker": self.kill_worker, "after_s": self.kill_after_s,
                     "workload": "multi_turn (another seed)"},
            "host_tier_bytes_per_worker": self.host_tier_bytes,
        }


def quick_plan(model: str = "small") -> Plan:
    """A few minutes per policy: ~60 shared-prefix requests over two rates, ~40 turns."""
    return Plan(
        model=MODELS[model],
        shared_prefix=SharedPrefix(groups=8, prompts_per_group=5, system_tokens=600,
                                   question_tokens=120, output_tokens=32),
        shared_prefix_stages=(Stage(1.0, 20), Stage(2.0, 20)),
        multi_turn=MultiTurn(groups=4, sessions_per_group=4, system_tokens=160,
                             question_tokens=48, output_tokens=24),
        multi_turn_stages=(Stage(1.5, 28),),
        aiperf=AiperfLoad(prefixes=8, prefix_tokens=600, question_tokens=120, output_tokens=32,
                          rate=1.5, requests=30),
        kill_after_s=10.0,
    )


def full_plan(model: str = "small") -> Plan:
    """The measured run: llm-d's shape at a tenth of the lengths, a ladder of rates."""
    return Plan(
        model=MODELS[model],
        shared_prefix=SharedPrefix(groups=15, prompts_per_group=5, system_tokens=600,
                                   question_tokens=120, output_tokens=100),
        shared_prefix_stages=(Stage(1.0, 40), Stage(2.0, 40), Stage(3.0, 40), Stage(4.0, 40)),
        multi_turn=MultiTurn(groups=6, sessions_per_group=4, system_tokens=200,
                             question_tokens=60, output_tokens=32),
        multi_turn_stages=(Stage(2.0, 60),),
        aiperf=AiperfLoad(prefixes=15, prefix_tokens=600, question_tokens=120, output_tokens=100,
                          rate=2.0, requests=150),
        kill_after_s=25.0,
    )
