"""Re-replication: after membership changes, every block regains its R copies.

Each daemon knows the keys it holds (its `KeyCatalog`) and sees the live daemons (etcd). Once
membership has been stable for `grace` seconds and differs from what the last pass saw, a
daemon walks its keys: for each one it computes the R best live daemons by rendezvous hashing
and pushes its copy to those of them that lack it (one batched Lookup per peer per 1,000 keys,
then batched Puts). So when a node leaves for good, each of its blocks is copied from a surviving
replica to the node that now ranks in its top R; when a node joins, it receives the blocks it
now ranks for; a node that comes back within `grace` causes no traffic at all.

A pass is done when every push was admitted. A peer that failed (unreachable, or admitting
fewer copies than it was sent: full, or over a tenant's budget) makes another pass come after
`grace`, and passes that fail in a row pause longer and longer in between (up to 10 minutes;
a membership change ends the pause), so a full peer is not sent the same copies every `grace`.

Two survivors of one block may both push it to the same new owner; puts are idempotent, so the
cost is bandwidth, never a wrong block. Pushes go through the same verified Put path as client
writes, so the receiver checks every frame.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from kvstore.cluster.discovery import DaemonInfo
from kvstore.daemon.catalog import KeyCatalog
from kvstore.daemon.core import store_contains
from kvstore.daemon.metrics import RepairState
from kvstore.errors import KVKeepError
from kvstore.keys import BlockKey
from kvstore.net.daemon_client import ClientTLS, DaemonClient
from kvstore.net.limits import CHUNK_BYTES
from kvstore.net.scope import Scope, scope_of
from kvstore.store import TieredStore
from kvstore.tiers.remote.placement import place

__all__ = ["Rereplicator", "RepairReport"]

_log = logging.getLogger(__name__)
_LOOKUP_BATCH = 1000
_PUT_BATCH_BYTES = 4 * CHUNK_BYTES
_MAX_RETRY_PAUSE_S = 600.0


@dataclass(frozen=True, slots=True)
class RepairReport:
    keys_checked: int
    blocks_pushed: int
    failed_peers: tuple[str, ...]
    seconds: float


class Rereplicator:
    """Runs repair passes when membership settles (see the module docstring)."""

    def __init__(self, node_id: str, store: TieredStore, catalog: KeyCatalog,
                 members: Callable[[], Mapping[str, DaemonInfo]], *, replicas: int,
                 grace: float, executor: ThreadPoolExecutor, peer_token: str | None,
                 tls: ClientTLS | None, call_timeout: float = 30.0,
                 on_pushed: Callable[[int], None] | None = None) -> None:
        self._node_id = node_id
        self._store = store
        self._catalog = catalog
        self._members = members
        self._replicas = replicas
        self._grace = grace
        self._executor = executor
        self._token = peer_token
        self._tls = tls
        self._timeout = call_timeout
        self._on_pushed = on_pushed
        self._changed = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self.last_report: RepairReport | None = None
        self.passes = 0
        # When membership first changed since the last complete pass (monotonic), or None:
        # how long blocks may have had fewer than R copies (the metrics' replication lag).
        self._pending_since: float | None = time.monotonic()

    def membership_changed(self, _members: Mapping[str, DaemonInfo] | None = None) -> None:
        """A listener for the membership watcher; safe to call from any thread."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._mark_changed)

    def state(self) -> RepairState:
        """Where re-replication stands (for the daemon's metrics)."""
        since, report = self._pending_since, self.last_report
        return RepairState(
            passes=self.passes,
            pending_seconds=0.0 if since is None else time.monotonic() - since,
            last_pass_seconds=report.seconds if report else 0.0,
            blocks_checked=report.keys_checked if report else 0,
            peers=tuple(sorted(n for n in self._members() if n != self._node_id)),
            failed_peers=report.failed_peers if report else ())

    def _mark_changed(self) -> None:
        if self._pending_since is None:
            self._pending_since = time.monotonic()
        self._changed.set()

    async def run(self) -> None:
        """Forever: wait for membership to settle, repair if it differs from the last pass."""
        self._loop = asyncio.get_running_loop()
        seen: frozenset[tuple[str, str]] | None = None
        failures = 0  # passes in a row with a failed peer
        self._changed.set()  # the first pass (after start-up) repairs what changed while down
        while True:
            await self._changed.wait()
            # Debounce: wait until nothing changed for `grace` seconds.
            while True:
                self._changed.clear()
                try:
                    # asyncio.timeout, not wait_for: see kvstore/daemon/registration.py.
                    async with asyncio.timeout(self._grace):
                        await self._changed.wait()
                except TimeoutError:
                    break
            members = dict(self._members())
            snapshot = frozenset((n, i.address) for n, i in members.items())
            if snapshot == seen:
                self._pending_since = None  # back to what the last complete pass saw
                continue
            if self._node_id not in members:
                continue
            report = await asyncio.get_running_loop().run_in_executor(
                self._executor, self.repair_pass, members)
            self.last_report = report
            self.passes += 1
            _log.info("repair pass: %s", report)
            # A peer that failed keeps the pass "not done": try again after another grace,
            # and after a growing pause once passes fail in a row.
            seen = snapshot if not report.failed_peers else None
            if report.failed_peers:
                failures += 1
                await self._pause_before_retry(failures)
                self._changed.set()
            else:
                failures = 0
                if not self._changed.is_set():
                    self._pending_since = None

    async def _pause_before_retry(self, failures: int) -> None:
        """After the `failures`-th pass in a row with a failed peer: wait `grace` x
        (2^(failures-1) - 1), at most `_MAX_RETRY_PAUSE_S`, before the next pass's own grace.
        A peer that stays down or full (it admits no copies) is then not sent the same copies
        every `grace`; a membership change ends the pause early."""
        pause = min(self._grace * (2 ** min(failures - 1, 16) - 1), _MAX_RETRY_PAUSE_S)
        if pause <= 0:
            return
        try:
            async with asyncio.timeout(pause):
                await self._changed.wait()
        except TimeoutError:
            pass

    def repair_pass(self, members: Mapping[str, DaemonInfo]) -> RepairReport:
        """Push every locally held block to the top-R live daemons that lack it (blocking)."""
        start = time.monotonic()
        keys = self._catalog.keys()
        present = store_contains(self._store, keys) if keys else []
        held = [k for k, p in zip(keys, present, strict=True) if p]
        if len(held) != len(keys):
            self._catalog.retain(held)  # evicted since they were cataloged
        nodes = list(members)
        wanted: dict[str, list[BlockKey]] = defaultdict(list)
        for key in held:
            for node in place(key.digest, nodes, self._replicas):
                if node != self._node_id:
                    wanted[node].append(key)
        pushed = 0
        failed: list[str] = []
        for node, node_keys in wanted.items():
            client = DaemonClient(node, members[node].address, token=self._token, tls=self._tls,
                                  data_address=members[node].data_address or None)
            try:
                pushed += self._push_missing(client, node_keys)
            except KVKeepError as exc:
                _log.warning("re-replication to %s failed: %s", node, exc)
                failed.append(node)
            finally:
                client.close()
        return RepairReport(len(held), pushed, tuple(failed), time.monotonic() - start)

    def _push_missing(self, client: DaemonClient, keys: list[BlockKey]) -> int:
        by_scope: dict[Scope, list[BlockKey]] = defaultdict(list)
        for key in keys:
            by_scope[scope_of(key)].append(key)
        pushed = offered = 0
        for scope, scoped in by_scope.items():
            for i in range(0, len(scoped), _LOOKUP_BATCH):
                batch = scoped[i:i + _LOOKUP_BATCH]
                has = client.lookup(scope, [k.block_hash for k in batch], timeout=self._timeout)
                missing = [k for k, h in zip(batch, has, strict=True) if not h]
                batch_pushed, batch_offered = self._push(client, scope, missing)
                pushed += batch_pushed
                offered += batch_offered
        if pushed < offered:
            # Copies the peer did not admit (full, or over a tenant's budget) still lack their
            # R-th copy: the pass is not done, and the peer is tried again after `grace`.
            raise KVKeepError(f"{client.node_id} admitted {pushed} of {offered} copies")
        return pushed

    def _push(self, client: DaemonClient, scope: Scope, keys: list[BlockKey]
              ) -> tuple[int, int]:
        """Push the copies of `keys` this node can read: (admitted, offered)."""
        pushed = offered = 0
        batch: list[tuple[bytes, bytes]] = []
        size = 0
        for key in keys:
            try:
                read = self._store.get(key)
                if read is None:
                    continue
                read.verify()
                read.verify_key(key.digest)
            except KVKeepError as exc:  # evicted, corrupt or unreadable here: another copy
                _log.info("not re-replicating %s: %s", key.storage_name, exc)
                continue
            frame = read.to_frame()
            offered += 1
            batch.append((key.block_hash, frame))
            size += len(frame)
            if size >= _PUT_BATCH_BYTES:
                pushed += self._put(client, scope, batch)
                batch, size = [], 0
        if batch:
            pushed += self._put(client, scope, batch)
        return pushed, offered

    def _put(self, client: DaemonClient, scope: Scope, batch: list[tuple[bytes, bytes]]
             ) -> int:
        """One put of pushed copies, counted as soon as it returns (not at the end of a pass
        that may take minutes: the repaired-blocks figure follows the repair as it goes)."""
        stored = sum(client.put(scope, batch, timeout=self._timeout))
        if stored and self._on_pushed is not None:
            self._on_pushed(stored)
        return stored
