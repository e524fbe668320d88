"""The daemon's transport-neutral core (kvstore/daemon/core.py) on a real store, without a wire:
auth, scopes, limits, the in-flight put budget, admission while draining, verified commits
(into reserved pages and into a buffer), reads lent in place and checked after use. Both
fronts call exactly these; test_daemon*.py and test_tcp_data_plane.py drive them over the wire.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore.daemon.auth import ANONYMOUS, TokenTable
from kvstore.daemon.budgets import block_cost
from kvstore.daemon.catalog import KeyCatalog
from kvstore.daemon.core import BlockServiceCore
from kvstore.keys import Namespace
from kvstore.net.limits import MAX_FRAME_BYTES, MAX_KEYS_PER_CALL
from kvstore.net.refusal import Refusal, RefusalReason
from kvstore.net.scope import Scope
from kvstore.store import StoreConfig, TieredStore
from kvstore.tiers.memory.host import HostTier
from kvstore.tiers.nvme.tier import NvmeTier
from tests.blockframes import FINGERPRINT, NAMESPACE, block_key, corrupt, make_frame

TOKEN_A = "token-tenant-a-0123456789"
SCOPE = Scope(FINGERPRINT.digest, NAMESPACE)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[TieredStore]:
    s = TieredStore([HostTier(32 << 20), NvmeTier(tmp_path / "nvme", 64 << 20)])
    try:
        yield s
    finally:
        s.close()


def make_core(tmp_path: Path, store: TieredStore, **kwargs: object) -> BlockServiceCore:
    catalog = KeyCatalog(tmp_path / "keys.log")
    return BlockServiceCore("n", store, catalog, **kwargs)  # type: ignore[arg-type]


def reason(call: object) -> RefusalReason:
    with pytest.raises(Refusal) as info:
        assert callable(call)
        call()
    return info.value.reason


def put(core: BlockServiceCore, i: int, frame: bytes) -> bool:
    incoming = core.begin_put(SCOPE, block_key(i).block_hash, len(frame))
    with incoming:
        incoming.write(0, frame)
        return incoming.commit()


def test_auth_and_scopes(tmp_path: Path, store: TieredStore) -> None:
    core = make_core(tmp_path, store, tokens=TokenTable({TOKEN_A: ["tenant-a"]}))
    assert reason(lambda: core.authenticate(None)) is RefusalReason.UNAUTHENTICATED
    assert reason(lambda: core.authenticate("x" * 20)) is RefusalReason.UNAUTHENTICATED
    principal = core.authenticate(TOKEN_A)
    assert core.scope(principal, FINGERPRINT.digest, "tenant-a", "") == SCOPE
    assert reason(lambda: core.scope(principal, FINGERPRINT.digest, "tenant-b", "")) is \
        RefusalReason.PERMISSION_DENIED
    for fingerprint, tenant in ((b"short", "tenant-a"), (FINGERPRINT.digest, "../etc")):
        assert reason(lambda f=fingerprint, t=tenant: core.scope(principal, f, t, "")) is \
            RefusalReason.INVALID_ARGUMENT
    assert reason(lambda: core.keys(SCOPE, [b"k"] * (MAX_KEYS_PER_CALL + 1))) is \
        RefusalReason.RESOURCE_EXHAUSTED
    assert reason(lambda: core.keys(SCOPE, [b"h" * 65])) is RefusalReason.INVALID_ARGUMENT
    (tmp_path / "open").mkdir()
    open_core = make_core(tmp_path / "open", store, tokens=None)
    assert open_core.authenticate(None) is ANONYMOUS


def test_the_put_budget_is_taken_and_given_back(tmp_path: Path, store: TieredStore) -> None:
    frames = [make_frame(block_key(i), segment_bytes=100_000) for i in range(3)]
    size = len(frames[0])
    # Each put is charged its file-system blocks plus the per-entry overhead (M4).
    core = make_core(tmp_path, store, tokens=None, max_inflight_put_bytes=2 * block_cost(size))
    first = core.begin_put(SCOPE, block_key(0).block_hash, size)
    second = core.begin_put(SCOPE, block_key(1).block_hash, size)
    assert reason(lambda: core.begin_put(SCOPE, block_key(2).block_hash, size)) is \
        RefusalReason.RESOURCE_EXHAUSTED
    first.abort()  # gives its bytes back, stores nothing
    third = core.begin_put(SCOPE, block_key(2).block_hash, size)
    for incoming, frame in ((second, frames[1]), (third, frames[2])):
        incoming.write(0, frame)
        assert incoming.commit()
    assert core.lookup([block_key(i) for i in range(3)]) == [False, True, True]
    assert put(core, 0, frames[0])  # the budget is whole again
    assert reason(lambda: core.begin_put(SCOPE, b"h", MAX_FRAME_BYTES + 1)) is \
        RefusalReason.RESOURCE_EXHAUSTED
    assert reason(lambda: core.begin_put(SCOPE, b"h", 3)) is RefusalReason.INVALID_ARGUMENT
    assert core.counters().invalid_puts == 2


def test_bad_frames_are_refused_whether_received_into_pages_or_a_buffer(
        tmp_path: Path, store: TieredStore) -> None:
    core = make_core(tmp_path, store, tokens=None)
    # A block bigger than the host tier cannot get pages: it is received into a buffer.
    for i, segment_bytes in ((1, 50_000), (2, 9 << 20)):
        frame = make_frame(block_key(i), segment_bytes=segment_bytes)
        other_key = make_frame(block_key(99), segment_bytes=segment_bytes)
        for bad in (corrupt(frame), other_key):
            incoming = core.begin_put(SCOPE, block_key(i).block_hash, len(bad))
            assert (incoming.reservation is None) == (i == 2)
            with incoming:
                incoming.write(0, bad)
                assert reason(incoming.commit) is RefusalReason.INVALID_ARGUMENT
        assert core.lookup([block_key(i)]) == [False]
        assert put(core, i, frame)
        assert store.flush(30)  # the big one reaches only the nvme tier, written behind
        block = core.open_read(block_key(i), None)
        assert block is not None
        assert b"".join(bytes(p) for p in block.pieces) == frame[len(frame) - block.size:]
        assert block.finish()
    counters = core.counters()
    assert (counters.puts, counters.invalid_puts, counters.hits) == (2, 4, 2)


def test_draining_refuses_new_puts_and_keeps_serving_reads(tmp_path: Path,
                                                           store: TieredStore) -> None:
    core = make_core(tmp_path, store, tokens=None)
    frame = make_frame(block_key(1))
    assert put(core, 1, frame)
    core.start_draining()
    assert reason(core.admit_put_call) is RefusalReason.UNAVAILABLE
    block = core.open_read(block_key(1), (1, 3))
    assert block is not None and block.layers.start == 1 and block.layers.stop == 3
    block.finish()
    assert reason(lambda: core.open_read(block_key(1), (3, 1))) is RefusalReason.INVALID_ARGUMENT


def test_a_corrupt_page_lent_out_is_dropped_and_the_disk_copy_served(
        tmp_path: Path) -> None:
    # The put's own check of the received pages counts for `lent_recheck_s`: a short one here,
    # and the flip below is looked for once it has passed.
    store = TieredStore([HostTier(32 << 20), NvmeTier(tmp_path / "nvme", 64 << 20)],
                        config=StoreConfig(lent_recheck_s=0.2))
    with store:
        _corrupt_page_dropped(tmp_path, store)


def _corrupt_page_dropped(tmp_path: Path, store: TieredStore) -> None:
    core = make_core(tmp_path, store, tokens=None)
    key = block_key(5, Namespace("tenant-a"))
    frame = make_frame(key, segment_bytes=100_000)
    assert put(core, 5, frame)
    assert store.flush(10)
    host = store.tiers[0]
    assert isinstance(host, HostTier)
    entry = host._index[key.digest]  # white box: a bit flips in the daemon's RAM
    host._page_views[entry.pages[-1]][7] ^= 0x10
    time.sleep(0.25)
    lent = core.open_read(key, None)
    assert lent is not None
    assert not lent.finish()  # checked after use: corrupt, and dropped from RAM
    assert host.contains([key]) == [False]
    again = core.open_read(key, None)  # now read (verified) from the nvme tier
    assert again is not None
    assert b"".join(bytes(p) for p in again.pieces) == frame[len(frame) - again.size:]
    assert again.finish()
