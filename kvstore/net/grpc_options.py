"""gRPC settings both ends derive from one place: message limits, windows, keepalive.

Keepalive is one policy for both ends. The client pings an idle connection every
`interval_ms` (so a dead peer or a silently dropped NAT entry is found within interval +
timeout); the daemon permits pings twice as often as that. gRPC servers answer pings that come
sooner than they permit with "strikes" and, after two, a GOAWAY `ENHANCE_YOUR_CALM
too_many_pings` (the server's default is one ping per 5 minutes without data), which cost a
soak run its connections: the client used to ping every 10 s against that default.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvstore.errors import ConfigError
from kvstore.net.limits import MAX_MESSAGE_BYTES

__all__ = ["KVSTORE_SERVICE", "HEALTH_SERVICE", "Keepalive", "channel_options",
           "server_options", "GrpcOption"]

KVSTORE_SERVICE = "kvkeep.store.v1.KVStore"
HEALTH_SERVICE = "grpc.health.v1.Health"

GrpcOption = tuple[str, int]

# gRPC clients never ping more often than once a second, whatever keepalive_time says.
_MIN_INTERVAL_MS = 1000

_COMMON: tuple[GrpcOption, ...] = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # Big flow-control windows keep a 16 MiB stream from stalling on window updates.
    ("grpc.http2.lookahead_bytes", 16 << 20),
)


@dataclass(frozen=True, slots=True)
class Keepalive:
    """When an idle connection is pinged (client) and how often pings are permitted (daemon)."""

    interval_ms: int = 10_000
    """The client pings after this long without activity."""
    timeout_ms: int = 5_000
    """A ping unanswered this long closes the connection."""

    def __post_init__(self) -> None:
        if self.interval_ms < _MIN_INTERVAL_MS or self.timeout_ms <= 0:
            raise ConfigError(f"keepalive interval must be >= {_MIN_INTERVAL_MS} ms and its "
                              f"timeout positive, not {self}")

    @property
    def permitted_interval_ms(self) -> int:
        """The shortest gap between pings the daemon accepts: half the client's interval, so
        timer jitter never turns an agreed ping into a strike."""
        return self.interval_ms // 2


def channel_options(keepalive: Keepalive | None = None) -> list[GrpcOption]:
    """Options of a client channel to a daemon."""
    ka = keepalive or Keepalive()
    return [*_COMMON,
            ("grpc.keepalive_time_ms", ka.interval_ms),
            ("grpc.keepalive_timeout_ms", ka.timeout_ms),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0)]


def server_options(keepalive: Keepalive | None = None, *, idle_timeout_s: float = 120.0,
                   handshake_timeout_s: float = 5.0) -> list[GrpcOption]:
    """Options of the daemon's gRPC server, agreeing with `channel_options(keepalive)`.

    A connection without calls for `idle_timeout_s` is sent a GOAWAY (clients reconnect on
    their next call; keepalive pings do not count as calls), and one that has not finished its
    HTTP/2 (and TLS) handshake after `handshake_timeout_s` is closed: neither an idle client
    nor a half-open one keeps a connection forever.
    """
    ka = keepalive or Keepalive()
    return [*_COMMON,
            ("grpc.max_connection_idle_ms", int(idle_timeout_s * 1000)),
            ("grpc.server_handshake_timeout_ms", int(handshake_timeout_s * 1000)),
            # Pings from clients: accepted on idle connections too, as often as they are sent.
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_ping_interval_without_data_ms", ka.permitted_interval_ms),
            # The daemon's own pings find clients that vanished without closing.
            ("grpc.keepalive_time_ms", ka.interval_ms),
            ("grpc.keepalive_timeout_ms", ka.timeout_ms),
            ("grpc.http2.max_pings_without_data", 0)]
