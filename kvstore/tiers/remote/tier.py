"""The `remote` tier: blocks on kvstore daemons across nodes, R copies each, behind the Tier API.

Placement is rendezvous hashing over the daemons registered in etcd (or a static list): every
client ranks the daemons for a key the same way, with no coordination and no directory.

- put: to the R best-ranked daemons that are not known to be down (a down one is replaced by the
  next in rank, so a block still gets R copies). `write_ack="all"` returns once every copy is
  stored; `"one"` returns after the first and writes the others in the background.
  `put_acknowledged` asks for a given number of acknowledgements per call (a durable put);
  `count_copies` counts the daemons holding each key (`SupportsReplicas`).
- get: tries daemons in rank order (the R owners, then `extra_ranks` more, which may hold blocks
  written while an owner was down). A daemon that fails, times out or returns a block that does
  not verify is skipped; the first good copy is returned and, in the background, copied to the
  owners that lacked it or held it corrupt (read repair).
- contains: one batched Lookup per daemon per rank round, in parallel.
- Every call has a deadline; each daemon has a circuit breaker, so a dead daemon costs at most one
  call timeout, after which it is skipped until a probe succeeds; if no daemon answers, the tier
  reports a miss. Transient failures of writes are retried per the `RetryPolicy` given.

Re-replication after a daemon leaves for good is done by the daemons themselves (see
kvstore/daemon/replication.py), not by every client of the cluster.

This module is the tier itself (reads, lookups, manifests, lifecycle); its parts:
config.py (settings, counters), peers.py (clients, breakers, retries, fan-out, background
jobs), calls.py (one call to one daemon), writes.py (replicated puts), repair.py (read repair);
placement.py ranks the daemons.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, defaultdict
from collections.abc import Mapping, Sequence

from kvstore.cluster.daemon_trust import DaemonTrust
from kvstore.cluster.discovery import (
    DEFAULT_PREFIX,
    DaemonInfo,
    Discovery,
    EtcdDiscovery,
    StaticDiscovery,
)
from kvstore.errors import (
    ConfigError,
    CorruptBlock,
    DeadlineExceeded,
    KVKeepError,
    TierUnavailable,
)
from kvstore.etcd import EtcdSpec
from kvstore.frame import BlockRead, FrameBytes, LayerRange
from kvstore.keys import BlockKey, SessionKey
from kvstore.manifest import SessionRecord
from kvstore.net.scope import scope_of
from kvstore.tiers.base import Buffer, TierStats
from kvstore.tiers.remote.calls import (
    delete_call,
    get_into_call,
    lookup_call,
    manifest_delete_call,
    manifest_get_call,
    manifest_put_call,
)
from kvstore.tiers.remote.config import RemoteConfig, RemoteCounters, WriteAck
from kvstore.tiers.remote.peers import PeerSet, call_timeout, capture
from kvstore.tiers.remote.placement import rank, rank_many
from kvstore.tiers.remote.repair import repair_block
from kvstore.tiers.remote.writes import put_blocks

__all__ = ["RemoteConfig", "RemoteTier", "RemoteCounters", "WriteAck"]

_log = logging.getLogger(__name__)


_SERVED_KEYS = 4096
"""Keys whose serving daemon a remote tier remembers (L2), most recent first."""
_SERVED_S = 60.0
"""How long a read's serving daemon is remembered for a delete that refuses its copy."""


