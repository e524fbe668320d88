"""Shared fixtures: real etcd, redis-server and kvstore daemon processes, the tiny model, GPU
skipping."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import settings

from deploy.local.daemons import DaemonProcess, running_daemon, running_daemons
from deploy.local.ports import SLICE_ENV
from deploy.local.services import EtcdServer, RedisServer, start_etcd, start_redis
from kvstore.net.daemon_client import DaemonClient
from tests import grpc_leaks
from tests.models import TinyModel, build_tiny_llama

# On a noisy 2-core machine a per-example deadline measures the neighbours, not our code; and
# in CI (CI=true) the examples are derandomized so that a red run can be reproduced exactly.
settings.register_profile("dev", deadline=None)
settings.register_profile("ci", deadline=None, derandomize=True)
settings.load_profile("ci" if os.environ.get("CI") else "dev")


# pytest-xdist's workers start servers side by side: each takes its own slice of the ports
# (deploy/local/ports.py), so one worker never picks a port another freed for a restart.
if "PYTEST_XDIST_WORKER" in os.environ:
    os.environ[SLICE_ENV] = "{}/{}".format(
        int(os.environ["PYTEST_XDIST_WORKER"].removeprefix("gw")),
        int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects: the check sees every serial test
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _serial_tests_are_found_by_grep(items)
    _slow_modules_first(items)
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        # The marker itself: `"gpu" in item.keywords` also matches a checkout directory named
        # gpu (keywords hold the names of parent nodes).
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


def _serial_tests_are_found_by_grep(items: list[pytest.Item]) -> None:
    """`make pytest` runs its serial part on the modules that `grep -l pytest.mark.serial`
    finds (collecting all 1,600 tests to deselect all but 17 took ~18 s), and its parallel part
    deselects every serial test: a serial test marked any other way would run in neither."""
    for item in items:
        if item.get_closest_marker("serial") is None or item.module is None:
            continue
        source = Path(str(item.module.__file__)).read_text()
        if "pytest.mark.serial" not in source:
            raise pytest.UsageError(f"{item.nodeid} is marked serial, but not as "
                                    "`pytest.mark.serial`, which `make pytest` looks for")


def _slow_modules_first(items: list[pytest.Item]) -> None:
    """Modules holding a `slow` test run first, each module's tests kept together and in file
    order. `make pytest` spreads whole modules over workers (pytest-xdist, `--dist loadfile`,
    `--no-loadscope-reorder`), and a long module started last would run alone at the end while
    the other workers idle; started first, the many short modules fill in around it."""
    slow = {item.module.__name__ for item in items
            if item.module is not None and item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: item.module is None or item.module.__name__ not in slow)


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


# -- daemons: one module's worth, real `python -m kvstore.daemon` processes ---------------------
# A module that needs another kind of daemon (tokens, budgets, metrics) defines its own `daemon`
# fixture, which overrides this one; `running_daemon` keeps that fixture to one line.


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    """One plain daemon for the module (no auth, default budgets, no etcd)."""
    with running_daemon(tmp_path_factory.mktemp("daemon"), "solo") as d:
        yield d


@pytest.fixture
def client(daemon: DaemonProcess) -> DaemonClient:
    """A client of the module's `daemon` (closed when the daemon stops)."""
    return daemon.client()


@pytest.fixture(scope="module")
def daemons(request: pytest.FixtureRequest,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[DaemonProcess]]:
    """`DAEMON_COUNT` daemons for the module (a module constant; 2 when it has none), node ids
    d0, d1, ..., started in parallel."""
    count = int(getattr(request.module, "DAEMON_COUNT", 2))
    with running_daemons(tmp_path_factory.mktemp("daemons"), count) as ds:
        yield ds


# -- engines -------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def model_dir(tiny: TinyModel) -> Path:
    """The tiny Llama's directory, for what takes a model path (`kvkeep demo --model-dir`,
    `vllm serve`)."""
    return tiny.path


grpc_leaks.install()


@pytest.fixture(autouse=True)
def _no_grpc_left_open_on_a_closed_loop() -> Iterator[None]:
    yield
    leaks = grpc_leaks.leaked()
    if leaks:
        pytest.fail("grpc.aio left open on a closed event loop (see tests/grpc_leaks.py): "
                    + "\n".join(leaks), pytrace=False)
