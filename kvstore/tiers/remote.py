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
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, ParamSpec, TypeVar

from kvstore.errors import (
    ConfigError,
    CorruptBlock,
    DeadlineExceeded,
    KVKeepError,
    TierUnavailable,
)
from kvstore.etcd import EtcdSpec
from kvstore.frame import BlockRead, LayerRange
from kvstore.keys import BlockKey, SessionKey
from kvstore.manifest import SessionManifest
from kvstore.net.daemon_client import ClientTLS, DaemonClient
from kvstore.net.scope import group_by_scope, scope_of
from kvstore.tiers.base import Buffer, TierStats
from kvstore.tiers.daemon_trust import DaemonTrust
from kvstore.tiers.discovery import (
    DEFAULT_PREFIX,
    DaemonInfo,
    Discovery,
    EtcdDiscovery,
    StaticDiscovery,
)
from kvstore.tiers.placement import rank, rank_many
from kvstore.tiers.resilience import CircuitBreaker, RetryPolicy

__all__ = ["RemoteConfig", "RemoteTier", "RemoteCounters", "WriteAck"]

_log = logging.getLogger(__name__)
T = TypeVar("T")
P = ParamSpec("P")
FrameBytes = bytes | bytearray | memoryview
WriteAck = Literal["one", "all"]


@dataclass(frozen=True, slots=True)
class RemoteConfig:
    """How the remote tier places, acknowledges, times out, retries and breaks.

    call_timeout: the most one call to one daemon may take (also the deadline when the caller
    gives none); lookup_timeout: the same for batched lookups, which must stay fast.
    extra_ranks: daemons beyond the R owners that reads and lookups also try.
    """

    replicas: int = 2
    write_ack: WriteAck = "all"
    call_timeout: float = 2.0
    lookup_timeout: float = 0.5
    extra_ranks: int = 1
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    breaker_failures: int = 1
    breaker_cooldown: float = 0.5
    breaker_max_cooldown: float = 10.0
    read_repair: bool = True
    token: str | None = None
    tls: ClientTLS | None = None
    registration_public_key: Path | None = None
    """Ed25519 public key(s) (PEM) the daemons sign their etcd registrations with: only
    registrations that verify are believed. Without it (and without `tls`) only loopback
    daemons are (kvstore/tiers/daemon_trust.py)."""
    name: str = "remote"
    fanout_threads: int = 16
    min_bandwidth: float = 200e6
    """Bytes/s a put may assume at worst: a batch's deadline is call_timeout + bytes / this."""
    data_plane: bool = True
    """Move single blocks over the daemons' bulk data plane when they have one
    (kvstore/net/tcp_protocol.py); False keeps block bytes on gRPC too."""

    def __post_init__(self) -> None:
        if self.replicas < 1 or self.extra_ranks < 0 or self.fanout_threads < 1:
            raise ConfigError("replicas >= 1, extra_ranks >= 0 and fanout_threads >= 1")
        if self.write_ack not in ("one", "all"):
            raise ConfigError(f"write_ack must be 'one' or 'all', not {self.write_ack!r}")
        if self.call_timeout <= 0 or self.lookup_timeout <= 0 or self.min_bandwidth <= 0:
            raise ConfigError("timeouts must be positive")


@dataclass(frozen=True, slots=True)
class RemoteCounters:
    hits: int
    misses: int
    puts: int
    rejected_puts: int
    corrupt: int
    errors: int
    repairs: int
    skipped_open_breaker: int


@dataclass(slots=True)
class _Peer:
    info: DaemonInfo
    client: DaemonClient
    breaker: CircuitBreaker


