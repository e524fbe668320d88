"""The simulator's parameter file: model, engine, timing model, router view and store.

One TOML file holds every number (`params/llmd_qwen3_32b_h100.toml` is llm-d's cluster);
this module turns it into frozen dataclasses and rejects unknown or missing keys, so a typo
in a parameter file is an error rather than a silent default.
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, TypeVar

__all__ = ["ModelParams", "EngineParams", "TimingParams", "RouterView", "StoreParams",
           "SimParams", "load_params", "DEFAULT_PARAMS", "LOAD_MODES"]

DEFAULT_PARAMS = Path(__file__).with_name("params") / "llmd_qwen3_32b_h100.toml"


@dataclass(frozen=True, slots=True)
class ModelParams:
    name: str
    vocab: int
    kv_bytes_per_token: int


@dataclass(frozen=True, slots=True)
class EngineParams:
    block_size: int
    kv_tokens: int
    max_num_seqs: int
    max_num_batched_tokens: int

    @property
    def num_blocks(self) -> int:
        return self.kv_tokens // self.block_size


@dataclass(frozen=True, slots=True)
class TimingParams:
    model: str
    a2: float
    a1: float
    a0: float
    d2: float
    d1: float
    d0: float
    decode_floor_ms: float
    prefill_scale: float
    decode_scale: float
    overhead_ms: float
    per_token_ms: float
    itl_ms: float
    load_factor: float


@dataclass(frozen=True, slots=True)
class RouterView:
    scrape_interval_s: float
    kv_event_delay_s: float
    network_s: float
    lease_ttl_s: float
    # the router's round trip to a worker's /tokenize for a prompt it has not cached:
    # base + per-token seconds
    tokenize_base_s: float
    tokenize_per_token_s: float

    def tokenize_s(self, tokens: int) -> float:
        return self.tokenize_base_s + self.tokenize_per_token_s * tokens


LOAD_MODES = ("auto", "sync", "async")


@dataclass(frozen=True, slots=True)
class StoreParams:
    """kvkeep's store: capacities, what a load costs per tier (`latency_s` per load call +
    bytes / `gbps`, per replica: its whole TP group), what a save adds to the step, and how
    loads are charged (`load_mode`, the connector's setting: "sync" in the step, "async" to
    the request alone, "auto" async for network-tier loads beside other requests)."""

    replicas_per_node: int
    host_bytes_per_node: int
    host_latency_s: float
    host_gbps: float
    remote_bytes: int
    remote_replicas: int
    remote_latency_s: float
    remote_gbps: float
    save_s_per_block: float
    load_mode: str

    def host_load_s(self, nbytes: int) -> float:
        return self.host_latency_s + nbytes / (self.host_gbps * 1e9) if nbytes else 0.0

    def remote_load_s(self, nbytes: int) -> float:
        return self.remote_latency_s + nbytes / (self.remote_gbps * 1e9) if nbytes else 0.0


@dataclass(frozen=True, slots=True)
class SimParams:
    model: ModelParams
    engine: EngineParams
    timing: TimingParams
    router: RouterView
    store: StoreParams

    def with_overrides(self, section: str, **values: Any) -> SimParams:
        """A copy with some values of one section replaced (calibration, tests)."""
        current = getattr(self, section)
        return dataclasses.replace(self, **{section: dataclasses.replace(current, **values)})


_T = TypeVar("_T")


def _section(cls: type[_T], data: dict[str, Any], name: str) -> _T:
    known = {f.name for f in fields(cls)}  # type: ignore[arg-type]
    unknown = set(data) - known
    missing = known - set(data)
    if unknown or missing:
        raise ValueError(f"[{name}]: unknown keys {sorted(unknown)}, missing {sorted(missing)}")
    return cls(**data)


def load_params(path: Path = DEFAULT_PARAMS) -> SimParams:
    with path.open("rb") as f:
        raw = tomllib.load(f)
    params = SimParams(
        model=_section(ModelParams, raw.get("model", {}), "model"),
        engine=_section(EngineParams, raw.get("engine", {}), "engine"),
        timing=_section(TimingParams, raw.get("timing", {}), "timing"),
        router=_section(RouterView, raw.get("router", {}), "router"),
        store=_section(StoreParams, raw.get("store", {}), "store"),
    )
    if params.timing.model not in ("dynamo-mocker", "llmd-inference-sim"):
        raise ValueError(f"unknown timing model {params.timing.model!r}")
    if params.store.load_mode not in LOAD_MODES:
        raise ValueError(f"unknown load mode {params.store.load_mode!r}; one of {LOAD_MODES}")
    return params
