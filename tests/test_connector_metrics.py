"""The connector's metrics reach Prometheus from a running vLLM, and engines whose block hashes
cannot be reproduced are refused.

The metrics tests scrape a REAL vLLM OpenAI server (deploy/local/vllm_server.py) started with the
connector over a real kvstore daemon, in both of the engine core's modes (`in-process`: the
model runner, so the connector's worker half, in the engine core's process beside its scheduler
half; `multiprocess`: in a worker process of its own; `vllm serve` runs the engine core apart
from its API server either way): after a save, a restore, and a restore whose blocks rotted on
the daemon's disk, every family holds real values on vLLM's own `/metrics`.
"""

from __future__ import annotations

import json
import signal
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgpack
import pytest

from connectors.vllm.hash_check import (
    NON_CRYPTOGRAPHIC_HASH_ALGOS,
    check_block_hashes_reproducible,
)
from connectors.vllm.prometheus import STORE_COUNTERS, KVKeepStats, StatsReporter
from connectors.vllm.stats import Count, Counts
from connectors.vllm.telemetry import Telemetry
from deploy.local.daemons import DaemonProcess, running_daemon
from deploy.local.engines import vllm_env
from deploy.local.services import free_port
from deploy.local.vllm_server import VllmServer, start_vllm
from kvstore.errors import ConfigError
from kvstore.metrics import StoreMetrics
from kvstore.store import TieredStore
from kvstore.tiers.factory import HostSpec
from tests.blockframes import block_key, make_frame
from tests.connector_harness import (
    BLOCK_SIZE,
    generate,
    kv_transfer_config,
    open_engine,
    random_prompts,
    worker_connector,
)
from tests.metrics_scrape import Scrape, scrape, wait_for_sample
from tests.models import TinyModel

T = 60.0
PROMPT = random_prompts(1, 4 * BLOCK_SIZE + 5, seed=11)[0]  # 4 full blocks


# -- units ----------------------------------------------------------------------------------

def test_every_store_counter_is_forwarded() -> None:
    from prometheus_client import Counter

    metrics = StoreMetrics()
    counters = {name for name, value in vars(metrics).items() if isinstance(value, Counter)}
    assert counters == set(STORE_COUNTERS)
    for name, labels in STORE_COUNTERS.items():
        assert tuple(getattr(metrics, name)._labelnames) == labels, name


def test_reports_are_deltas_that_survive_msgpack() -> None:
    counters, telemetry = Counts(), Telemetry()
    store = TieredStore.from_specs([HostSpec(1 << 20)])
    try:
        reporter = StatsReporter(counters, block_size=16, store=store, telemetry=telemetry,
                                 store_interval_s=3600)
        key = block_key(1)
        assert store.put(key, make_frame(key))
        assert store.get(key) is not None
        counters.add(Count.LOADED_BLOCKS, 3)
        counters.add(Count.LOAD_CORRUPT)
        telemetry.restore(0.02, blocks=4, restored=3)
        telemetry.saved(0.5)
        first = reporter.take()
        assert first is not None
        c = first.data["counters"]
        assert c["restored_tokens"] == {"": 48} and c["recomputed_tokens"] == {"": 16}
        assert c["load_failures"] == {"corrupt": 1}
        assert c["events"] == {"loaded_blocks": 3, "load_corrupt": 1}
        assert c["store_hits"] == {"host": 1}
        observations = first.data["observations"]
        (host_lag,) = observations.pop("store_copy_lag_seconds\x1fhost")  # the put's own
        assert 0 <= host_lag < 60
        assert observations == {"restore_seconds": [0.02], "save_lag_seconds": [0.5]}
        assert reporter.take() is None  # nothing new, and the store is not read again yet
        counters.add(Count.LOADED_BLOCKS)
        second = reporter.take()
        assert second is not None and second.data["counters"] == {
            "events": {"loaded_blocks": 1}}

        wire = msgpack.unpackb(msgpack.packb(first.data))
        merged = KVKeepStats(data=wire).aggregate(KVKeepStats(data=second.data))
        assert isinstance(merged, KVKeepStats)
        assert merged.data["counters"]["events"]["loaded_blocks"] == 4
        assert merged.reduce()["restore_seconds_count"] == 1
        assert KVKeepStats().is_empty() and not merged.is_empty()
    finally:
        store.close()


def test_the_refused_hash_algorithms_are_vllms_non_cryptographic_ones() -> None:
    from vllm.config.cache import PrefixCachingHashAlgo
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils

    random_seeded = {algo for algo in typing.get_args(PrefixCachingHashAlgo)
                     if get_hash_fn_by_name(algo) in kv_cache_utils._NON_CRYPTO_HASH_FUNCTIONS}
    assert random_seeded == NON_CRYPTOGRAPHIC_HASH_ALGOS
    check_block_hashes_reproducible("sha256", {})
    check_block_hashes_reproducible("xxhash", {"PYTHONHASHSEED": "7"})
    with pytest.raises(ConfigError, match="PYTHONHASHSEED"):
        check_block_hashes_reproducible("xxhash_cbor", {})


# -- real engines: the block-hash check ----------------------------------------------------

