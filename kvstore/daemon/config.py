"""The daemon's configuration: the settings an operator writes (`DaemonSettings`: a
`--config FILE`, the flags of `kvkeep store serve` over it), and the one frozen value the daemon
runs from (`DaemonConfig`), built from them and checked up front.

Two types, not one, because they hold different things. `DaemonSettings` is what was given, in
the words of the file and the flags: sizes as `512MiB` or a byte count, the etcd as its URL and
`etcd_*` keys (spelled and checked as the connector and the LMCache plugin spell them:
`kvstore.settings.RegistrySettings`), a key left out as None. `DaemonConfig` is what the daemon
uses: byte counts, an `EtcdSpec`, `Path`s, every default filled in, and the fields no operator
sets (`keepalive`, `peer_token`, `catalog_prune_s`: tests and benchmarks set them in code).
Every daemon is built through `DaemonConfig` (the command, tests, benchmarks), so its checks,
the cross-field ones included (TLS files that go together, a network listener only with a
token file), guard them all, with one message each, and its defaults are the only ones: a
settings key left out keeps the `DaemonConfig` default, not a second copy of it.
"""

from __future__ import annotations

import argparse
import ipaddress
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec

from kvstore.cluster.discovery import DEFAULT_PREFIX
from kvstore.daemon.budgets import DaemonLimits
from kvstore.errors import ConfigError
from kvstore.etcd import EtcdSpec
from kvstore.keys import validate_name
from kvstore.net.grpc_options import Keepalive
from kvstore.settings import RegistrySettings, Size, Text, parse_size

__all__ = ["DaemonConfig", "DaemonSettings", "parse_size", "split_host_port", "is_loopback",
           "add_budget_arguments"]


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


# Ranges on the settings themselves, so a key out of range is refused by its name
# (`... - at `$.replicas``), from a file or a flag alike; `DaemonConfig` checks them again for
# daemons built in code.
Count = Annotated[int, msgspec.Meta(ge=1)]
Seconds = Annotated[float, msgspec.Meta(gt=0)]
Wait = Annotated[float, msgspec.Meta(ge=0)]
Share = Annotated[float, msgspec.Meta(gt=0, le=1)]


class DaemonSettings(RegistrySettings, frozen=True, kw_only=True):
    """`kvkeep store serve`'s settings as given: a `--config` file's keys, and the flags over
    them. Each key is its flag without the dashes (`--mem-budget` is `mem_budget`), save two
    that take the clients' spelling (`RegistrySettings`): `--etcd-prefix` is `prefix` and
    `--registration-pubkey` is `registration_public_key`. What a key means: its flag's help,
    and the `DaemonConfig` field of its name. None: not given, `DaemonConfig`'s default."""

    listen: Text
    data_dir: Text
    node_id: Text
    # The command's defaults (a `DaemonConfig` built in code names its budgets).
    mem_budget: Size = Size(1 << 30)
    disk_budget: Size = Size(10 << 30)
    mem_prefault: bool | None = None
    disk_fsync: Literal["block", "off"] | None = None
    advertise: Text | None = None
    lease_ttl: Count | None = None
    token_file: Text | None = None
    """The daemon's token table (`<token> <tenant>[,<tenant>...]` per line), not a client's
    one-token file: the same key, the daemon's side of it."""
    tls_cert: Text | None = None
    tls_key: Text | None = None
    tls_ca: Text | None = None
    tls_server_name: Text | None = None
    registration_key: Text | None = None
    replicas: Count | None = None
    rereplicate_after: Wait | None = None
    drain_timeout: Wait | None = None
    workers: Count | None = None
    tenant_put_share: Share | None = None
    tenant_put_streams: Count | None = None
    tenant_stored_share: Share | None = None
    inflight_put_bytes: Size | None = None
    put_idle_timeout: Seconds | None = None
    idle_timeout: Seconds | None = None
    preauth_timeout: Seconds | None = None
    data_listen: Text | None = None
    metrics_listen: Text | None = None
    backpressure_timeout: Seconds | None = None
    write_queue_depth: Count | None = None
    max_pending_writes: Count | None = None
    max_pending_bytes: Size | None = None
    writer_quiet: Wait | None = None
    writer_defer_max: Wait | None = None
    tenant_read_streams: Count | None = None
    tenant_read_bytes: Size | None = None
    get_min_rate: Size | None = None
    """Bytes per second, as a size (`1MiB`)."""
    tenant_max_blocks: Count | None = None
    tenant_manifest_share: Share | None = None
    max_unauth_connections: Count | None = None
    max_connections_per_ip: Count | None = None
    grpc_max_streams: Count | None = None

    def config(self) -> DaemonConfig:
        """The `DaemonConfig` these settings describe (its checks run here); the etcd's files
        are not read yet (`EtcdSpec.check_files`)."""
        values: dict[str, Any] = {"etcd": self.etcd_spec(), "etcd_prefix": self.stores_prefix}
        for key in msgspec.structs.fields(self):
            value = getattr(self, key.name)
            if value is None or key.name in _AS_ETCD:
                continue
            if isinstance(value, Size):
                value = int(value)  # a plain int in the config (its repr, its equality)
            convert = _CONVERT.get(key.name)
            values[_RENAMED.get(key.name, key.name)] = (
                value if convert is None else convert(value))
        return DaemonConfig(**values)


