"""The `durability` setting's pure parts: its config block, and the copy-lag histogram's way from
the store to vLLM's `/metrics` (the real engines are in test_connector_durability_vllm.py)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

import msgpack
import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from connectors.vllm.config import DEFAULT_DURABILITY_TIMEOUT_MS, ConnectorConfig
from connectors.vllm.prometheus import KVKeepPromMetrics, KVKeepStats, StatsReporter
from connectors.vllm.stats import Counts
from connectors.vllm.telemetry import Telemetry
from kvstore.errors import ConfigError
from kvstore.metrics import COPY_LAG_BUCKETS, RecentObservations
from kvstore.store import TieredStore
from kvstore.tiers.factory import HostSpec
from tests.blockframes import block_key, make_frame

BS = 16
REMOTE = {"daemons": {"a": "h:1", "b": "h:2", "c": "h:3"}, "replicas": 3}


def _config(durability: object, remote: dict[str, Any] | None = REMOTE,
            **extra: Any) -> ConnectorConfig:
    store: dict[str, Any] = {"host_bytes": 1 << 20}
    if remote is not None:
        store["remote"] = remote
    return ConnectorConfig.from_extra({"store": store, "durability": durability, **extra})


def test_durability_is_off_by_default_and_parses_when_given() -> None:
    assert _config(None).durability is None
    spec = _config({"replicas": 2, "timeout_ms": 750}).durability
    assert spec is not None and spec.replicas == 2 and spec.timeout_s == 0.75
    # Unsaid: every copy the remote tier keeps, within the default deadline.
    default = _config({}).durability
    assert default is not None and default.replicas == 3
    assert default.timeout_s == DEFAULT_DURABILITY_TIMEOUT_MS / 1000


def test_durability_saves_every_block_as_it_completes() -> None:
    """A block must be durable by the end of the step completing it: no checkpoint batching."""
    assert _config(None, checkpoint_tokens=4 * BS).checkpoint_interval(BS) == 4 * BS
    assert _config({"replicas": 1}, checkpoint_tokens=4 * BS).checkpoint_interval(BS) == BS


@pytest.mark.parametrize(("durability", "remote", "message"), [
    ({"replicas": 2}, None, "needs store.remote"),
    ({"replicas": 4}, REMOTE, "keeps 3 copies"),
    ({"replicas": 0}, REMOTE, r">= 1 - at `\$\.durability\.replicas`"),
    ({"replicas": True}, REMOTE, r"got `bool` - at `\$\.durability\.replicas`"),
    ({"timeout_ms": 0}, REMOTE, r"> 0.0 - at `\$\.durability\.timeout_ms`"),
    ({"timeout_ms": "soon"}, REMOTE, r"got `str` - at `\$\.durability\.timeout_ms`"),
    ({"replica": 2}, REMOTE, r"\$\.durability: unknown key\(s\) \['replica'\]"),
    (True, REMOTE, r"Expected `object \| null`, got `bool` - at `\$\.durability`"),
    (2, REMOTE, r"Expected `object \| null`, got `int` - at `\$\.durability`"),
])
def test_bad_durability_is_refused(durability: object, remote: dict[str, Any] | None,
                                   message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        _config(durability, remote)


def test_recent_observations_are_taken_once_and_bounded() -> None:
    recent = RecentObservations(maxlen=3)
    for i in range(5):
        recent.add("remote", float(i))
    assert recent.take() == [("remote", 2.0), ("remote", 3.0), ("remote", 4.0)]  # the newest
    assert recent.take() == []


def test_copy_lags_reach_the_api_servers_histogram_by_tier() -> None:
    store = TieredStore.from_specs([HostSpec(1 << 20)])
    try:
        reporter = StatsReporter(Counts(), block_size=BS, store=store, telemetry=Telemetry(),
                                 store_interval_s=0)
        for i in range(3):
            key = block_key(i)
            assert store.put(key, make_frame(key))
        # A remote tier's R-th acknowledgement, as the store records it.
        store.metrics.copy_lag.labels("remote").observe(2.0)
        store.metrics.recent_copy_lags.add("remote", 2.0)
        report = reporter.take()
        assert report is not None
        observed = report.data["observations"]
        assert len(observed["store_copy_lag_seconds\x1fhost"]) == 3
        assert observed["store_copy_lag_seconds\x1fremote"] == [2.0]
        again = reporter.take()
        assert again is None or "store_copy_lag_seconds\x1fhost" not in again.data["observations"]
    finally:
        store.close()

    # Through msgpack (the engine core's process boundary) into the API server's families.
    wire = KVKeepStats(data=msgpack.unpackb(msgpack.packb(report.data)))
    assert wire.reduce()["store_copy_lag_seconds_count"] == 4
    registry = CollectorRegistry()

    def in_registry(kind: type[Any]) -> type[Any]:
        return cast(type[Any], lambda *a, **k: kind(*a, registry=registry, **{
            n: v for n, v in k.items() if n != "multiprocess_mode"}))

    metrics = KVKeepPromMetrics(
        cast(Any, SimpleNamespace(kv_transfer_config=None)),
        {Counter: in_registry(Counter), Gauge: in_registry(Gauge),
         Histogram: in_registry(Histogram)},
        ["model_name", "engine"], {0: ["tiny", "0"]}, tier_names=["host", "remote"])
    labels = {"model_name": "tiny", "engine": "0"}
    name = "kvkeep_connector_store_copy_lag_seconds"
    # Both tiers' series exist before anything is observed.
    assert registry.get_sample_value(f"{name}_count", {**labels, "tier": "remote"}) == 0
    metrics.observe(wire.data, engine_idx=0)
    assert registry.get_sample_value(f"{name}_count", {**labels, "tier": "host"}) == 3
    assert registry.get_sample_value(f"{name}_count", {**labels, "tier": "remote"}) == 1
    assert registry.get_sample_value(f"{name}_sum", {**labels, "tier": "remote"}) == 2.0
    below = max(b for b in COPY_LAG_BUCKETS if b < 2.0)
    assert registry.get_sample_value(f"{name}_bucket",
                                     {**labels, "tier": "remote", "le": str(below)}) == 0
