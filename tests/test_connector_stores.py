"""The connector's `store` config through the tier factory: every key reaches its tier, the
redis tier included (a real redis-server), and a fresh vLLM engine restores from Redis."""

from __future__ import annotations

from pathlib import Path

import pytest

from connectors.vllm.config import ConnectorConfig, StoreSpec
from connectors.vllm.stores import acquire_store, release_store, tier_specs
from deploy.local.services import RedisServer
from kvstore.errors import ConfigError
from kvstore.tiers.factory import HostSpec, NvmeSpec, RedisSpec, RemoteSpec
from kvstore.tiers.memory.host import HostTier
from kvstore.tiers.nvme.tier import NvmeTier
from kvstore.tiers.redis import RedisTier
from tests.blockframes import block_key, make_frame
from tests.connector_harness import (
    BLOCK_SIZE,
    generate,
    kv_transfer_config,
    open_engine,
    random_prompts,
    worker_connector,
)
from tests.models import TinyModel

pytestmark = pytest.mark.slow


def parse(store: dict[str, object]) -> StoreSpec:
    return ConnectorConfig.from_extra({"store": store}).store


def test_every_store_key_becomes_a_tier_spec(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("# the daemons' bearer token\nsecret-0123456789\n")
    spec = parse({"host_bytes": 1 << 20,
                  "nvme": {"path": str(tmp_path / "nvme"), "bytes": 1 << 24, "durable": False},
                  "remote": {"daemons": {"d1": "127.0.0.1:1"}, "replicas": 1,
                             "timeout_ms": 400, "token_file": str(token)},
                  "redis": {"url": "redis://127.0.0.1:1/2", "prefix": "kv", "ttl_seconds": 60,
                            "timeout_ms": 250}})
    assert tier_specs(spec) == [
        HostSpec(1 << 20),
        NvmeSpec(str(tmp_path / "nvme"), 1 << 24, durable=False),
        RemoteSpec(prefix="/kvkeep/stores/", replicas=1, daemons=(("d1", "127.0.0.1:1"),),
                   timeout_s=0.4, token_file=str(token)),
        RedisSpec("redis://127.0.0.1:1/2", prefix="kv", ttl_s=60, timeout_s=0.25)]
    assert tier_specs(parse({"redis": {"url": "redis://h:6379/0"}})) == [
        RedisSpec("redis://h:6379/0")]


@pytest.mark.parametrize("store", [
    {"redis": {}},  # no url
    {"redis": {"url": "http://not-redis"}},
    {"redis": {"url": "redis://h", "db": 3}},  # unknown key
    {"redis": {"url": "redis://h", "ttl_seconds": 0}},
    {"redis": "redis://h"},
])
def test_bad_redis_configs_are_refused(store: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        parse(store)


def test_a_redis_store_is_built_shared_and_closed(tmp_path: Path,
                                                  redis_server: RedisServer) -> None:
    spec = parse({"host_bytes": 8 << 20, "nvme": {"path": str(tmp_path / "nvme"),
                                                  "bytes": 16 << 20},
                  "redis": {"url": redis_server.url}, "name": "redis-unit"})
    store = acquire_store(spec)
    try:
        assert [type(t) for t in store.tiers] == [HostTier, NvmeTier, RedisTier]
        assert acquire_store(spec) is store  # the scheduler half gets the same store
        release_store(spec)
        key = block_key(7)
        frame = make_frame(key)
        assert store.put(key, frame) and store.flush(10)
        redis_tier = store.tiers[2]
        assert redis_tier.contains([key]) == [True]  # written behind, through the real server
        store.tiers[0].delete([key])
        store.tiers[1].delete([key])
        read = store.get(key, deadline=None)
        assert read is not None and read.verified and read.to_frame() == frame
    finally:
        release_store(spec)
    assert acquire_store(spec) is not store  # the last release closed it
    release_store(spec)


def test_a_fresh_engine_restores_from_redis(tiny: TinyModel, redis_server: RedisServer) -> None:
    """Failover through Redis: the second engine's RAM is empty; every block comes from the
    Redis the first one wrote behind to, and the answers equal an engine without the store."""
    prompts = random_prompts(3, [90, 140, 200], seed=5)
    with open_engine(tiny.path) as llm:
        reference = generate(llm, prompts, 16)
    store = {"host_bytes": 64 << 20, "redis": {"url": redis_server.url}, "name": "redis-e2e"}
    with open_engine(tiny.path, kv_transfer_config(store)) as llm:
        first = generate(llm, prompts, 16)
    assert [r.tokens for r in first] == [r.tokens for r in reference]
    with open_engine(tiny.path, kv_transfer_config(store)) as llm:
        again = generate(llm, prompts, 16)
        counters = worker_connector().counters()
    assert [r.tokens for r in again] == [r.tokens for r in reference]
    restored = [(len(p) - 1) // BLOCK_SIZE * BLOCK_SIZE for p in prompts]
    assert [r.num_cached_tokens for r in again] == restored
    assert counters["loaded_blocks"] == sum(restored) // BLOCK_SIZE
    assert counters["tier_redis_hits"] >= sum(restored) // BLOCK_SIZE
    assert counters["load_corrupt"] == counters["load_missing"] == 0
