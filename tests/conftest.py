"""Shared fixtures: real etcd and redis-server processes, GPU skipping."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.services import EtcdServer, RedisServer, start_etcd, start_redis


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
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def etcd_server(tmp_path: Path) -> Iterator[EtcdServer]:
    with start_etcd(tmp_path) as server:
        yield server


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    with start_redis(tmp_path) as server:
        yield server