@pytest.mark.slow
def test_an_engine_with_random_block_hashes_is_refused(tiny: TinyModel, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    store = {"nvme": {"path": str(tmp_path / "nvme"), "bytes": 64 << 20}, "name": "hash-refused"}
    with pytest.raises(Exception, match="PYTHONHASHSEED") as refused, \
            open_engine(tiny.path, kv_transfer_config(store),
                        prefix_caching_hash_algo="xxhash"):
        pass
    assert "prefix-caching-hash-algo xxhash" in str(refused.value)


@pytest.mark.slow
def test_a_seeded_xxhash_engine_restores_what_another_saved(
        tiny: TinyModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONHASHSEED", "1234")
    nvme = {"path": str(tmp_path / "nvme"), "bytes": 64 << 20}
    with open_engine(tiny.path, kv_transfer_config({"nvme": nvme, "name": "seeded-a"}),
                     prefix_caching_hash_algo="xxhash") as llm:
        first = generate(llm, [PROMPT], 4)
        assert worker_connector().counters()["saved_blocks"] == 4
    # Another engine (vLLM derives the chain's seed again): the same hashes, so a restore.
    with open_engine(tiny.path, kv_transfer_config({"nvme": nvme, "name": "seeded-b"}),
                     prefix_caching_hash_algo="xxhash") as llm:
        second = generate(llm, [PROMPT], 4)
        assert worker_connector().counters()["loaded_blocks"] == 4
    assert second[0].tokens == first[0].tokens
    assert second[0].num_cached_tokens == 4 * BLOCK_SIZE


# -- real servers: the metrics -------------------------------------------------------------

@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[tuple[DaemonProcess, str]]:
    port = free_port()
    with running_daemon(tmp_path, "d0", extra=["--metrics-listen", f"127.0.0.1:{port}"]) as d:
        yield d, f"http://127.0.0.1:{port}/metrics"


def _complete(server: VllmServer, prompt: list[int]) -> dict[str, Any]:
    reply = httpx.post(f"{server.url}/v1/completions", timeout=T, json={
        "model": server.name, "prompt": prompt, "max_tokens": 4, "temperature": 0})
    reply.raise_for_status()
    return dict(reply.json())


def _reset_prefix_cache(server: VllmServer) -> None:
    httpx.post(f"{server.url}/reset_prefix_cache", timeout=T).raise_for_status()


def _connector(m: Scrape, name: str, **labels: str) -> float:
    return m.value(f"kvkeep_connector_{name}", model_name="tiny", **labels)


@pytest.mark.slow
@pytest.mark.parametrize("engine_process", ["in-process", "multiprocess"])
def test_connector_metrics_on_vllms_own_endpoint(
        tiny: TinyModel, tmp_path: Path, daemon: tuple[DaemonProcess, str],
        engine_process: str) -> None:
    d, daemon_metrics = daemon
    config = kv_transfer_config({"remote": {"daemons": {"d0": d.address}, "replicas": 1,
                                            "timeout_ms": 2000}})
    env = vllm_env(VLLM_SERVER_DEV_MODE="1", VLLM_ENABLE_V1_MULTIPROCESSING=(
        "0" if engine_process == "in-process" else "1"))
    server = start_vllm(tiny.path, tmp_path, kv_events=False, env=env, dtype="bfloat16",
                        extra_args=["--kv-transfer-config", json.dumps(config)])
    try:
        server.wait_healthy()
        before = scrape(f"{server.url}/metrics")
        # Every family is there before any traffic, at 0.
        assert _connector(before, "restored_tokens_total") == 0
        assert _connector(before, "load_failures_total", cause="missing") == 0
        assert _connector(before, "store_hits_total", tier="remote") == 0

        answer = _complete(server, PROMPT)["choices"][0]["text"]
        wait_for_sample(daemon_metrics, lambda s: s.value("kvkeep_daemon_puts_total") >= 4)
        _reset_prefix_cache(server)
        assert _complete(server, PROMPT)["choices"][0]["text"] == answer  # restored

        # The daemon's copies rot on its disk: the next restore finds them unusable.
        assert d.terminate() == 0
        for path in (d.data_dir / "blocks").rglob("*.kvb"):
            data = bytearray(path.read_bytes())
            data[len(data) // 2] ^= 0x10
            path.write_bytes(bytes(data))
        d.spawn()
        d.wait_healthy()
        _reset_prefix_cache(server)
        assert _complete(server, PROMPT)["choices"][0]["text"] == answer  # recomputed
        _complete(server, PROMPT[:40])  # one more step to carry the last reports

        m = wait_for_sample(f"{server.url}/metrics", lambda s: _connector(
            s, "load_failures_total", cause="missing") >= 1, timeout=T)
        assert _connector(m, "restored_tokens_total") == 4 * BLOCK_SIZE
        assert _connector(m, "recomputed_tokens_total") >= BLOCK_SIZE
        assert _connector(m, "restore_seconds_count") >= 2
        assert _connector(m, "restore_seconds_sum") > 0
        assert _connector(m, "saved_blocks_total") >= 4
        assert _connector(m, "save_lag_seconds_count") >= 4
        assert _connector(m, "save_failures_total", cause="backpressure") == 0
        assert _connector(m, "events_total", event="lookups") >= 3  # the scheduler half's
        assert _connector(m, "events_total", event="loaded_blocks") == 4
        assert _connector(m, "store_hits_total", tier="remote") >= 4
        assert _connector(m, "store_tier_misses_total", tier="remote") >= 1
        assert _connector(m, "store_write_behind_dropped_total", reason="queue_full") == 0
        assert _connector(m, "store_write_queue_depth") == 0
        assert _connector(m, "daemon_breaker", daemon="d0", state="closed") == 1
        assert _connector(m, "daemon_breaker", daemon="d0", state="open") == 0
        assert m.label_values("kvkeep_connector_restored_tokens_total", "engine") == {"0"}
        # ... beside vLLM's own, on the same endpoint.
        assert m.value("vllm:prompt_tokens_total", model_name="tiny") > 0
        assert scrape(daemon_metrics).value("kvkeep_store_corrupt_blocks_total",
                                            tier="nvme") >= 1
        # Started through `kvkeep serve-vllm` (exec'd): SIGTERM is vLLM's, and so is the exit.
        assert server.stop(grace_s=60.0) in (0, -signal.SIGTERM)
    finally:
        server.kill()
