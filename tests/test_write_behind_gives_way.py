"""The write-behind gives way to the store's callers (StoreConfig `writer_quiet_s`,
`writer_defer_max_s`), and never past its bounds.

On a node short of cores, the disk writer ran beside every burst of puts and gets: LMCache's
own benchmark, on one kvkeep daemon, stored 256 KiB objects at 0.50-0.56 GB/s with the writer
starting at once and at 0.75-0.82 with it waiting for a 5 ms pause (benchmarks/lmcache.py,
connectors/lmcache/README.md). What must hold whatever the timing: a copy is held back only
while callers keep coming, at most `writer_defer_max_s`, and not at all while anyone waits for
the writer (a flush; a put whose ack waits for the disk; an event loop's watcher), so neither
back-pressure nor a flush can stall on it.

Real tiers (host RAM over NVMe files). The "still held back" checks give the callers' traffic
a pause budget (`writer_quiet_s`) of seconds against gaps of milliseconds, so that only a
scheduler stall of seconds could let the writer go early.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore.errors import ConfigError
from kvstore.store import StoreConfig, TieredStore
from kvstore.tiers.memory.host import HostTier
from kvstore.tiers.nvme.tier import NvmeTier
from tests.blockframes import block_key, make_frame

T = 30.0


def _store(tmp_path: Path, *, quiet: float, defer_max: float) -> tuple[TieredStore, NvmeTier]:
    disk = NvmeTier(tmp_path / "nvme", 64 << 20, durable=False)
    store = TieredStore([HostTier(16 << 20), disk], config=StoreConfig(
        writer_quiet_s=quiet, writer_defer_max_s=defer_max, promote=False))
    return store, disk


@contextlib.contextmanager
def _busy_callers(store: TieredStore) -> Iterator[threading.Event]:
    """A caller reading from the store every few milliseconds until the block exits (or the
    yielded event is set)."""
    stop = threading.Event()
    key = block_key(10_000)
    store.put(key, make_frame(key))

    def read() -> None:
        while not stop.is_set():
            store.get(key)
            stop.wait(0.005)
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        yield stop
    finally:
        stop.set()
        reader.join(T)


def _on_disk(disk: NvmeTier, i: int) -> bool:
    return disk.contains([block_key(i)])[0]


def _wait_on_disk(disk: NvmeTier, i: int, timeout: float = T) -> float:
    """Seconds until block `i` is on the disk tier; fails past `timeout`."""
    began = time.monotonic()
    while not _on_disk(disk, i):
        assert time.monotonic() - began < timeout, f"block {i} never reached the disk"
        time.sleep(0.01)
    return time.monotonic() - began


def test_copies_wait_while_callers_keep_coming_and_go_once_they_pause(tmp_path: Path) -> None:
    store, disk = _store(tmp_path, quiet=3.0, defer_max=60.0)
    with store:
        with _busy_callers(store) as stop:
            store.put(block_key(1), make_frame(block_key(1)))
            time.sleep(1.0)
            assert not _on_disk(disk, 1), "written while the callers were busy"
            assert store.pending_writes >= 1
            stop.set()
        _wait_on_disk(disk, 1)
        read = store.get(block_key(1))
        assert read is not None and read.to_frame() == make_frame(block_key(1))


def test_callers_that_never_pause_delay_a_copy_by_at_most_defer_max(tmp_path: Path) -> None:
    store, disk = _store(tmp_path, quiet=120.0, defer_max=0.5)
    with store, _busy_callers(store):
        for i in range(3):
            store.put(block_key(i), make_frame(block_key(i)))
        for i in range(3):
            _wait_on_disk(disk, i)
        assert store.stats().write_behind_dropped == 0


def test_a_flush_does_not_wait_for_the_callers_to_pause(tmp_path: Path) -> None:
    store, disk = _store(tmp_path, quiet=120.0, defer_max=120.0)
    with store, _busy_callers(store):
        for i in range(5):
            store.put(block_key(i), make_frame(block_key(i)))
        time.sleep(0.2)
        assert not any(_on_disk(disk, i) for i in range(5))
        began = time.monotonic()
        assert store.flush(T), "a flush waited for a pause that never came"
        assert time.monotonic() - began < T
        assert all(_on_disk(disk, i) for i in range(5))


def test_acks_held_by_back_pressure_do_not_wait_for_the_pause(tmp_path: Path) -> None:
    """What the daemon does before acknowledging a put while the disk is behind
    (`wait_pending_writes`), and its gRPC front's event-loop form (a watcher)."""
    store, disk = _store(tmp_path, quiet=120.0, defer_max=120.0)
    with store, _busy_callers(store):
        for i in range(4):
            store.put(block_key(i), make_frame(block_key(i)))
        assert store.wait_pending_writes(0, T), "back-pressure waited for the callers' pause"
        assert all(_on_disk(disk, i) for i in range(4))
        store.put(block_key(9), make_frame(block_key(9)))
        woken = threading.Event()
        store.when_pending_writes_at_most(0, woken.set)
        assert woken.wait(T), "a watcher waited for the callers' pause"
        assert _on_disk(disk, 9)


def test_closing_writes_what_was_held_back(tmp_path: Path) -> None:
    store, _ = _store(tmp_path, quiet=120.0, defer_max=120.0)
    with _busy_callers(store) as stop:
        store.put(block_key(1), make_frame(block_key(1)))
        stop.set()  # callers gone a moment ago: the copy would still wait its 120 s
        began = time.monotonic()
        store.close(T)  # closes the tiers too
        assert time.monotonic() - began < T
    with NvmeTier(tmp_path / "nvme", 64 << 20) as reopened:
        assert reopened.contains([block_key(1)]) == [True]


def test_without_a_quiet_time_the_writer_starts_at_once(tmp_path: Path) -> None:
    store, disk = _store(tmp_path, quiet=0.0, defer_max=120.0)
    with store, _busy_callers(store):
        store.put(block_key(1), make_frame(block_key(1)))
        _wait_on_disk(disk, 1, timeout=T)


@pytest.mark.parametrize("field", ["writer_quiet_s", "writer_defer_max_s"])
def test_negative_waits_are_refused(field: str) -> None:
    with pytest.raises(ConfigError):
        StoreConfig(**{field: -1.0})  # type: ignore[arg-type]
