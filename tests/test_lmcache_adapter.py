"""The LMCache-facing adapter (connectors/lmcache/adapter.py) inside LMCache 0.5 itself: built by
LMCache's own plugin factory from the CLI JSON, fed real tensor memory objects, and watched through
its event fds, against real kvkeep daemons (started from kvkeep's own venv, KVKEEP_DAEMON_PYTHON).

Runs in the LMCache environment `make bench-lmcache` builds (.venv-lmcache: LMCache built
CPU-only from source, protobuf < 7, kvkeep's stubs generated for it). Skipped where LMCache is
not installed, which includes kvkeep's own venv: LMCache 0.5 does not accept its protobuf 7.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import select
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lmcache.v1.distributed.l2_adapters.plugin_l2_adapter",
                    reason="LMCache is not installed here; `make bench-lmcache` builds "
                           ".venv-lmcache and runs this module there")
import torch
from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
from lmcache.v1.distributed.l2_adapters import create_l2_adapter
from lmcache.v1.distributed.l2_adapters.config import (
    add_l2_adapters_args,
    parse_args_to_l2_adapters_config,
)
from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj
from lmcache.v1.platform import consume_fd

from connectors.lmcache.adapter import KVKeepL2Adapter, KVKeepL2AdapterConfig
from deploy.local.daemons import DaemonProcess, running_daemons, start_daemon
from deploy.local.services import start_etcd

_LAYOUT = MemoryLayoutDesc(shapes=[], dtypes=[])
_serial = iter(range(1 << 30))


def plugin_json(params: dict[str, Any]) -> str:
    return json.dumps({"type": "plugin", "module_path": "connectors.lmcache.adapter",
                       "class_name": "KVKeepL2Adapter", "adapter_params": params})


def build(params: dict[str, Any]) -> KVKeepL2Adapter:
    """The adapter as LMCache's CLI path builds it: --l2-adapter JSON, its parser, its factory."""
    parser = argparse.ArgumentParser()
    add_l2_adapters_args(parser)
    config = parse_args_to_l2_adapters_config(parser.parse_args(["--l2-adapter",
                                                                 plugin_json(params)]))
    adapter = create_l2_adapter(config.adapters[0])
    assert isinstance(adapter, KVKeepL2Adapter)
    return adapter


def params_for(daemons: list[DaemonProcess], **extra: Any) -> dict[str, Any]:
    # A fresh model revision per adapter: every test starts with nothing stored.
    return {"daemons": {d.node_id: d.address for d in daemons}, "replicas": min(2, len(daemons)),
            "timeout_ms": 1500, "model_revision": f"t{next(_serial)}-{time.time_ns()}", **extra}


def kv_object(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> TensorMemoryObj:
    gen = torch.Generator().manual_seed(seed)
    tensor = torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype)
    meta = MemoryObjMetadata(shape=torch.Size(shape), dtype=dtype, address=0,
                             phy_size=tensor.nelement() * tensor.element_size(),
                             fmt=MemoryFormat.KV_2LTD, ref_count=1)
    return TensorMemoryObj(tensor, meta, parent_allocator=None)


def empty_like(obj: TensorMemoryObj) -> TensorMemoryObj:
    assert obj.tensor is not None
    return kv_object(tuple(obj.tensor.shape), obj.tensor.dtype, 0)


def key(i: int, *, model: str = "meta-llama/Llama-3.1-8B", rank: int = 0, salt: str = ""
        ) -> ObjectKey:
    return ObjectKey(chunk_hash=i.to_bytes(32, "big"), model_name=model, kv_rank=rank,
                     cache_salt=salt)


def wait_fd(fd: int, timeout: float = 20.0) -> None:
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    assert poller.poll(timeout * 1000), "the adapter never signalled its event fd"
    with contextlib.suppress(BlockingIOError):  # another waiter consumed it
        consume_fd(fd)


def store(adapter: KVKeepL2Adapter, keys: list[ObjectKey], objs: list[Any]) -> Any:
    task = adapter.submit_store_task(keys, objs)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        wait_fd(adapter.get_store_event_fd())
        done = adapter.pop_completed_store_tasks()
        if task in done:
            return done[task]
    raise AssertionError("store task never completed")


def lookup(adapter: KVKeepL2Adapter, keys: list[ObjectKey]) -> list[bool]:
    task = adapter.submit_lookup_and_lock_task(keys, {0: _LAYOUT})
    wait_fd(adapter.get_lookup_and_lock_event_fd())
    bitmap = adapter.query_lookup_and_lock_result(task)
    assert bitmap is not None
    return [bitmap.test(i) for i in range(len(keys))]


def load(adapter: KVKeepL2Adapter, keys: list[ObjectKey], objs: list[Any]) -> list[bool]:
    task = adapter.submit_load_task(keys, objs)
    wait_fd(adapter.get_load_event_fd())
    bitmap = adapter.query_load_result(task)
    assert bitmap is not None
    return [bitmap.test(i) for i in range(len(keys))]


# Its own fixture, not conftest's: LMCache's venv runs this module with --noconftest
# (benchmarks/lmcache_tests.sh), as tests/conftest.py imports what that venv does not have.
@pytest.fixture(scope="module")
def daemons(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[DaemonProcess]]:
    with running_daemons(tmp_path_factory.mktemp("lmcache-adapter"), 2) as ds:
        yield ds


def test_lmcache_builds_the_plugin_with_its_config_class(daemons: list[DaemonProcess]) -> None:
    adapter = build(params_for(daemons, tenant="team-a"))
    try:
        assert adapter.report_status()["tenant"] == "team-a"
        fds = {adapter.get_store_event_fd(), adapter.get_lookup_and_lock_event_fd(),
               adapter.get_load_event_fd()}
        assert len(fds) == 3
        assert KVKeepL2AdapterConfig.from_dict(params_for(daemons)).settings.replicas == 2
    finally:
        adapter.close()
    with pytest.raises(Exception, match=r"adapter_params: \$: unknown key\(s\) \['tennant'\]"):
        build({**params_for(daemons), "tennant": "x"})


