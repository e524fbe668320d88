"""A repair pass is done only when its copies were admitted.

A peer answers a put with one flag per block; a block it did not admit (full, or over a tenant's
budget) still lacks its R-th copy. The pass then counts the peer as failed, which keeps the pass
"not done" and brings another one after the grace period, and passes that keep failing pause
longer and longer in between (kvstore/daemon/replication.py).

The peer here is a stand-in client (a daemon that refuses admission on demand cannot be made
without filling a real disk); the pushing side is real: a store, a catalog, the Rereplicator.
tests/test_remote_tier_cluster.py proves the repair itself against real daemons.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import ClassVar

import pytest

from kvstore.cluster.daemon_info import DaemonInfo
from kvstore.daemon import replication
from kvstore.daemon.catalog import KeyCatalog
from kvstore.daemon.replication import Rereplicator
from kvstore.net.scope import Scope
from kvstore.store import TieredStore
from kvstore.tiers.memory.host import HostTier
from tests.blockframes import block_key, make_frame

N_BLOCKS = 12


class _Peer:
    """A peer that holds none of the blocks and admits those `admit` allows."""

    admit: ClassVar[Callable[[int], bool]] = staticmethod(lambda _i: True)
    offered: ClassVar[list[int]] = []

    def __init__(self, node_id: str, address: str, **_options: object) -> None:
        self.node_id = node_id

    def lookup(self, scope: Scope, hashes: Sequence[bytes], *, timeout: float) -> list[bool]:
        return [False] * len(hashes)

    def put(self, scope: Scope, blocks: Sequence[tuple[bytes, bytes]], *,
            timeout: float) -> list[bool]:
        start = len(_Peer.offered)
        _Peer.offered.extend(range(start, start + len(blocks)))
        return [_Peer.admit(start + i) for i in range(len(blocks))]

    def close(self) -> None:
        pass


@pytest.fixture
def rereplicator(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Rereplicator]:
    monkeypatch.setattr(replication, "DaemonClient", _Peer)
    _Peer.offered = []
    store = TieredStore([HostTier(32 << 20)])
    catalog = KeyCatalog(tmp_path / "keys.log")
    for i in range(N_BLOCKS):
        key = block_key(i)
        frame = make_frame(key, layers=2, segment_bytes=256)
        assert store.put(key, frame)
        catalog.add(((key, len(frame)),))
    with ThreadPoolExecutor(1) as executor:
        yield Rereplicator("me", store, catalog, lambda: _MEMBERS, replicas=2, grace=0.1,
                           executor=executor, peer_token=None, tls=None)
    store.close()


# Two nodes and R = 2: the peer ranks in every block's top two.
_MEMBERS = {"me": DaemonInfo("me", "127.0.0.1:1"), "peer": DaemonInfo("peer", "127.0.0.1:2")}


def test_a_peer_that_admits_every_copy_completes_the_pass(rereplicator: Rereplicator) -> None:
    _Peer.admit = staticmethod(lambda _i: True)
    report = rereplicator.repair_pass(_MEMBERS)
    assert len(_Peer.offered) == N_BLOCKS
    assert report.blocks_pushed == N_BLOCKS and report.failed_peers == ()


def test_copies_a_peer_did_not_admit_leave_the_pass_not_done(
        rereplicator: Rereplicator) -> None:
    _Peer.admit = staticmethod(lambda i: i % 3 != 0)  # a third refused
    report = rereplicator.repair_pass(_MEMBERS)
    assert len(_Peer.offered) == N_BLOCKS  # every copy was still offered ...
    assert report.failed_peers == ("peer",)  # ... and the pass is not done: tried again


def test_passes_that_keep_failing_back_off(rereplicator: Rereplicator) -> None:
    """A peer that admits nothing: each pass fails, and the pause before the next one grows
    (grace x 0, 1, 3, 7, 15 ...). Without it, passes would come every grace (0.1 s here),
    some 20 in 2 s; a slower machine makes fewer passes, never more."""
    _Peer.admit = staticmethod(lambda _i: False)

    async def run_for(seconds: float) -> None:
        task = asyncio.create_task(rereplicator.run())
        await asyncio.sleep(seconds)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    asyncio.run(run_for(2.0))
    assert 2 <= rereplicator.passes <= 6, rereplicator.passes
    assert rereplicator.last_report is not None
    assert rereplicator.last_report.failed_peers == ("peer",)
