"""One kvstore daemon: the store, the core over it (kvstore/daemon/core.py) with its two fronts,
gRPC (grpc_front.py) and the TCP data plane (tcp_front.py), etcd registration,
re-replication, draining.

Lifecycle: open the store (the nvme tier rebuilds its index from disk, so a restarted daemon
serves what it held) and the key catalog, bind, report SERVING, register in etcd, and start the
repair loop. On SIGTERM or SIGINT it drains: health NOT_SERVING, revoke the etcd lease (clients
stop placing blocks here at once), refuse new puts, give in-flight streams `drain_timeout`
seconds to finish, flush the write-behind queue to disk and close.
"""

from __future__ import annotations

import asyncio
import faulthandler
import logging
import resource
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc  # type: ignore[import-untyped, unused-ignore]

from kvstore.cluster.daemon_trust import DaemonTrust, RegistrationSigner
from kvstore.cluster.discovery import DaemonInfo, MembershipWatcher
from kvstore.daemon.auth import TokenTable
from kvstore.daemon.catalog import KeyCatalog
from kvstore.daemon.config import DaemonConfig
from kvstore.daemon.core import BlockServiceCore, store_contains
from kvstore.daemon.grpc_front import GrpcFront
from kvstore.daemon.grpc_health import HealthService
from kvstore.daemon.grpc_metrics import RpcMetricsInterceptor
from kvstore.daemon.metrics import DaemonCollector, DaemonMetrics, DaemonState
from kvstore.daemon.metrics_http import MetricsEndpoint
from kvstore.daemon.registration import Registrar
from kvstore.daemon.replication import Rereplicator
from kvstore.daemon.tcp_front import TcpFront
from kvstore.errors import ConfigError, KVKeepError
from kvstore.etcd import etcd_spec
from kvstore.keys import BlockKey
from kvstore.metrics import StoreMetrics
from kvstore.net.daemon_client import ClientTLS
from kvstore.net.grpc_options import server_options
from kvstore.store import StoreConfig, TieredStore
from kvstore.tiers.factory import HostSpec, NvmeSpec, TierSpec

__all__ = ["Daemon", "run_daemon"]

_log = logging.getLogger("kvkeep.daemon")
_CATALOG_BATCH = 4096