_AS_ETCD = frozenset(RegistrySettings.__struct_fields__) - {"registration_public_key"}
"""The keys `DaemonConfig.etcd` (an `EtcdSpec`) and `etcd_prefix` are made of."""
_RENAMED = {"registration_public_key": "registration_public_keys"}
"""Keys spelled as the clients spell them, whose `DaemonConfig` field is named otherwise."""
_CONVERT: dict[str, Any] = {
    **{key: Path for key in ("data_dir", "token_file", "tls_cert", "tls_key", "tls_ca",
                             "registration_key", "registration_public_key")},
    "disk_fsync": lambda value: value == "block",
    "get_min_rate": float,
}
"""Keys whose `DaemonConfig` field holds another type than the settings' do."""


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
    max_pending_writes: int = 512
    """The write-behind depth in blocks past which acks wait (back-pressure)."""
    max_pending_bytes: int = 256 << 20
    """The same mark in bytes. With `max_pending_writes` (and half the RAM tier, which the
    core adds), it bounds how far acknowledged blocks run ahead of the disk, which is what a
    crash of the daemon can lose: 256 MiB is the 64 blocks of 4 MiB the block mark alone once
    allowed. A mark in blocks alone held 256 KiB puts to 16 MiB ahead, which a burst of small
    objects filled at once (LMCache's benchmark: every ack then waited for the disk)."""
    writer_quiet: float = 0.005
    """Seconds without a get, put or lookup before the write-behind starts its next batch
    (StoreConfig.writer_quiet_s): a burst of puts or gets runs without the disk writer beside
    it on the same cores and interpreter lock. 0: the writer never waits."""
    writer_defer_max: float = 1.0
    """The longest a queued copy waits for that quiet (StoreConfig.writer_defer_max_s): how far
    durable copies may lag behind acks under traffic that never pauses, besides the
    back-pressure marks, which stop any waiting."""
    tenant_read_streams: int = 32
    """Reads (gRPC Get calls, TCP GETs) one tenant may have in progress (M1)."""
    tenant_read_bytes: int | None = None
    """Bytes of blocks one tenant's reads may hold while they are sent; None: the tenant's
    in-flight put budget (M1)."""
    get_min_rate: float = float(1 << 20)
    """Bytes per second a TCP GET's reader must take; a GET gets 30 s plus size / this (M1).
    1 MiB/s: what `--get-min-rate` has always defaulted to (this field said 1e6)."""
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
        if self.writer_quiet < 0 or self.writer_defer_max < 0:
            raise ConfigError("--writer-quiet and --writer-defer-max cannot be negative")
        if min(self.put_idle_timeout, self.idle_timeout, self.preauth_timeout,
               self.catalog_prune_s) <= 0 or self.tenant_put_streams < 1:
            raise ConfigError("timeouts and --tenant-put-streams must be positive")
        if (self.backpressure_timeout <= 0 or self.write_queue_depth < 1
                or self.max_pending_writes < 1 or self.max_pending_bytes < 1
                or self.tenant_read_streams < 1
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
    (issue 16: M1-M7): `DaemonSettings`' keys of the same names. No defaults here (a flag left
    out must not hide the `--config` file's key): `DaemonConfig`'s are the defaults."""
    p.add_argument("--backpressure-timeout", type=float,
                   help="seconds a put's ack may wait for the disk; then it is refused")
    p.add_argument("--write-queue-depth", type=int,
                   help="write-behind jobs that may wait (a copy finding it full is refused)")
    p.add_argument("--max-pending-writes", type=int,
                   help="write-behind depth in blocks past which acks wait for the disk")
    p.add_argument("--max-pending-bytes",
                   help="write-behind bytes past which acks wait for the disk (e.g. 256MiB)")
    p.add_argument("--writer-quiet", type=float,
                   help="seconds without a get, put or lookup before the write-behind starts a "
                   "batch "
                   "(0: at once)")
    p.add_argument("--writer-defer-max", type=float,
                   help="the longest seconds a queued disk copy waits for that quiet")
    p.add_argument("--tenant-read-streams", type=int,
                   help="reads one tenant may have in progress")
    p.add_argument("--tenant-read-bytes",
                   help="bytes one tenant's reads in progress may hold (default: its put "
                   "budget)")
    p.add_argument("--get-min-rate",
                   help="bytes per second a data plane GET's reader must take (default "
                   "1MiB)")
    p.add_argument("--tenant-max-blocks", type=int,
                   help="blocks one tenant may store (default: its stored budget over a "
                   "file-system block plus the per-entry overhead)")
    p.add_argument("--tenant-manifest-share", type=float,
                   help="share of the manifest budget one tenant may fill")
    p.add_argument("--max-unauth-connections", type=int,
                   help="data plane connections not yet authenticated, at once")
    p.add_argument("--max-connections-per-ip", type=int,
                   help="data plane connections from one source address")
    p.add_argument("--grpc-max-streams", type=int,
                   help="concurrent gRPC calls per connection (x4 per daemon)")
