"""The daemon's configuration: one frozen value built from the command line, checked up front."""

from __future__ import annotations

import argparse
import ipaddress
import re
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvstore.cluster.discovery import DEFAULT_PREFIX
from kvstore.daemon.budgets import DaemonLimits
from kvstore.errors import ConfigError
from kvstore.etcd import EtcdSpec
from kvstore.keys import validate_name
from kvstore.net.grpc_options import Keepalive

__all__ = ["DaemonConfig", "parse_size", "split_host_port", "is_loopback",
           "add_budget_arguments", "budget_options"]

_SIZE_RE = re.compile(r"(?i)\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*")
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str) -> int:
    """`512MiB`, `4G`, `1.5GiB`, `1048576` -> bytes (binary units either way)."""
    match = _SIZE_RE.fullmatch(text)
    if match is None:
        raise ConfigError(f"bad size {text!r}: use e.g. 512MiB, 4GiB or a byte count")
    value = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    if value <= 0:
        raise ConfigError(f"size {text!r} must be positive")
    return value


def split_host_port(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ConfigError(f"address {address!r} is not HOST:PORT")
    return host, int(port)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True, slots=True)
class DaemonConfig:
    """Everything `kvkeep store serve` needs.

    advertise: the host:port registered in etcd for clients to dial; defaults to `listen`
    (with a wildcard host replaced by this machine's hostname).
    peer_token: the token used to push blocks to peers during re-replication; defaults to the
    first all-tenant (`*`) token in the token file.
    data_listen: where the TCP data plane (kvstore/net/tcp_protocol.py) listens: "auto" (the host of
    `listen`, any free port), "off", or HOST:PORT. It is always off with TLS (it is plain TCP).
    metrics_listen: where `/metrics` is served (kvstore/daemon/metrics_http.py): "auto" (the
    host of `listen`, any free port), "off", or HOST:PORT; HTTPS when TLS is on.
    """

    listen: str
    data_dir: Path
    mem_budget: int
    disk_budget: int
    node_id: str
    mem_prefault: bool = False
    """Allocate and touch the RAM tier's whole budget at start-up instead of as blocks come."""
    disk_fsync: bool = True
    """fsync every block the write-behind puts on the nvme tier (False: page cache only; a
    torn block after a power loss fails its checksum and reads as a miss, never as wrong KV)."""
    etcd: EtcdSpec | str | None = None
    """etcd URL(s), or an `EtcdSpec` with TLS and credentials (kvstore/etcd/spec.py)."""
    advertise: str | None = None
    etcd_prefix: str = DEFAULT_PREFIX
    lease_ttl: int = 5
    token_file: Path | None = None
    peer_token: str | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_ca: Path | None = None
    tls_server_name: str | None = None
    """The name peer daemons' certificates carry, checked instead of their address (one
    certificate shared by every daemon); None: each certificate names its advertised host."""
    registration_key: Path | None = None
    """Ed25519 private key (PEM): sign the etcd registration, and believe only peers whose
    registrations verify with it (or with `registration_public_keys`)."""
    registration_public_keys: Path | None = None
    """More Ed25519 public keys (PEM) peers may sign with: a key rotation in progress."""
    replicas: int = 2
    rereplicate_after: float = 30.0
    drain_timeout: float = 15.0
    workers: int = 4
    data_listen: str = "auto"
    metrics_listen: str = "auto"
    keepalive: Keepalive = field(default_factory=Keepalive)
    """gRPC keepalive, shared with the clients' (kvstore/net/grpc_options.py); no flag: the
    defaults suit every deployment, tests shorten it."""
    tenant_put_share: float = 0.5
    """Of the in-flight put budget (half the RAM tier), what one tenant may hold."""
    tenant_put_streams: int = 16
    tenant_stored_share: float = 1.0
    """Of the disk tier, what one tenant's blocks may fill (its oldest go first past it)."""
    inflight_put_bytes: int | None = None
    """The daemon's in-flight put budget; None: half the RAM tier, in [64 MiB, 4 GiB]."""
    put_idle_timeout: float = 10.0
    """A put that goes this long without a byte arriving is dropped (its budget given back)."""
    idle_timeout: float = 120.0
    """An authenticated connection idle this long is closed (TCP data plane; gRPC: one without
    calls); clients reconnect on their next call."""
    preauth_timeout: float = 5.0
    """A data plane connection that has not authenticated a request this long after it
    opened, or after its last one, is dropped (slowloris); also gRPC's handshake timeout."""
    catalog_prune_s: float = 300.0
    backpressure_timeout: float = 30.0
    """How long a put's ack may wait for the disk to catch up; past it the put is refused
    (RESOURCE_EXHAUSTED), never acknowledged (M3)."""
    write_queue_depth: int = 1024
    """Write-behind jobs (host -> nvme) that may wait; a copy that finds it full is refused."""
    max_pending_writes: int = 64
    """The write-behind depth past which acks wait (back-pressure)."""
    tenant_read_streams: int = 32
    """Reads (gRPC Get calls, TCP GETs) one tenant may have in progress (M1)."""
    tenant_read_bytes: int | None = None
    """Bytes of blocks one tenant's reads may hold while they are sent; None: the tenant's
    in-flight put budget (M1)."""
    get_min_rate: float = 1e6
    """Bytes per second a TCP GET's reader must take; a GET gets 30 s plus size / this (M1)."""
    tenant_max_blocks: int | None = None
    """Blocks one tenant may store; None: its stored budget over the smallest block's cost
    (a file-system block plus the per-entry overhead, M4)."""
    tenant_manifest_share: float = 0.25
    """Of the manifest budget, what one tenant's session manifests may fill (M7)."""
    max_unauth_connections: int = 32
    """Data plane connections not yet authenticated, at once (M5)."""
    max_connections_per_ip: int = 128
    """Data plane connections from one source address, at once (M5)."""
    grpc_max_streams: int = 256
    """Concurrent gRPC calls per HTTP/2 connection, and (times 4) per daemon (M5)."""

    def __post_init__(self) -> None:
        validate_name(self.node_id, "node id")
        host, _ = split_host_port(self.listen)
        hosts = [host]
        for extra in (self.data_listen, self.metrics_listen):
            if extra not in ("auto", "off"):
                hosts.append(split_host_port(extra)[0])
        for bind in hosts:
            if self.token_file is None and not is_loopback(bind):
                raise ConfigError(
                    f"refusing to listen on {bind}: without --token-file the daemon serves "
                    "loopback only (give a token file, and preferably mTLS, to serve a network)")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError("--tls-cert and --tls-key go together")
        if self.tls_ca is not None and self.tls_cert is None:
            raise ConfigError("--tls-ca (client verification) needs --tls-cert/--tls-key")
        if self.tls_server_name is not None and self.tls_ca is None:
            raise ConfigError("--tls-server-name (how peers are verified) needs --tls-ca")
        if self.replicas < 1 or self.lease_ttl < 1 or self.workers < 1:
            raise ConfigError("--replicas, --lease-ttl and --workers must be >= 1")
        if self.rereplicate_after < 0 or self.drain_timeout < 0:
            raise ConfigError("--rereplicate-after and --drain-timeout cannot be negative")
        if min(self.put_idle_timeout, self.idle_timeout, self.preauth_timeout,
               self.catalog_prune_s) <= 0 or self.tenant_put_streams < 1:
            raise ConfigError("timeouts and --tenant-put-streams must be positive")
        if (self.backpressure_timeout <= 0 or self.write_queue_depth < 1
                or self.max_pending_writes < 1 or self.tenant_read_streams < 1
                or self.get_min_rate <= 0 or not 0 < self.tenant_manifest_share <= 1
                or self.max_unauth_connections < 1 or self.max_connections_per_ip < 1
                or self.grpc_max_streams < 1
                or (self.tenant_read_bytes is not None and self.tenant_read_bytes <= 0)
                or (self.tenant_max_blocks is not None and self.tenant_max_blocks <= 0)):
            raise ConfigError("back-pressure, queue, read, manifest and connection limits must "
                              "be positive (shares in (0, 1])")
        self.limits()  # the shares and budgets are checked there

    def limits(self) -> DaemonLimits:
        """Per-tenant budgets and put deadlines (kvstore/daemon/budgets.py)."""
        scaled = DaemonLimits.scaled(
            self.mem_budget, self.disk_budget, put_share=self.tenant_put_share,
            put_streams=self.tenant_put_streams, stored_share=self.tenant_stored_share,
            inflight_put_bytes=self.inflight_put_bytes)
        return DaemonLimits(scaled.inflight_put_bytes, scaled.tenant,
                            put_idle_s=self.put_idle_timeout,
                            read_streams=self.tenant_read_streams,
                            read_bytes=self.tenant_read_bytes or scaled.tenant.put_bytes,
                            max_blocks=self.tenant_max_blocks or scaled.max_blocks,
                            get_min_rate=self.get_min_rate)

    @property
    def auth_enabled(self) -> bool:
        return self.token_file is not None

    @property
    def tls_enabled(self) -> bool:
        return self.tls_cert is not None

    def data_bind(self) -> tuple[str, int] | None:
        """(host, port) for the data plane, or None when it is off (asked to be, or TLS)."""
        if self.data_listen == "off" or self.tls_enabled:
            return None
        if self.data_listen == "auto":
            return split_host_port(self.listen)[0], 0
        return split_host_port(self.data_listen)

    def metrics_bind(self) -> tuple[str, int] | None:
        """(host, port) for `/metrics`, or None when it is off."""
        if self.metrics_listen == "off":
            return None
        if self.metrics_listen == "auto":
            return split_host_port(self.listen)[0], 0
        return split_host_port(self.metrics_listen)

    def advertised_data_address(self, bound_port: int) -> str:
        """The data plane's host:port for clients: the advertised gRPC host, the bound port."""
        host = self.advertised_address(0).rpartition(":")[0]
        return f"{host}:{bound_port}"

    def advertised_address(self, bound_port: int) -> str:
        if self.advertise:
            return self.advertise
        host, _ = split_host_port(self.listen)
        if host in ("0.0.0.0", "::", ""):
            host = socket.gethostname()
        return f"{host}:{bound_port}"