def _read(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {path}: {exc}") from exc


def open_daemon_store(config: DaemonConfig, metrics: StoreMetrics | None = None
                      ) -> TieredStore:
    """The store a daemon serves: a RAM tier over an nvme tier in the data dir."""
    # Every frame reaches the nvme tier already verified: on receipt (BlockServiceCore's put
    # commit) and again when the write-behind reads it back from the host tier, so
    # the nvme tier's own check on put would hash each block a third time. Its reads verify.
    specs: list[TierSpec] = [
        HostSpec(config.mem_budget, name="host", prefault=config.mem_prefault),
        NvmeSpec(str(config.data_dir / "blocks"), config.disk_budget, name="nvme",
                 verify_on_put=False, durable=config.disk_fsync)]
    # A daemon serves remote readers whose own deadlines bound each call; the store's deadline
    # only has to stop a stuck disk read, and its write-behind queue is deep because puts wait
    # on it (back-pressure) rather than dropping background writes. The writer runs at a lower
    # CPU priority so that, on a busy node, persisting blocks does not slow the puts and gets
    # being served (the write-behind never delays an ack unless the back-pressure mark is hit).
    store = TieredStore.from_specs(specs, config=StoreConfig(
        get_deadline_s=10.0, write_queue_depth=config.write_queue_depth, write_batch=16,
        writer_nice=10, writer_quiet_s=config.writer_quiet,
        writer_defer_max_s=config.writer_defer_max), metrics=metrics)
    for tier in store.tiers:  # one tenant's manifests cannot evict everyone's (M7)
        limit = getattr(tier, "limit_manifests_per_tenant", None)
        if callable(limit):
            limit(config.tenant_manifest_share)
    return store


def raise_fd_limit(want: int = 1 << 20) -> int:
    """Raise the soft limit on open files to the hard limit (at most `want`): connections
    that a default soft limit of 1024 lets exhaust the daemon's descriptors would make the disk
    tier's own opens fail with EMFILE, every tenant's puts and gets with it (M5). Returns the
    soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(hard, want)
    if soft == resource.RLIM_INFINITY or soft >= target:
        return int(soft)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError) as exc:
        _log.warning("cannot raise the open-file limit from %d to %d: %s", soft, target, exc)
        return int(soft)
    return target


class Daemon:
    """A running daemon; `start()`, then `wait_stopped()` or `stop()`."""

    def __init__(self, config: DaemonConfig) -> None:
        self.config = config
        self.tokens = TokenTable.load(config.token_file) if config.token_file else None
        self.peer_token = config.peer_token or self._first_peer_token(config)
        self.tls = (ClientTLS(config.tls_ca, config.tls_cert, config.tls_key,
                              config.tls_server_name)
                    if config.tls_ca is not None else None)
        self.signer = (None if config.registration_key is None
                       else RegistrationSigner.from_file(config.registration_key))
        # Re-replication sends the `*` token to peers: only to those that prove to be daemons.
        self.peer_trust = DaemonTrust.of(
            public_key_file=config.registration_public_keys, tls=self.tls is not None,
            extra_keys=() if self.signer is None else (self.signer.public_key,))
        self.executor = ThreadPoolExecutor(config.workers, thread_name_prefix="kvkeep-io")
        self.port = 0
        self._stopped = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._server: Any = None
        self.tcp_front: TcpFront | None = None
        self._registrar: Registrar | None = None
        self._membership: MembershipWatcher | None = None
        self.rereplicator: Rereplicator | None = None
        self.metrics = DaemonMetrics()
        self.metrics_endpoint: MetricsEndpoint | None = None
        config.data_dir.mkdir(parents=True, exist_ok=True)
        self.store = open_daemon_store(config, self.metrics.store)
        self.catalog = KeyCatalog(config.data_dir / "keys.log")
        self._prune_catalog()
        self.health = HealthService()
        self.core = BlockServiceCore(config.node_id, self.store, self.catalog,
                                     tokens=self.tokens, limits=config.limits(),
                                     max_pending_writes=config.max_pending_writes,
                                     max_pending_bytes=config.max_pending_bytes,
                                     backpressure_timeout=config.backpressure_timeout)
        self.grpc_front = GrpcFront(self.core, self.executor)
        self.metrics.registry.register(DaemonCollector(config.node_id, self.metrics_state))

    async def start(self) -> None:
        cfg = self.config
        fds = raise_fd_limit()
        # Calls per HTTP/2 connection, and in all (M5): past them a client's new streams wait
        # (HTTP/2 flow control) or are refused RESOURCE_EXHAUSTED, instead of each stream
        # costing the daemon a handler and its buffers without bound.
        self._server = grpc.aio.server(options=[*server_options(
            cfg.keepalive, idle_timeout_s=cfg.idle_timeout,
            handshake_timeout_s=cfg.preauth_timeout),
            ("grpc.max_concurrent_streams", cfg.grpc_max_streams)],
            maximum_concurrent_rpcs=4 * cfg.grpc_max_streams,
            interceptors=[RpcMetricsInterceptor(self.metrics)])
        _log.info("open-file limit %d; gRPC: %d calls per connection, %d in all", fds,
                  cfg.grpc_max_streams, 4 * cfg.grpc_max_streams)
        self._server.add_generic_rpc_handlers((self.grpc_front.generic_handler(),
                                               self.health.generic_handler()))
        if cfg.tls_enabled:
            assert cfg.tls_cert is not None and cfg.tls_key is not None
            creds = grpc.ssl_server_credentials(
                [(_read(cfg.tls_key, "TLS key"), _read(cfg.tls_cert, "TLS certificate"))],
                root_certificates=_read(cfg.tls_ca, "TLS CA") if cfg.tls_ca else None,
                require_client_auth=cfg.tls_ca is not None)
            self.port = self._server.add_secure_port(cfg.listen, creds)
        else:
            self.port = self._server.add_insecure_port(cfg.listen)
        if not self.port:
            raise ConfigError(f"cannot listen on {cfg.listen}")
        data_address = ""
        bind = cfg.data_bind()
        if bind is not None:
            self.tcp_front = TcpFront(self.core, *bind, idle_timeout=cfg.idle_timeout,
                                      preauth_timeout=cfg.preauth_timeout,
                                      max_unauthenticated=cfg.max_unauth_connections,
                                      max_per_address=cfg.max_connections_per_ip,
                                      rpc_metrics=self.metrics)
            try:
                port = self.tcp_front.start()
            except OSError as exc:
                raise ConfigError(f"cannot listen on {bind[0]}:{bind[1]} (data plane): {exc}"
                                  ) from exc
            self.core.data_port = port
            data_address = cfg.advertised_data_address(port)
        self._start_metrics()
        await self._server.start()
        await self.health.set_serving(True)
        info = DaemonInfo(cfg.node_id, cfg.advertised_address(self.port), time.time(),
                          data_address)
        security = ("auth: bearer tokens" if cfg.auth_enabled else
                    "auth: OFF, loopback only (give --token-file to serve a network)")
        _log.info("kvkeep store daemon %s serving %s (%d blocks on disk; %s; tls: %s; "
                  "data plane: %s)", cfg.node_id, info.address, len(self.catalog), security,
                  "mTLS" if cfg.tls_ca else "on" if cfg.tls_enabled else "off",
                  data_address or ("off (TLS)" if cfg.tls_enabled else "off"))
        self._tasks.append(asyncio.create_task(self._prune_loop(), name="catalog-prune"))
        if cfg.etcd:
            self._registrar = Registrar(cfg.etcd, info, prefix=cfg.etcd_prefix, ttl=cfg.lease_ttl,
                                        signer=self.signer)
            self._tasks.append(asyncio.create_task(self._registrar.run(), name="registrar"))
            ignored = self.metrics.etcd_records_ignored
            self._membership = MembershipWatcher(
                cfg.etcd, cfg.etcd_prefix, trust=self.peer_trust,
                on_reject=lambda reason: ignored.labels(reason).inc())
            _log.info("etcd %s; registration %s; peers proven by %s",
                      etcd_spec(cfg.etcd).describe(),
                      "signed" if self.signer else "unsigned", self.peer_trust.describe())
            if cfg.auth_enabled and self.peer_token is None:
                _log.warning("no all-tenant (*) token in the token file: re-replication to "
                             "peers is disabled")
            else:
                self.rereplicator = Rereplicator(
                    cfg.node_id, self.store, self.catalog, self._membership.members,
                    replicas=cfg.replicas, grace=cfg.rereplicate_after, executor=self.executor,
                    peer_token=self.peer_token, tls=self.tls, on_pushed=self._count_repaired)
                self._membership.subscribe(self.rereplicator.membership_changed)
                self._tasks.append(asyncio.create_task(self.rereplicator.run(),
                                                       name="rereplicator"))
            self._tasks.append(asyncio.create_task(self._membership.run(), name="membership"))
        else:
            _log.info("no --etcd: not registering; clients must be given this address")

    async def stop(self) -> None:
        """Drain and shut down (idempotent)."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        cfg = self.config
        _log.info("draining %s: refusing new puts, finishing streams (up to %.0fs)",
                  cfg.node_id, cfg.drain_timeout)
        await self.health.set_serving(False)
        self.core.start_draining()
        if self._registrar is not None:
            await self._registrar.deregister()
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            # Bounded: a task that ignores its cancellation must not hold the drain hostage.
            _, stuck = await asyncio.wait(self._tasks, timeout=5.0)
            for task in stuck:
                _log.warning("task %s did not stop within 5s", task.get_name())
        loop = asyncio.get_running_loop()
        stopping = []
        if self.tcp_front is not None:
            stopping.append(loop.run_in_executor(None, self.tcp_front.stop, cfg.drain_timeout))
        if self._server is not None:
            stopping.append(self._server.stop(cfg.drain_timeout))
        await asyncio.gather(*stopping)
        await loop.run_in_executor(self.executor, self.store.close, 30.0)
        self.catalog.close()
        self.executor.shutdown(wait=True)
        if self.metrics_endpoint is not None:
            self.metrics_endpoint.stop()
        _log.info("daemon %s stopped", cfg.node_id)

    async def wait_stopped(self) -> None:
        await self._stopped.wait()

    def metrics_state(self) -> DaemonState:
        """What a scrape of `/metrics` reads (kvstore/daemon/metrics.py)."""
        status = self.core.status()
        return DaemonState(status.counters, status.tiers, status.pending_writes, status.draining,
                           len(self.catalog),
                           self.rereplicator.state() if self.rereplicator else None)

    # -- private ------------------------------------------------------------------------------

    def _start_metrics(self) -> None:
        cfg = self.config
        bind = cfg.metrics_bind()
        if bind is None:
            _log.info("metrics: off")
            return
        self.metrics_endpoint = MetricsEndpoint(self.metrics.registry, *bind,
                                                tls_cert=cfg.tls_cert, tls_key=cfg.tls_key)
        self.metrics_endpoint.start()
        _log.info("metrics on %s", self.metrics_endpoint.url)

    def _count_repaired(self, blocks: int) -> None:
        self.core.count(repaired_blocks=blocks)

    async def _prune_loop(self) -> None:
        """Now and then, drop catalog entries of blocks no tier holds. The catalog follows the
        disk tier's removals as they happen; this catches the rest (a block that stayed in RAM
        only, the disk being full when its copy was written behind, evicted from RAM since)."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.config.catalog_prune_s)
            await loop.run_in_executor(self.executor, self._prune_catalog)

    def _prune_catalog(self) -> None:
        """Drop catalog entries for blocks the store no longer holds (lost in a crash, evicted)."""
        keys = self.catalog.keys()
        held: list[BlockKey] = []
        for i in range(0, len(keys), _CATALOG_BATCH):
            batch = keys[i:i + _CATALOG_BATCH]
            held.extend(k for k, hit in zip(batch, store_contains(self.store, batch),
                                            strict=True) if hit)
        if len(held) != len(keys):
            _log.info("catalog: %d of %d keys no longer stored", len(keys) - len(held), len(keys))
            self.catalog.retain(held)

    @staticmethod
    def _first_peer_token(config: DaemonConfig) -> str | None:
        if config.token_file is None:
            return None
        for raw in _read(config.token_file, "token file").decode().splitlines():
            parts = raw.split("#", 1)[0].split()
            if len(parts) == 2 and "*" in parts[1].split(","):
                return parts[0]
        return None


async def _serve(config: DaemonConfig) -> None:
    daemon = Daemon(config)
    loop = asyncio.get_running_loop()
    stop_requested = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop_requested.set)
    try:
        await daemon.start()
        await stop_requested.wait()
    finally:
        await daemon.stop()


def run_daemon(config: DaemonConfig) -> int:
    """Run until SIGTERM/SIGINT; the exit code of `kvkeep store serve`."""
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # `kill -USR1 <pid>` dumps every thread's stack to stderr: how to see what a stuck drain
    # or a slow call is waiting on in production.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        asyncio.run(_serve(config))
    except ConfigError as exc:
        _log.error("%s", exc)
        return 2
    except KVKeepError as exc:  # e.g. the data dir is locked by another daemon
        _log.error("daemon failed: %s", exc)
        return 1
    return 0