@pytest.mark.parametrize(("shape", "dtype"), [((2, 4, 256, 1024), torch.bfloat16),
                                              ((2, 32, 16, 128), torch.float16),
                                              ((2, 3, 7, 5), torch.float32)])
def test_kv_objects_round_trip(daemons: list[DaemonProcess], shape: tuple[int, ...],
                               dtype: torch.dtype) -> None:
    adapter = build(params_for(daemons))
    try:
        keys = ([key(i) for i in range(3)] + [key(0, rank=1), key(0, salt="user 42:a+b")])
        objs = [kv_object(shape, dtype, seed) for seed in range(len(keys))]
        result = store(adapter, keys, objs)
        assert result.is_successful()
        assert result.bytes_transferred() == sum(o.get_size() for o in objs)
        missing = key(99)
        assert lookup(adapter, [*keys, missing]) == [True] * len(keys) + [False]
        outs = [empty_like(o) for o in objs]
        assert load(adapter, [*keys, missing], [*outs, empty_like(objs[0])]) == \
            [True] * len(keys) + [False]
        for got, want in zip(outs, objs, strict=True):
            assert torch.equal(got.tensor, want.tensor)
        adapter.submit_unlock(keys)
    finally:
        adapter.close()


def test_usage_accounting_and_delete(daemons: list[DaemonProcess]) -> None:
    adapter = build(params_for(daemons))
    try:
        objs = [kv_object((2, 2, 8, 64), torch.float16, s) for s in range(3)]
        keys = [key(i) for i in range(3)]
        assert store(adapter, keys, objs).is_successful()
        size = objs[0].get_size()
        assert adapter.get_usage().total_bytes_used == 3 * size
        again = store(adapter, keys[:1], objs[:1])  # already held: counted once
        assert again.is_successful() and again.bytes_transferred() == 0
        assert adapter.get_usage().total_bytes_used == 3 * size
        adapter.delete(keys[:2])
        assert adapter.get_usage().total_bytes_used == size
        assert lookup(adapter, keys) == [False, False, True]
        # Gone behind its back (another client, or the daemon's own eviction): LMCache's
        # delete still takes it out of the usage, which would otherwise never shrink.
        params = params_for(daemons)
        params["model_revision"] = adapter.report_status()["model_revision"]
        other = build(params)
        try:
            other.delete(keys[2:])
            assert lookup(adapter, keys[2:]) == [False]
            assert other.get_usage().total_bytes_used == 0  # it never stored it
        finally:
            other.close()
        adapter.delete(keys[2:])
        assert adapter.get_usage().total_bytes_used == 0
    finally:
        adapter.close()


def test_dead_daemons_are_misses_and_every_task_completes(tmp_path: Path) -> None:
    daemon = start_daemon(tmp_path, "only")
    adapter = build(params_for([daemon], timeout_ms=800, lookup_timeout_ms=400))
    try:
        objs = [kv_object((2, 2, 16, 64), torch.bfloat16, s) for s in range(2)]
        keys = [key(i) for i in range(2)]
        assert store(adapter, keys, objs).is_successful()
        daemon.kill()
        assert lookup(adapter, keys) == [False, False]
        outs = [empty_like(o) for o in objs]
        assert load(adapter, keys, outs) == [False, False]
        assert not store(adapter, [key(7)], objs[:1]).is_successful()
        assert adapter.report_status()["is_healthy"] is False
    finally:
        adapter.close()


def test_a_refused_token_is_a_miss(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("token-team-a-0123456 team-a\n")
    daemon = start_daemon(tmp_path, "auth", token_file=tokens)
    wrong = tmp_path / "wrong.token"
    wrong.write_text("token-not-known-here\n")
    good = tmp_path / "good.token"
    good.write_text("token-team-a-0123456\n")
    owner = build(params_for([daemon], tenant="team-a", token_file=str(good)))
    intruder = build(params_for([daemon], tenant="team-a", token_file=str(wrong)))
    try:
        obj = kv_object((2, 2, 8, 32), torch.float16, 1)
        assert owner.report_status()["is_healthy"]
        assert store(owner, [key(1)], [obj]).is_successful()
        assert not store(intruder, [key(2)], [obj]).is_successful()
        assert lookup(intruder, [key(1)]) == [False]
    finally:
        owner.close()
        intruder.close()
        daemon.terminate()


def test_etcd_discovery_works_under_lmcache_protobuf(tmp_path: Path) -> None:
    """aetcd and kvkeep's regenerated stubs under LMCache's protobuf < 7."""
    import google.protobuf

    assert int(google.protobuf.__version__.split(".")[0]) < 7  # the point of this venv
    with start_etcd(tmp_path) as etcd, running_daemons(tmp_path, 2, etcd_url=etcd.url):
        adapter = build({"etcd": etcd.url, "replicas": 2,
                         "model_revision": f"etcd-{time.time_ns()}"})
        try:
            objs = [kv_object((2, 4, 32, 64), torch.bfloat16, s) for s in range(4)]
            keys = [key(i) for i in range(4)]
            assert store(adapter, keys, objs).is_successful()
            outs = [empty_like(o) for o in objs]
            assert load(adapter, keys, outs) == [True] * 4
            assert all(torch.equal(a.tensor, b.tensor) for a, b in zip(outs, objs, strict=True))
            assert sorted(adapter.report_status()["daemons"]) == ["d0", "d1"]
        finally:
            adapter.close()
