"""Shared fixtures: real etcd and redis-server processes, GPU skipping."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import settings

from tests.models import TinyModel, build_tiny_llama
from tests.services import EtcdServer, RedisServer, start_etcd, start_redis

# On a noisy 2-core machine a per-example deadline measures the neighbours, not our code; and
# in CI (CI=true) the examples are derandomized so that a red run can be reproduced exactly.
settings.register_profile("dev", deadline=None)
settings.register_profile("ci", deadline=None, derandomize=True)
settings.load_profile("ci" if os.environ.get("CI") else "dev")


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        # The marker itself: `"gpu" in item.keywords` also matches a checkout directory named
        # gpu (keywords hold the names of parent nodes).
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture
def etcd_server(tmp_path: Path) -> Iterator[EtcdServer]:
    with start_etcd(tmp_path) as server:
        yield server


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    with start_redis(tmp_path) as server:
        yield server


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    """The tiny local Llama the vLLM engine tests run (built once per test session)."""
    return build_tiny_llama(tmp_path_factory.getbasetemp() / "tiny-llama")
