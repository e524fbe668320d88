"""Replicated puts and the copy lag histogram, over real kvstore daemons (and host tiers).

`put_replicated` must not return True for a block before R distinct daemons hold it; when they
cannot (a daemon down, a deadline), it says so and the block still goes behind as a plain put.
`kvkeep_store_copy_lag_seconds` times every tier's copy from the block's computation.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from deploy.local.daemons import DaemonProcess, running_daemons
from kvstore.errors import ConfigError
from kvstore.keys import BlockKey
from kvstore.net.daemon_client import DaemonClient
from kvstore.net.scope import scope_of
from kvstore.store import TieredStore
from kvstore.tiers.memory.host import HostTier
from kvstore.tiers.remote.tier import RemoteConfig, RemoteTier
from tests.blockframes import block_key, make_frame

MiB = 1 << 20
T = 10.0


def lag_samples(store: TieredStore, tier: str, *, above: float = 0.0) -> int:
    """How many copy-lag observations of `tier` exceeded `above` seconds."""
    total = below = 0.0
    for metric in store.metrics.copy_lag.collect():
        for sample in metric.samples:
            if sample.labels.get("tier") != tier or not sample.name.endswith("_bucket"):
                continue
            if sample.labels["le"] == "+Inf":
                total = sample.value
            elif float(sample.labels["le"]) == above:
                below = sample.value
    return int(total - below)


def copies_on(daemons: list[DaemonProcess], keys: list[BlockKey]) -> list[int]:
    """How many of `daemons` hold each key, asked directly."""
    counts = [0] * len(keys)
    for d in daemons:
        client = DaemonClient(d.node_id, d.address)
        try:
            flags = client.lookup(scope_of(keys[0]), [k.block_hash for k in keys], timeout=T)
        finally:
            client.close()
        counts = [c + int(f) for c, f in zip(counts, flags, strict=True)]
    return counts


def remote_store(daemons: list[DaemonProcess], *, replicas: int = 2,
                 write_ack: str = "all") -> TieredStore:
    remote = RemoteTier.from_addresses(
        {d.node_id: d.address for d in daemons},
        RemoteConfig(replicas=replicas, write_ack=write_ack,  # type: ignore[arg-type]
                     call_timeout=2.0, breaker_cooldown=0.2))
    return TieredStore([HostTier(16 * MiB, name="host"), remote])


@pytest.fixture
def three(tmp_path: Path) -> Iterator[list[DaemonProcess]]:
    with running_daemons(tmp_path, 3) as daemons:
        yield daemons


def test_copy_lag_is_timed_from_the_computation_for_every_tier() -> None:
    store = TieredStore([HostTier(4 * MiB, name="upper"), HostTier(4 * MiB, name="lower")])
    try:
        old, fresh = block_key(1), block_key(2)
        assert store.put(old, make_frame(old), computed_at=time.monotonic() - 20.0)
        assert store.put(fresh, make_frame(fresh))
        assert store.flush(5.0)
        # Computed 20 s ago: both tiers' copies lag by more than 10 s; the fresh one does not.
        assert lag_samples(store, "upper", above=10.0) == 1
        assert lag_samples(store, "lower", above=10.0) == 1
        assert lag_samples(store, "lower") == 2
    finally:
        store.close()


def test_put_replicated_returns_once_r_daemons_hold_each_block(
        three: list[DaemonProcess]) -> None:
    # write_ack="one": a plain put would return after one copy; a replicated put waits for 2.
    store = remote_store(three, write_ack="one")
    try:
        keys = [block_key(i) for i in range(12)]
        assert store.max_replicated_copies == 2
        ok = store.put_replicated([(k, make_frame(k)) for k in keys], copies=2,
                                  deadline=time.monotonic() + T)
        assert ok == [True] * len(keys)
        counts = copies_on(three, keys)  # asked at once: nothing was left to the background
        assert all(c >= 2 for c in counts), counts
        assert store.replicated_prefix(keys, copies=2) == len(keys)
        assert lag_samples(store, "remote") == len(keys)
        assert lag_samples(store, "host") == len(keys)
    finally:
        store.close()


def test_replicated_prefix_counts_distinct_daemons(three: list[DaemonProcess]) -> None:
    store = remote_store(three)
    try:
        keys = [block_key(100 + i) for i in range(4)]
        assert all(store.put_replicated([(k, make_frame(k)) for k in keys], copies=2,
                                        deadline=time.monotonic() + T))
        # One daemon loses block 2: it is held once, so the 2-copy prefix ends before it.
        holder = next(d for d in three if copies_on([d], [keys[2]]) == [1])
        client = DaemonClient(holder.node_id, holder.address)
        try:
            client.delete(scope_of(keys[2]), [keys[2].block_hash], timeout=T)
        finally:
            client.close()
        assert copies_on(three, [keys[2]]) == [1]
        assert store.replicated_prefix(keys, copies=2) == 2
        assert store.replicated_prefix(keys, copies=1) == 4
    finally:
        store.close()


def test_too_few_daemons_is_not_durable_and_falls_back_to_write_behind(
        tmp_path: Path) -> None:
    with running_daemons(tmp_path, 2) as daemons:
        store = remote_store(daemons)
        try:
            daemons[1].kill()
            keys = [block_key(200 + i) for i in range(3)]
            ok = store.put_replicated([(k, make_frame(k)) for k in keys], copies=2,
                                      deadline=time.monotonic() + T)
            assert ok == [False] * 3
            # Not lost for all that: in the host tier at once, and behind to the survivor.
            assert store.lookup(keys) == 3
            assert store.flush(T)
            assert copies_on(daemons[:1], keys) == [1, 1, 1]
            assert store.replicated_prefix(keys, copies=1) == 3
            assert store.replicated_prefix(keys, copies=2) == 0
        finally:
            store.close()


def test_a_stopped_daemon_ends_the_wait_at_the_deadline(tmp_path: Path) -> None:
    with running_daemons(tmp_path, 2) as daemons:
        store = remote_store(daemons)
        stopped = daemons[1]
        assert stopped.proc is not None
        try:
            os.kill(stopped.proc.pid, signal.SIGSTOP)
            key = block_key(300)
            ok = store.put_replicated([(key, make_frame(key))], copies=2,
                                      deadline=time.monotonic() + 0.5)
            assert ok == [False]
            assert copies_on(daemons[:1], [key]) == [1]  # the live one got its copy
        finally:
            os.kill(stopped.proc.pid, signal.SIGCONT)
            store.close()


def test_more_copies_than_the_store_keeps_is_a_config_error(three: list[DaemonProcess]
                                                              ) -> None:
    key = block_key(400)
    local = TieredStore([HostTier(4 * MiB, name="host")])
    store = remote_store(three)
    try:
        assert local.max_replicated_copies == 0
        with pytest.raises(ConfigError):
            local.put_replicated([(key, make_frame(key))], copies=1, deadline=time.monotonic())
        assert local.replicated_prefix([key], copies=1) == 0
        with pytest.raises(ConfigError):
            store.put_replicated([(key, make_frame(key))], copies=3,
                                 deadline=time.monotonic() + T)
    finally:
        local.close()
        store.close()