def add_budget_arguments(p: argparse.ArgumentParser) -> None:
    """The serve command's flags for back-pressure, read budgets, shapes and connections
    (issue 16: M1-M7); `budget_options` turns them into DaemonConfig's fields."""
    p.add_argument("--backpressure-timeout", type=float, default=30.0,
                   help="seconds a put's ack may wait for the disk; then it is refused")
    p.add_argument("--write-queue-depth", type=int, default=1024,
                   help="write-behind jobs that may wait (a copy finding it full is refused)")
    p.add_argument("--max-pending-writes", type=int, default=64,
                   help="write-behind depth past which acks wait for the disk")
    p.add_argument("--tenant-read-streams", type=int, default=32,
                   help="reads one tenant may have in progress")
    p.add_argument("--tenant-read-bytes", default=None,
                   help="bytes one tenant's reads in progress may hold (default: its put "
                   "budget)")
    p.add_argument("--get-min-rate", default="1MiB",
                   help="bytes per second a data plane GET's reader must take")
    p.add_argument("--tenant-max-blocks", type=int, default=None,
                   help="blocks one tenant may store (default: its stored budget over a "
                   "file-system block plus the per-entry overhead)")
    p.add_argument("--tenant-manifest-share", type=float, default=0.25,
                   help="share of the manifest budget one tenant may fill")
    p.add_argument("--max-unauth-connections", type=int, default=32,
                   help="data plane connections not yet authenticated, at once")
    p.add_argument("--max-connections-per-ip", type=int, default=128,
                   help="data plane connections from one source address")
    p.add_argument("--grpc-max-streams", type=int, default=256,
                   help="concurrent gRPC calls per connection (x4 per daemon)")


def budget_options(args: argparse.Namespace) -> dict[str, Any]:
    """DaemonConfig's fields from `add_budget_arguments`' flags."""
    return {
        "backpressure_timeout": args.backpressure_timeout,
        "write_queue_depth": args.write_queue_depth,
        "max_pending_writes": args.max_pending_writes,
        "tenant_read_streams": args.tenant_read_streams,
        "tenant_read_bytes": (parse_size(args.tenant_read_bytes)
                              if args.tenant_read_bytes else None),
        "get_min_rate": float(parse_size(args.get_min_rate)),
        "tenant_max_blocks": args.tenant_max_blocks,
        "tenant_manifest_share": args.tenant_manifest_share,
        "max_unauth_connections": args.max_unauth_connections,
        "max_connections_per_ip": args.max_connections_per_ip,
        "grpc_max_streams": args.grpc_max_streams,
    }
