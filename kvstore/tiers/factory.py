"""Tiers from configuration: one typed spec per tier kind, built into `Tier` objects in order.

This is the one place that maps specs to tier classes: the connector's `store` config
(`connectors/vllm/stores.py`), the daemon's flags (`kvstore/daemon/server.py`) and Python users
(`TieredStore.from_specs`) all describe their tiers with these specs. Concrete tier modules are
imported only when a spec of theirs is built, so a process pays for (and needs the libraries
of) only the tiers it uses.

An `HbmSpec` is optional by default: where there is no CUDA device it is skipped with a log
line, so one configuration serves GPU and CPU-only hosts alike. Every other tier that cannot be
built raises (and the tiers built before it are closed).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvstore.cluster.tokens import first_token
from kvstore.errors import ConfigError
from kvstore.etcd import EtcdSpec
from kvstore.tiers.base import Tier

__all__ = ["HbmSpec", "HostSpec", "NvmeSpec", "RemoteSpec", "RedisSpec", "TierSpec",
           "build_tier", "build_tiers", "read_token_file"]

log = logging.getLogger(__name__)


def _positive(value: float, what: str) -> None:
    if value <= 0:
        raise ConfigError(f"{what} must be positive, got {value}")


@dataclass(frozen=True, slots=True)
class HbmSpec:
    """Device memory (CUDA): `byte_budget` bytes of pages on `device`."""

    byte_budget: int
    device: str = "cuda"
    optional: bool = True
    name: str = "hbm"

    def __post_init__(self) -> None:
        _positive(self.byte_budget, "hbm byte budget")


@dataclass(frozen=True, slots=True)
class HostSpec:
    """Host RAM: `byte_budget` bytes of reused pages; `prefault` touches them all up front,
    `pinned` page-locks them (CUDA only: GPU copies of lent blocks are DMAs in place)."""

    byte_budget: int
    prefault: bool = False
    name: str = "host"
    pinned: bool = False

    def __post_init__(self) -> None:
        _positive(self.byte_budget, "host byte budget")


@dataclass(frozen=True, slots=True)
class NvmeSpec:
    """Crash-safe block files under `path`, at most `byte_budget` bytes.

    durable=False skips the fsyncs (a cache that may lose its last writes in a crash);
    verify_on_put=False skips hashing frames that were verified just before they were offered
    (the daemon's write-behind); reads are verified either way.
    """

    path: str
    byte_budget: int
    durable: bool = True
    verify_on_put: bool = True
    name: str = "nvme"

    def __post_init__(self) -> None:
        if not self.path:
            raise ConfigError("an nvme tier needs a path (its data directory)")
        _positive(self.byte_budget, "nvme byte budget")


@dataclass(frozen=True, slots=True)
class RemoteSpec:
    """kvstore daemons, found through etcd (`etcd`, under `prefix`) or listed (`daemons`: node
    id -> host:port pairs); each block on `replicas` of them.

    `token_file`: a file whose first line is the bearer token the daemons require (`kvkeep
    store serve --token-file`), so the token itself never sits in a config that gets logged.
    Lookups get a quarter of `timeout_s` (at least 50 ms): they sit on the scheduler's path.
    """

    etcd: EtcdSpec | str | None = None
    """etcd URL(s), or an `EtcdSpec` with TLS and credentials (kvstore/etcd/spec.py)."""
    prefix: str | None = None
    """etcd key prefix of the daemons' registrations; None: the daemons' default."""
    replicas: int = 2
    daemons: tuple[tuple[str, str], ...] = ()
    timeout_s: float = 1.0
    token_file: str | None = None
    name: str = "remote"
    tls_ca: str | None = None
    """mTLS to the daemons: the cluster CA their certificates are verified against."""
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_server_name: str | None = None
    """The name daemon certificates carry, checked instead of each registered address."""
    registration_public_key: str | None = None
    """Ed25519 public key(s) (PEM) the daemons sign their registrations with."""

    def __post_init__(self) -> None:
        if (self.etcd is None) == (not self.daemons):
            raise ConfigError("a remote tier needs exactly one of 'etcd' and 'daemons'")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError("a remote tier's tls_cert and tls_key go together")
        if self.tls_ca is None and (self.tls_cert or self.tls_server_name):
            raise ConfigError("a remote tier's tls_cert and tls_server_name need tls_ca")
        if self.replicas < 1:
            raise ConfigError(f"remote replicas must be >= 1, got {self.replicas}")
        _positive(self.timeout_s, "remote timeout")


@dataclass(frozen=True, slots=True)
class RedisSpec:
    """A Redis server the user already runs (`url`, e.g. redis://host:6379/0), or a Redis
    Cluster (`nodes`: seed "host:port"s, any of its nodes; exactly one of the two), keys under
    `prefix`; `ttl_s` expires blocks that long after their last write (None: Redis' own
    maxmemory policy decides)."""

    url: str = ""
    prefix: str = "kvkeep"
    ttl_s: int | None = None
    timeout_s: float = 5.0
    name: str = "redis"
    nodes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if bool(self.url) == bool(self.nodes):
            raise ConfigError("a redis tier needs exactly one of 'url' (one server) and "
                              "'nodes' (a cluster's seed nodes)")
        for node in self.nodes:
            host, sep, port = node.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ConfigError(f"a redis cluster node is host:port, not {node!r}")
        if self.url and not self.url.startswith(("redis://", "rediss://", "unix://")):
            raise ConfigError(f"a redis url starts with redis://, rediss:// or unix://, "
                              f"not {self.url!r}")
        if not self.prefix:
            raise ConfigError("a redis tier needs a non-empty key prefix")
        if self.ttl_s is not None:
            _positive(self.ttl_s, "redis ttl")
        _positive(self.timeout_s, "redis timeout")


TierSpec = HbmSpec | HostSpec | NvmeSpec | RemoteSpec | RedisSpec


def build_tier(spec: TierSpec) -> Tier:
    """The tier `spec` describes; ConfigError when it cannot exist here (no CUDA, bad path)."""
    if isinstance(spec, HostSpec):
        from kvstore.tiers.memory.host import HostTier

        return HostTier(spec.byte_budget, name=spec.name, prefault=spec.prefault,
                        pinned=spec.pinned)
    if isinstance(spec, HbmSpec):
        from kvstore.tiers.memory.hbm import HbmTier

        return HbmTier(spec.byte_budget, device=spec.device, name=spec.name)
    if isinstance(spec, NvmeSpec):
        from kvstore.tiers.nvme.tier import NvmeTier

        return NvmeTier(spec.path, spec.byte_budget, name=spec.name, durable=spec.durable,
                        verify_on_put=spec.verify_on_put)
    if isinstance(spec, RemoteSpec):
        return _remote(spec)
    if isinstance(spec, RedisSpec):
        from kvstore.tiers.redis import RedisConfig, RedisTier

        config = RedisConfig(prefix=spec.prefix, ttl_seconds=spec.ttl_s,
                             socket_timeout=spec.timeout_s, name=spec.name, nodes=spec.nodes)
        if spec.url:
            config = dataclasses.replace(config, url=spec.url)
        return RedisTier(config)
    raise ConfigError(f"not a tier spec: {spec!r}")


def build_tiers(specs: Sequence[TierSpec]) -> list[Tier]:
    """Construct the tiers in order, skipping optional ones this machine cannot have."""
    tiers: list[Tier] = []
    try:
        for spec in specs:
            try:
                tiers.append(build_tier(spec))
            except ConfigError as exc:
                if not (isinstance(spec, HbmSpec) and spec.optional):
                    raise
                log.info("skipping optional %s tier: %s", spec.name, exc)
        if not tiers:
            raise ConfigError("no tier could be built from the configuration")
    except BaseException:
        for tier in tiers:
            tier.close()
        raise
    return tiers


def read_token_file(path: str) -> str:
    """The first line of `path` that is neither empty nor a comment: a bearer token (the one
    reader: kvstore/cluster/tokens.py)."""
    return first_token(path, "token file")


def _remote(spec: RemoteSpec) -> Tier:
    from kvstore.net.daemon_client import ClientTLS
    from kvstore.tiers.remote.tier import RemoteConfig, RemoteTier

    def path(value: str | None) -> Path | None:
        return None if value is None else Path(value)

    tls = None if spec.tls_ca is None else ClientTLS(
        Path(spec.tls_ca), path(spec.tls_cert), path(spec.tls_key), spec.tls_server_name)
    config = RemoteConfig(replicas=spec.replicas, call_timeout=spec.timeout_s,
                          lookup_timeout=max(0.05, spec.timeout_s / 4), name=spec.name,
                          token=None if spec.token_file is None
                          else read_token_file(spec.token_file), tls=tls,
                          registration_public_key=path(spec.registration_public_key))
    if spec.etcd is not None:
        if spec.prefix is None:
            return RemoteTier.from_etcd(spec.etcd, config)
        return RemoteTier.from_etcd(spec.etcd, config, prefix=spec.prefix)
    return RemoteTier.from_addresses(dict(spec.daemons), config)