class RemoteTier:
    """Implements the `Tier` protocol over daemons found by a `Discovery`. Thread-safe."""

    def __init__(self, discovery: Discovery, config: RemoteConfig | None = None, *,
                 own_discovery: bool = False) -> None:
        self._config = config or RemoteConfig()
        self._discovery = discovery
        self._own_discovery = own_discovery
        self._lock = threading.Lock()
        self._peers: dict[str, _Peer] = {}
        self._retired: list[DaemonClient] = []
        self._pool = ThreadPoolExecutor(self._config.fanout_threads,
                                        thread_name_prefix="kvkeep-remote")
        self._background: set[Future[None]] = set()
        self._counts: dict[str, int] = defaultdict(int)
        self._closed = False
        discovery.subscribe(self._on_members)

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
        with self._lock:
            return list(self._peers)

    def data_plane_addresses(self) -> dict[str, str | None]:
        """Per daemon, the bulk data plane address its blocks travel over (None: gRPC)."""
        with self._lock:
            peers = list(self._peers.items())
        return {node: peer.client.data_plane_address for node, peer in peers}

    def placement(self, key: BlockKey | SessionKey) -> list[str]:
        """The daemons a read of `key` tries, best first (owners, then `extra_ranks` more)."""
        return rank(key.digest, self.members())[: self._config.replicas + self._config.extra_ranks]

    def contains(self, keys: Sequence[BlockKey]) -> list[bool]:
        found = [False] * len(keys)
        if not keys:
            return found
        deadline = time.monotonic() + self._config.lookup_timeout
        nodes = self.members()
        depth = self._config.replicas + self._config.extra_ranks
        if len(nodes) == 1:
            # One daemon: one call for every key, no ranking and no list per key (a batched
            # lookup must not feed the garbage collector thousands of objects).
            (node,) = nodes
            if not self._usable(node):
                return found
            result = self._capture(self._lookup_call(node, list(keys), deadline))
            return result if isinstance(result, list) else found
        candidates = rank_many([k.digest for k in keys], nodes, depth)
        tried = [0] * len(keys)
        pending: Sequence[int] = range(len(keys))
        while True:
            # One round: every unresolved key asks its next usable candidate; batched per node.
            usable = {n: self._usable(n) for n in nodes}
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
            calls = {node: self._lookup_call(node, [keys[i] for i in idx], deadline)
                     for node, idx in asks.items()}
            for node, result in self._fanout(calls).items():
                if isinstance(result, list):
                    for i, hit in zip(asks[node], result, strict=True):
                        if hit:
                            found[i] = True
            pending = [i for i in pending if not found[i] and tried[i] < len(candidates[i])]

    def get(self, key: BlockKey, layers: LayerRange | None = None, *,
            out: Buffer | None = None, deadline: float | None = None) -> BlockRead | None:
        deadline = self._deadline(deadline)
        scope = scope_of(key)
        lacking: list[str] = []
        corrupt: list[str] = []
        for node in self.placement(key):
            peer = self._peer(node)
            if peer is None or not self._allow(peer):
                continue
            timeout = self._timeout(deadline, self._config.call_timeout)
            try:
                read = peer.client.get(scope, key.block_hash, layers, out=out, timeout=timeout)
            except (TierUnavailable, DeadlineExceeded) as exc:
                self._failed(peer, exc)
                continue
            except KVKeepError as exc:  # a refusal (auth, bad range) is not a sick daemon
                peer.breaker.record_success()
                self._count("errors")
                _log.warning("get of %s from %s refused: %s", key.storage_name, node, exc)
                continue
            peer.breaker.record_success()
            if read is None:
                lacking.append(node)
                continue
            try:
                read = read.verified_for(key.digest)  # marked: the store does not hash it again
            except CorruptBlock as exc:
                self._count("corrupt")
                _log.warning("corrupt copy of %s on %s: %s", key.storage_name, node, exc)
                corrupt.append(node)
                continue
            self._count("hits")
            if self._config.read_repair and (lacking or corrupt):
                self._schedule_repair(key, node, lacking, corrupt)
            return read
        if time.monotonic() >= deadline:
            self._count("misses")
            raise DeadlineExceeded(f"remote get of {key.storage_name} ran past its deadline")
        self._count("misses")
        return None

    def put(self, key: BlockKey, frame: FrameBytes) -> bool:
        return self.put_many([(key, frame)])[0]

    def put_many(self, items: Sequence[tuple[BlockKey, FrameBytes]]) -> list[bool]:
        """Store blocks on their R owners; batched per daemon (one stream each), in parallel."""
        needed = self._config.replicas if self._config.write_ack == "all" else 1
        return self._put_blocks(items, needed, None)

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
        return self._put_blocks(items, copies, deadline)

    def count_copies(self, keys: Sequence[BlockKey], *, deadline: float) -> list[int]:
        """How many distinct daemons hold each key, among those a read would try (the R owners
        and `extra_ranks` more): one batched lookup per daemon, in parallel. A daemon that does
        not answer holds nothing here."""
        counts = [0] * len(keys)
        nodes = self.members()
        if not keys or not nodes:
            return counts
        depth = self._config.replicas + self._config.extra_ranks
        asks: dict[str, list[int]] = defaultdict(list)
        for i, ranking in enumerate(rank_many([k.digest for k in keys], nodes, depth)):
            for node in ranking:
                if self._usable(node):
                    asks[node].append(i)
        deadline = min(deadline, time.monotonic() + self._config.lookup_timeout)
        calls = {node: self._lookup_call(node, [keys[i] for i in idx], deadline)
                 for node, idx in asks.items()}
        for node, result in self._fanout(calls).items():
            if isinstance(result, list):
                for i, hit in zip(asks[node], result, strict=True):
                    counts[i] += int(hit)
        return counts

    def _put_blocks(self, items: Sequence[tuple[BlockKey, FrameBytes]], sync_needed: int,
                    deadline: float | None) -> list[bool]:
        """Each block to its owners in rank order until `sync_needed` acknowledged it; the rest
        of its R copies in the background."""
        if not items:
            return []
        # A batch may carry GiBs: its deadline grows with its size at a pessimistic bandwidth.
        total = sum(len(frame) for _, frame in items)
        sized = time.monotonic() + self._config.call_timeout + total / self._config.min_bandwidth
        deadline = sized if deadline is None else min(deadline, sized)
        replicas = self._config.replicas
        nodes = self.members()
        rankings = rank_many([key.digest for key, _ in items], nodes)
        acks = [0] * len(items)
        cursor = [0] * len(items)
        background: dict[str, list[int]] = defaultdict(list)
        placed = [0] * len(items)
        while True:
            # Assign each unfinished block to its next usable daemons in rank order.
            wave: dict[str, list[int]] = defaultdict(list)
            for i, ranking in enumerate(rankings):
                want = sync_needed - acks[i]
                while want > 0 and cursor[i] < len(ranking) and placed[i] < replicas:
                    node = ranking[cursor[i]]
                    cursor[i] += 1
                    if self._usable(node):
                        wave[node].append(i)
                        placed[i] += 1
                        want -= 1
            if not wave:
                break
            calls = {node: self._put_call(node, [items[i] for i in idx], deadline)
                     for node, idx in wave.items()}
            for node, result in self._fanout(calls).items():
                idx = wave[node]
                if isinstance(result, list):
                    for i, ok in zip(idx, result, strict=True):
                        acks[i] += int(ok)
                        placed[i] -= int(not ok)  # not admitted there: the next in rank
                else:
                    for i in idx:
                        placed[i] -= 1  # that copy failed: let the next in rank take it
            if time.monotonic() >= deadline:
                break
        if sync_needed < replicas:
            for i, ranking in enumerate(rankings):
                extra = replicas - placed[i]
                while acks[i] and extra > 0 and cursor[i] < len(ranking):
                    node = ranking[cursor[i]]
                    cursor[i] += 1
                    if self._usable(node):
                        background[node].append(i)
                        extra -= 1
            for node, idx in background.items():
                # Copies, since the caller may reuse its buffers as soon as we return.
                batch = [(items[i][0], bytes(items[i][1])) for i in idx]
                self._submit(self._background_put, node, batch)
        results = [a >= sync_needed for a in acks]
        for ok in results:
            self._count("puts" if ok else "rejected_puts")
        return results

    def delete(self, keys: Sequence[BlockKey]) -> int:
        """Remove from every daemon that may hold the keys; how many were present anywhere."""
        if not keys:
            return 0
        present = self.contains(keys)
        deadline = time.monotonic() + self._config.call_timeout
        targets: dict[str, list[BlockKey]] = defaultdict(list)
        for key in keys:
            for node in self.placement(key):
                targets[node].append(key)
        calls = {node: self._delete_call(node, ks, deadline) for node, ks in targets.items()
                 if self._usable(node)}
        self._fanout(calls)
        return sum(present)

    def put_manifest(self, manifest: SessionManifest) -> None:
        """Write to the R owners of the session; raises TierUnavailable if none took it."""
        deadline = time.monotonic() + self._config.call_timeout
        owners = [n for n in self.placement(manifest.key) if self._usable(n)]
        calls = {node: self._manifest_put_call(node, manifest, deadline)
                 for node in owners[: self._config.replicas]}
        results = self._fanout(calls)
        if not any(r is True for r in results.values()):
            raise TierUnavailable(f"no daemon stored manifest {manifest.key.storage_name}")

    def get_manifest(self, key: SessionKey) -> SessionManifest | None:
        """The highest generation among the owners; owners that lag are repaired."""
        deadline = time.monotonic() + self._config.call_timeout
        calls = {node: self._manifest_get_call(node, key, deadline)
                 for node in self.placement(key) if self._usable(node)}
        results = self._fanout(calls)
        found = {n: r for n, r in results.items() if isinstance(r, SessionManifest)}
        if not found:
            return None
        best = max(found.values(), key=lambda m: m.generation)
        lagging = [n for n, r in results.items()
                   if r is None or (isinstance(r, SessionManifest)
                                    and r.generation < best.generation)]
        for node in lagging[: self._config.replicas]:
            self._submit(self._background_manifest, node, best)
        return best

    def delete_manifest(self, key: SessionKey) -> bool:
        deadline = time.monotonic() + self._config.call_timeout
        calls = {node: self._manifest_delete_call(node, key, deadline)
                 for node in self.placement(key) if self._usable(node)}
        return any(r is True for r in self._fanout(calls).values())

    def stats(self) -> TierStats:
        c = self.counters()
        return TierStats(self.name, 0, 0, 0, hits=c.hits, misses=c.misses, puts=c.puts,
                         rejected_puts=c.rejected_puts, corrupt=c.corrupt, errors=c.errors)

    def counters(self) -> RemoteCounters:
        with self._lock:
            c = dict(self._counts)
        return RemoteCounters(c.get("hits", 0), c.get("misses", 0), c.get("puts", 0),
                              c.get("rejected_puts", 0), c.get("corrupt", 0), c.get("errors", 0),
                              c.get("repairs", 0), c.get("skipped", 0))

    def breaker_states(self) -> dict[str, str]:
        """Per registered daemon, its circuit breaker's state: closed, open or half_open."""
        with self._lock:
            peers = list(self._peers.items())
        return {node: peer.breaker.state for node, peer in peers}

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for background writes (ack=one copies, read repairs); False on timeout."""
        end = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                pending = list(self._background)
            if not pending:
                return True
            for fut in pending:
                remaining = None if end is None else max(end - time.monotonic(), 0.0)
                try:
                    fut.result(remaining)
                except TimeoutError:
                    return False
                except Exception:  # logged by the job itself
                    pass

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.flush(5.0)
        if self._own_discovery:
            self._discovery.close()
        self._pool.shutdown(wait=True)
        with self._lock:
            peers, self._peers = list(self._peers.values()), {}
            retired, self._retired = self._retired, []
        for peer in peers:
            peer.client.close()
        for client in retired:
            client.close()

    # -- membership ---------------------------------------------------------------------------

    def _on_members(self, members: Mapping[str, DaemonInfo]) -> None:
        cfg = self._config
        with self._lock:
            if self._closed:
                return
            for node in list(self._peers):
                peer = self._peers[node]
                if node not in members or members[node].address != peer.info.address:
                    # Closed later: another thread may be mid-call on this channel.
                    self._retired.append(self._peers.pop(node).client)
                elif members[node].started_at != peer.info.started_at:
                    peer.info = members[node]
                    peer.breaker.reset()  # a restarted daemon deserves a fresh try
                    # ... and may listen on another data port.
                    peer.client.set_data_address(members[node].data_address or None)
            for node, info in members.items():
                if node not in self._peers:
                    self._peers[node] = _Peer(
                        info, DaemonClient(node, info.address, token=cfg.token, tls=cfg.tls,
                                           data_address=info.data_address or None,
                                           data_plane=cfg.data_plane),
                        CircuitBreaker(cfg.breaker_failures, cfg.breaker_cooldown,
                                       cfg.breaker_max_cooldown))
            retired = self._retired[:-16] if len(self._retired) > 16 else []
            self._retired = self._retired[len(retired):]
        for client in retired:
            client.close()

    def _peer(self, node: str) -> _Peer | None:
        with self._lock:
            return self._peers.get(node)

    def _usable(self, node: str) -> bool:
        """Registered and not behind an open breaker (does not consume a half-open probe)."""
        peer = self._peer(node)
        return peer is not None and peer.breaker.state != "open"

    def _allow(self, peer: _Peer) -> bool:
        if peer.breaker.allow():
            return True
        self._count("skipped")
        return False

    def _failed(self, peer: _Peer, exc: KVKeepError) -> None:
        peer.breaker.record_failure()
        self._count("errors")
        _log.info("daemon %s failed: %s", peer.info.node_id, exc)

    # -- calls (each returns a thunk for _fanout) --------------------------------------------

    def _lookup_call(self, node: str, keys: list[BlockKey], deadline: float
                     ) -> Callable[[], list[bool]]:
        def call() -> list[bool]:
            peer = self._checked_peer(node)
            hits = [False] * len(keys)
            for scope, idx in group_by_scope(keys).items():
                timeout = self._timeout(deadline, self._config.lookup_timeout)
                flags = self._guard(peer, peer.client.lookup, scope,
                                    [keys[i].block_hash for i in idx], timeout=timeout)
                for i, hit in zip(idx, flags, strict=True):
                    hits[i] = hit
            return hits
        return call

    def _put_call(self, node: str, items: list[tuple[BlockKey, FrameBytes]], deadline: float
                  ) -> Callable[[], list[bool]]:
        def call() -> list[bool]:
            peer = self._checked_peer(node)
            admitted = [False] * len(items)
            groups = group_by_scope([k for k, _ in items])
            for scope, idx in groups.items():
                batch = [(items[i][0].block_hash, items[i][1]) for i in idx]
                flags = self._with_retry(peer, deadline, peer.client.put, scope, batch)
                for i, ok in zip(idx, flags, strict=True):
                    admitted[i] = ok
            return admitted
        return call

    def _delete_call(self, node: str, keys: list[BlockKey], deadline: float
                     ) -> Callable[[], int]:
        def call() -> int:
            peer = self._checked_peer(node)
            total = 0
            for scope, idx in group_by_scope(keys).items():
                timeout = self._timeout(deadline, self._config.call_timeout)
                total += self._guard(peer, peer.client.delete, scope,
                                     [keys[i].block_hash for i in idx], timeout=timeout)
            return total
        return call

    def _manifest_put_call(self, node: str, manifest: SessionManifest, deadline: float
                           ) -> Callable[[], bool]:
        def call() -> bool:
            peer = self._checked_peer(node)
            self._with_retry(peer, deadline, peer.client.put_manifest, manifest)
            return True
        return call

    def _manifest_get_call(self, node: str, key: SessionKey, deadline: float
                           ) -> Callable[[], SessionManifest | None]:
        def call() -> SessionManifest | None:
            peer = self._checked_peer(node)
            timeout = self._timeout(deadline, self._config.call_timeout)
            try:
                return self._guard(peer, peer.client.get_manifest, key, timeout=timeout)
            except CorruptBlock:
                self._count("corrupt")
                return None
        return call

    def _manifest_delete_call(self, node: str, key: SessionKey, deadline: float
                              ) -> Callable[[], bool]:
        def call() -> bool:
            peer = self._checked_peer(node)
            timeout = self._timeout(deadline, self._config.call_timeout)
            return self._guard(peer, peer.client.delete_manifest, key, timeout=timeout)
        return call

    def _checked_peer(self, node: str) -> _Peer:
        peer = self._peer(node)
        if peer is None:
            raise TierUnavailable(f"daemon {node} left")
        if not self._allow(peer):
            raise TierUnavailable(f"daemon {node} is behind an open circuit breaker")
        return peer

    def _guard(self, peer: _Peer, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """One call; feeds the breaker (transport failures only) and translates nothing.
        A refusal (a full disk, a spent budget, a bad request) is an answer: the daemon is
        well, and a half-open breaker's probe must not stay pending on it."""
        try:
            result = fn(*args, **kwargs)
        except (TierUnavailable, DeadlineExceeded) as exc:
            self._failed(peer, exc)
            raise
        except KVKeepError:
            peer.breaker.record_success()
            raise
        peer.breaker.record_success()
        return result

    def _with_retry(self, peer: _Peer, deadline: float, fn: Callable[..., T], *args: object
                    ) -> T:
        """`fn(*args, timeout=...)`, retrying transient failures per the RetryPolicy within the
        deadline (which the caller sized to the work); the breaker hears only the outcome."""
        delays = self._config.retry.delays()
        while True:
            timeout = self._timeout(deadline, deadline - time.monotonic())
            try:
                result = fn(*args, timeout=timeout)
            except TierUnavailable as exc:
                delay = next(delays, None)
                if delay is None or not self._config.retry.sleep_within(delay, deadline):
                    self._failed(peer, exc)
                    raise
                continue
            except DeadlineExceeded as exc:
                self._failed(peer, exc)
                raise
            except KVKeepError:  # a refusal (TierFull: disk full, budget): not retried here
                peer.breaker.record_success()
                raise
            peer.breaker.record_success()
            return result

    def _fanout(self, calls: Mapping[str, Callable[[], T]]) -> dict[str, T | KVKeepError]:
        """Run one call per daemon in parallel; a failure becomes that daemon's result."""
        if not calls:
            return {}
        if len(calls) == 1:  # no thread hop for the common single-daemon case
            ((node, call),) = calls.items()
            return {node: self._capture(call)}
        futures = {node: self._pool.submit(self._capture, call) for node, call in calls.items()}
        return {node: fut.result() for node, fut in futures.items()}

    def _capture(self, call: Callable[[], T]) -> T | KVKeepError:
        try:
            return call()
        except KVKeepError as exc:
            return exc

    # -- background work ------------------------------------------------------------------------

    def _submit(self, fn: Callable[..., None], *args: object) -> None:
        with self._lock:
            if self._closed:
                return
            try:
                fut = self._pool.submit(self._run_background, fn, *args)
            except RuntimeError:  # pool shut down concurrently
                return
            self._background.add(fut)
        fut.add_done_callback(self._background_done)

    def _background_done(self, fut: Future[None]) -> None:
        with self._lock:
            self._background.discard(fut)

    @staticmethod
    def _run_background(fn: Callable[..., None], *args: object) -> None:
        try:
            fn(*args)
        except KVKeepError as exc:
            _log.info("background remote write failed: %s", exc)
        except Exception:
            _log.exception("background remote write crashed")

    def _background_put(self, node: str, batch: list[tuple[BlockKey, bytes]]) -> None:
        total = sum(len(frame) for _, frame in batch)
        deadline = time.monotonic() + self._config.call_timeout + total / self._config.min_bandwidth
        result = self._capture(self._put_call(node, list(batch), deadline))
        if isinstance(result, KVKeepError):
            raise result

    def _background_manifest(self, node: str, manifest: SessionManifest) -> None:
        deadline = time.monotonic() + self._config.call_timeout
        self._manifest_put_call(node, manifest, deadline)()

    def _schedule_repair(self, key: BlockKey, source: str, lacking: list[str],
                         corrupt: list[str]) -> None:
        owners = set(self.placement(key)[: self._config.replicas])
        targets = [n for n in lacking + corrupt if n in owners]
        if targets:
            self._submit(self._repair, key, source, targets, set(corrupt))

    def _repair(self, key: BlockKey, source: str, targets: list[str], corrupt: set[str]) -> None:
        """Copy the whole block from `source` to `targets` (deleting corrupt copies first)."""
        deadline = time.monotonic() + self._config.call_timeout
        peer = self._checked_peer(source)
        read = self._guard(peer, peer.client.get, scope_of(key), key.block_hash, None,
                           timeout=self._timeout(deadline, self._config.call_timeout))
        if read is None:
            return
        read.verify()
        read.verify_key(key.digest)
        frame = read.to_frame()
        scope = scope_of(key)
        for node in targets:
            target = self._checked_peer(node)
            if node in corrupt:
                self._guard(target, target.client.delete, scope, [key.block_hash],
                            timeout=self._timeout(deadline, self._config.call_timeout))
            stored = self._guard(target, target.client.put, scope, [(key.block_hash, frame)],
                                 timeout=self._timeout(deadline, self._config.call_timeout))
            if all(stored):
                self._count("repairs")

    # -- helpers ------------------------------------------------------------------------------

    def _deadline(self, deadline: float | None) -> float:
        return deadline if deadline is not None else time.monotonic() + self._config.call_timeout

    @staticmethod
    def _timeout(deadline: float, cap: float) -> float:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise DeadlineExceeded("remote call deadline passed")
        return min(remaining, cap)

    def _count(self, what: str, n: int = 1) -> None:
        with self._lock:
            self._counts[what] += n