class RemoteTier:
    """Implements the `Tier` protocol over daemons found by a `Discovery`. Thread-safe."""

    def __init__(self, discovery: Discovery, config: RemoteConfig | None = None, *,
                 own_discovery: bool = False) -> None:
        self._config = config or RemoteConfig()
        self._discovery = discovery
        self._own_discovery = own_discovery
        self._peers = PeerSet(self._config)
        discovery.subscribe(self._peers.on_members)
        # Which daemon served each key lately (L2): a delete that soon follows a read is the
        # reader refusing that copy (forged, not its engine's), so it goes to that daemon only.
        self._served: OrderedDict[bytes, tuple[str, float]] = OrderedDict()
        self._served_lock = threading.Lock()

    @classmethod
    def from_etcd(cls, etcd: EtcdSpec | str, config: RemoteConfig | None = None, *,
                  prefix: str = DEFAULT_PREFIX, wait_synced: float = 5.0) -> RemoteTier:
        """Daemons registered in etcd (`etcd`: URL(s), or a spec with TLS and credentials),
        believed only when they prove to be daemons (`config.tls`, signed registrations)."""
        config = config or RemoteConfig()
        trust = DaemonTrust.of(public_key_file=config.registration_public_key,
                               tls=config.tls is not None)
        return cls(EtcdDiscovery(etcd, prefix, trust=trust, wait_synced=wait_synced), config,
                   own_discovery=True)

    @classmethod
    def from_addresses(cls, addresses: Mapping[str, str], config: RemoteConfig | None = None
                       ) -> RemoteTier:
        """A fixed set of daemons, node id -> host:port."""
        return cls(StaticDiscovery([DaemonInfo(n, a) for n, a in addresses.items()]), config,
                   own_discovery=True)

    # -- the Tier protocol --------------------------------------------------------------------

    @property
    def name(self) -> str:
        return self._config.name

    @property
    def config(self) -> RemoteConfig:
        return self._config

    def members(self) -> list[str]:
        return self._peers.members()

    def data_plane_addresses(self) -> dict[str, str | None]:
        """Per daemon, the bulk data plane address its blocks travel over (None: gRPC)."""
        return {node: peer.client.data_plane_address for node, peer in self._peers.peers()}

    def choose_transports(self, timeout: float = 2.0) -> dict[str, str | None]:
        """Pick every known daemon's block transport now (one Stat call each, where its data
        plane address is not known yet) rather than on its first put or get, so that a client
        whose first calls are lookups (an LMCache instance after a restart) sends them over
        the data plane too. Unreachable daemons are left to choose later. Returns
        `data_plane_addresses()`."""
        deadline = time.monotonic() + timeout
        for node, peer in self._peers.peers():
            try:
                peer.client.block_transport(deadline)
            except KVKeepError as exc:
                _log.info("block transport of %s not chosen yet: %s", node, exc)
        return self.data_plane_addresses()

    def placement(self, key: BlockKey | SessionKey) -> list[str]:
        """The daemons a read of `key` tries, best first (owners, then `extra_ranks` more)."""
        return rank(key.digest, self.members())[: self._config.read_depth]

    def contains(self, keys: Sequence[BlockKey]) -> list[bool]:
        found = [False] * len(keys)
        if not keys:
            return found
        peers = self._peers
        deadline = time.monotonic() + self._config.lookup_timeout
        nodes = self.members()
        if len(nodes) == 1:
            # One daemon: one call for every key, no ranking and no list per key (a batched
            # lookup must not feed the garbage collector thousands of objects).
            (node,) = nodes
            if not peers.usable(node):
                return found
            result = capture(lookup_call(peers, node, list(keys), deadline))
            return result if isinstance(result, list) else found
        candidates = rank_many([k.digest for k in keys], nodes, self._config.read_depth)
        tried = [0] * len(keys)
        pending: Sequence[int] = range(len(keys))
        while True:
            # One round: every unresolved key asks its next usable candidate; batched per node.
            usable = {n: peers.usable(n) for n in nodes}
            asks: dict[str, list[int]] = defaultdict(list)
            for i in pending:
                cands = candidates[i]
                t = tried[i]
                while t < len(cands):
                    node = cands[t]
                    t += 1
                    if usable[node]:
                        asks[node].append(i)
                        break
                tried[i] = t
            if not asks or time.monotonic() >= deadline:
                return found
            calls = {node: lookup_call(peers, node, [keys[i] for i in idx], deadline)
                     for node, idx in asks.items()}
            for node, result in peers.fanout(calls).items():
                if isinstance(result, list):
                    for i, hit in zip(asks[node], result, strict=True):
                        if hit:
                            found[i] = True
            pending = [i for i in pending if not found[i] and tried[i] < len(candidates[i])]

    def get(self, key: BlockKey, layers: LayerRange | None = None, *,
            out: Buffer | None = None, deadline: float | None = None) -> BlockRead | None:
        peers = self._peers
        if deadline is None:
            deadline = time.monotonic() + self._config.call_timeout
        scope = scope_of(key)
        lacking: list[str] = []
        corrupt: list[str] = []
        placement = self.placement(key)
        for node in placement:
            peer = peers.peer(node)
            if peer is None or not peers.allow(peer):
                continue
            timeout = call_timeout(deadline, self._config.call_timeout)
            try:
                read = peer.client.get(scope, key.block_hash, layers, out=out, timeout=timeout)
            except (TierUnavailable, DeadlineExceeded) as exc:
                peers.failed(peer, exc)
                continue
            except KVKeepError as exc:  # a refusal (auth, bad range) is not a sick daemon
                peer.breaker.record_success()
                peers.count("errors")
                _log.warning("get of %s from %s refused: %s", key.storage_name, node, exc)
                continue
            peer.breaker.record_success()
            if read is None:
                lacking.append(node)
                continue
            try:
                read = read.verified_for(key.digest)  # marked: the store does not hash it again
            except CorruptBlock as exc:
                peers.count("corrupt")
                _log.warning("corrupt copy of %s on %s: %s", key.storage_name, node, exc)
                corrupt.append(node)
                continue
            peers.count("hits")
            self._note_served(key, node)
            if self._config.read_repair and (lacking or corrupt):
                repair_block(peers, placement[: self._config.replicas], key, node, lacking,
                             corrupt)
            return read
        peers.count("misses")
        if time.monotonic() >= deadline:
            raise DeadlineExceeded(f"remote get of {key.storage_name} ran past its deadline")
        return None

    def get_into(self, keys: Sequence[BlockKey], outs: Sequence[Buffer | None], *,
                 deadline: float | None = None) -> list[BlockRead | None]:
        """Verified whole blocks, each payload into its buffer where large enough; None per
        miss. Every key is asked of its best-ranked usable daemon, batched per daemon (one
        request per window of blocks, not per block; daemons in parallel); a key that daemon
        lacks, fails on or serves corrupt is then read alone by `get` (the other replicas, read
        repair), so the result is what `get` per key would give."""
        if len(keys) != len(outs):
            raise ValueError(f"{len(keys)} keys for {len(outs)} buffers")
        peers = self._peers
        if deadline is None:
            deadline = time.monotonic() + self._config.call_timeout
        reads: list[BlockRead | None] = [None] * len(keys)
        alone: list[int] = []
        by_node: dict[str, list[int]] = defaultdict(list)
        nodes = self.members()
        usable = {n: peers.usable(n) for n in nodes}
        ranked = ([nodes] * len(keys) if len(nodes) == 1 else
                  rank_many([k.digest for k in keys], nodes, self._config.read_depth))
        for i in range(len(keys)):
            first = next((n for n in ranked[i] if usable[n]), None)
            (alone if first is None else by_node[first]).append(i)
        calls = {node: get_into_call(peers, node, [keys[i] for i in idx],
                                     [outs[i] for i in idx], deadline)
                 for node, idx in by_node.items()}
        for node, got in peers.fanout(calls).items():
            idx = by_node[node]
            if isinstance(got, KVKeepError):  # a sick or refusing daemon: its keys read alone
                alone.extend(idx)
                continue
            for i, raw in zip(idx, got, strict=True):
                reads[i] = self._verified(raw, keys[i], node)
                if reads[i] is None:
                    alone.append(i)
        for i in sorted(alone):
            if time.monotonic() >= deadline:
                break
            try:
                reads[i] = self.get(keys[i], out=outs[i], deadline=deadline)
            except KVKeepError as exc:
                _log.info("get of %s failed: %s", keys[i].storage_name, exc)
        return reads

    def _verified(self, read: BlockRead | None, key: BlockKey, node: str) -> BlockRead | None:
        """A batched read of `key` from `node`, verified (and counted a hit), or None where the
        daemon lacked it or served it corrupt (then it is read alone)."""
        if read is None:
            return None
        try:
            read = read.verified_for(key.digest)
        except CorruptBlock as exc:
            self._peers.count("corrupt")
            _log.warning("corrupt copy of %s on %s: %s", key.storage_name, node, exc)
            return None
        self._peers.count("hits")
        self._note_served(key, node)
        return read

    def put(self, key: BlockKey, frame: FrameBytes) -> bool:
        return self.put_many([(key, frame)])[0]

    def put_many(self, items: Sequence[tuple[BlockKey, FrameBytes]]) -> list[bool]:
        """Store blocks on their R owners; batched per daemon (one stream each), in parallel."""
        needed = self._config.replicas if self._config.write_ack == "all" else 1
        return put_blocks(self._peers, items, needed, None)

    @property
    def replicas(self) -> int:
        return self._config.replicas

    def put_acknowledged(self, items: Sequence[tuple[BlockKey, FrameBytes]], *, copies: int,
                         deadline: float) -> list[bool]:
        """`put_many`, True for a block once `copies` distinct daemons acknowledged it (each
        has verified the frame and holds it in its RAM tier, its disk write queued), whatever
        `write_ack` says; the copies beyond `copies` (up to R) go on in the background."""
        if not 1 <= copies <= self._config.replicas:
            raise ConfigError(f"copies must be 1..{self._config.replicas}, not {copies}")
        return put_blocks(self._peers, items, copies, deadline)

    def count_copies(self, keys: Sequence[BlockKey], *, deadline: float) -> list[int]:
        """How many distinct daemons hold each key, among those a read would try (the R owners
        and `extra_ranks` more): one batched lookup per daemon, in parallel. A daemon that does
        not answer holds nothing here."""
        counts = [0] * len(keys)
        peers = self._peers
        nodes = self.members()
        if not keys or not nodes:
            return counts
        asks: dict[str, list[int]] = defaultdict(list)
        for i, ranking in enumerate(rank_many([k.digest for k in keys], nodes,
                                              self._config.read_depth)):
            for node in ranking:
                if peers.usable(node):
                    asks[node].append(i)
        deadline = min(deadline, time.monotonic() + self._config.lookup_timeout)
        calls = {node: lookup_call(peers, node, [keys[i] for i in idx], deadline)
                 for node, idx in asks.items()}
        for node, result in peers.fanout(calls).items():
            if isinstance(result, list):
                for i, hit in zip(asks[node], result, strict=True):
                    counts[i] += int(hit)
        return counts

    def _note_served(self, key: BlockKey, node: str) -> None:
        with self._served_lock:
            self._served[key.digest] = (node, time.monotonic())
            self._served.move_to_end(key.digest)
            while len(self._served) > _SERVED_KEYS:
                self._served.popitem(last=False)

    def _served_by(self, key: BlockKey) -> str | None:
        """The daemon that served `key` within `_SERVED_S`, forgotten once asked."""
        with self._served_lock:
            found = self._served.pop(key.digest, None)
        if found is None or time.monotonic() - found[1] > _SERVED_S:
            return None
        return found[0]

    def delete(self, keys: Sequence[BlockKey]) -> int:
        """Remove from every daemon that may hold the keys; how many were present anywhere."""
        return self._delete(keys, reject=False)

    def reject(self, keys: Sequence[BlockKey]) -> int:
        """A reader refused the copies of `keys` this tier served it (a forged frame, one of
        another engine): delete each at the daemon that served it within the last minute
        only (L2), so one bad or hostile daemon cannot turn that into the loss of the good
        copies on the others. The next read tries the next replica; a copy bad there too is
        refused, and deleted there, in turn. A key not served lately is deleted everywhere."""
        return self._delete(keys, reject=True)

    def _delete(self, keys: Sequence[BlockKey], *, reject: bool) -> int:
        if not keys:
            return 0
        present = self.contains(keys)
        deadline = time.monotonic() + self._config.call_timeout
        targets: dict[str, list[BlockKey]] = defaultdict(list)
        for key in keys:
            served = self._served_by(key) if reject else None
            if served is not None:
                _log.info("deleting the copy of %s that %s served, not its replicas",
                          key.storage_name, served)
                targets[served].append(key)
                continue
            for node in self.placement(key):
                targets[node].append(key)
        calls = {node: delete_call(self._peers, node, ks, deadline)
                 for node, ks in targets.items() if self._peers.usable(node)}
        self._peers.fanout(calls)
        return sum(present)

    def put_manifest(self, record: SessionRecord) -> None:
        """Write to the R owners of the session; raises TierUnavailable if none took it."""
        deadline = time.monotonic() + self._config.call_timeout
        owners = [n for n in self.placement(record.key) if self._peers.usable(n)]
        calls = {node: manifest_put_call(self._peers, node, record, deadline)
                 for node in owners[: self._config.replicas]}
        results = self._peers.fanout(calls)
        if not any(r is True for r in results.values()):
            raise TierUnavailable(f"no daemon stored the record of session "
                                  f"{record.key.storage_name}")

    def get_manifest(self, key: SessionKey) -> SessionRecord | None:
        """The highest generation among the daemons asked; the owners (the first R usable
        in placement order, where `put_manifest` writes) that lag are repaired before this
        returns. In the background instead, a repair could land after a `delete_manifest`
        that followed this read and bring the session's manifest back (seen in CI)."""
        deadline = time.monotonic() + self._config.call_timeout
        usable = [node for node in self.placement(key) if self._peers.usable(node)]
        calls = {node: manifest_get_call(self._peers, node, key, deadline) for node in usable}
        results = self._peers.fanout(calls)
        found = {n: r for n, r in results.items() if isinstance(r, SessionRecord)}
        if not found:
            return None
        best = max(found.values(), key=lambda m: m.generation)
        # Missing (None) or older; a daemon whose read failed is not written to.
        lagging = [n for n in usable[: self._config.replicas]
                   if (n in results and results[n] is None)
                   or (n in found and found[n].generation < best.generation)]
        if lagging:
            self._peers.fanout({node: manifest_put_call(self._peers, node, best, deadline)
                                for node in lagging})
        return best

    def delete_manifest(self, key: SessionKey) -> bool:
        deadline = time.monotonic() + self._config.call_timeout
        calls = {node: manifest_delete_call(self._peers, node, key, deadline)
                 for node in self.placement(key) if self._peers.usable(node)}
        return any(r is True for r in self._peers.fanout(calls).values())

    def stats(self) -> TierStats:
        c = self.counters()
        return TierStats(self.name, 0, 0, 0, hits=c.hits, misses=c.misses, puts=c.puts,
                         rejected_puts=c.rejected_puts, corrupt=c.corrupt, errors=c.errors)

    def counters(self) -> RemoteCounters:
        c = self._peers.counts()
        return RemoteCounters(c.get("hits", 0), c.get("misses", 0), c.get("puts", 0),
                              c.get("rejected_puts", 0), c.get("corrupt", 0), c.get("errors", 0),
                              c.get("repairs", 0), c.get("skipped", 0))

    def breaker_states(self) -> dict[str, str]:
        """Per registered daemon, its circuit breaker's state: closed, open or half_open."""
        return {node: peer.breaker.state for node, peer in self._peers.peers()}

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for background writes (ack=one copies, read repairs); False on timeout."""
        return self._peers.flush(timeout)

    def close(self) -> None:
        if not self._peers.mark_closed():
            return
        self._peers.flush(5.0)
        if self._own_discovery:
            self._discovery.close()
        self._peers.shutdown()
