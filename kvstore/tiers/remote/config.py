"""The remote tier's settings (`RemoteConfig`) and the counters it reports (`RemoteCounters`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from kvstore.errors import ConfigError
from kvstore.net.daemon_client import ClientTLS
from kvstore.tiers.remote.resilience import RetryPolicy

__all__ = ["RemoteConfig", "RemoteCounters", "WriteAck"]

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
    daemons are (kvstore/cluster/daemon_trust.py)."""
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

    @property
    def read_depth(self) -> int:
        """How many daemons, best-ranked first, a read or a lookup of a key tries."""
        return self.replicas + self.extra_ranks

    def batch_deadline(self, frame_bytes: int) -> float:
        """A put of `frame_bytes` may carry GiBs: its deadline grows with its size at a
        pessimistic bandwidth."""
        return time.monotonic() + self.call_timeout + frame_bytes / self.min_bandwidth


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
