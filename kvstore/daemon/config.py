"""The daemon's configuration: one frozen value built from the command line, checked up front."""

from __future__ import annotations

import ipaddress
import re
import socket
from dataclasses import dataclass, field
from pathlib import Path

from kvstore.daemon.budgets import DaemonLimits
from kvstore.errors import ConfigError
from kvstore.etcd import EtcdSpec
from kvstore.keys import validate_name
from kvstore.net.grpc_options import Keepalive
from kvstore.tiers.discovery import DEFAULT_PREFIX

__all__ = ["DaemonConfig", "parse_size", "split_host_port", "is_loopback"]

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
        self.limits()  # the shares and budgets are checked there

    def limits(self) -> DaemonLimits:
        """Per-tenant budgets and put deadlines (kvstore/daemon/budgets.py)."""
        scaled = DaemonLimits.scaled(
            self.mem_budget, self.disk_budget, put_share=self.tenant_put_share,
            put_streams=self.tenant_put_streams, stored_share=self.tenant_stored_share,
            inflight_put_bytes=self.inflight_put_bytes)
        return DaemonLimits(scaled.inflight_put_bytes, scaled.tenant,
                            put_idle_s=self.put_idle_timeout)

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
