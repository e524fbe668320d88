"""Why a daemon refuses a call, and what a refusal becomes on the client: one table each way.

The daemon's core raises `Refusal(reason, message)`; each front writes the reason in its own
wire's terms (gRPC: the status code of the same number; the TCP plane: that number in its reply
head), so the reasons are numbered as gRPC's status codes. The client side turns any status it
receives, from either transport, into a kvkeep exception with `client_error`: the only such
table in the code base.
"""

from __future__ import annotations

from enum import IntEnum

from kvstore.errors import (
    ConfigError,
    DeadlineExceeded,
    KVKeepError,
    TierError,
    TierFull,
    TierUnavailable,
)

__all__ = ["RefusalReason", "Refusal", "client_error", "status_name", "OK"]

OK = 0
"""The status of an answered call (gRPC's OK)."""


class RefusalReason(IntEnum):
    """Why a call was refused; the values are gRPC status codes."""

    INVALID_ARGUMENT = 3
    """A malformed request or frame (nothing of it was stored)."""
    DEADLINE_EXCEEDED = 4
    """A put whose bytes did not arrive in time (the daemon's own put deadlines)."""
    PERMISSION_DENIED = 7
    """The token is valid but not granted the request's tenant."""
    RESOURCE_EXHAUSTED = 8
    """Not here, not now: the disk is full, a budget of the tenant or the daemon is spent
    (in-flight put bytes, put streams), or a request is over a size limit. Clients take it as
    `TierFull`: the next replica, no retry, and no breaker (the daemon is well, and serves
    reads)."""
    INTERNAL = 13
    """The daemon failed in a way it did not expect."""
    UNAVAILABLE = 14
    """Draining or shutting down, or its store failed: try another replica."""
    DATA_LOSS = 15
    """A stored record (a manifest) failed its checks."""
    UNAUTHENTICATED = 16
    """No bearer token, or an unknown one."""


class Refusal(KVKeepError):
    """A call the daemon refuses, with its reason; raised by the core, translated by a front."""

    def __init__(self, reason: RefusalReason, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


# gRPC's status codes by number (grpc.StatusCode), for messages.
_NAMES = ("OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND",
          "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION",
          "ABORTED", "OUT_OF_RANGE", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS",
          "UNAUTHENTICATED")
_DEADLINE_EXCEEDED = 4
_RESOURCE_EXHAUSTED = 8
# A missing or wrong token is a deployment mistake, not a sick daemon.
_CONFIG = frozenset({RefusalReason.UNAUTHENTICATED, RefusalReason.PERMISSION_DENIED})
# The daemon (or the connection to it) is unwell: the caller's breaker counts these.
_UNAVAILABLE = frozenset({1, 2, 10, RefusalReason.INTERNAL, RefusalReason.UNAVAILABLE,
                          RefusalReason.DATA_LOSS})


def status_name(status: int) -> str:
    return _NAMES[status] if 0 <= status < len(_NAMES) else str(status)


def client_error(status: int, what: str, message: str) -> KVKeepError:
    """The kvkeep exception for a non-OK status from a daemon, whichever transport carried it:
    DeadlineExceeded, ConfigError (auth), TierUnavailable (the daemon is unwell: breakers count
    it), TierFull (a full disk or a spent budget: try elsewhere, later; breakers do not count
    it) or TierError (a refusal of this request only, e.g. a bad argument)."""
    text = f"{what}: {status_name(status)}: {message}"
    if status == _DEADLINE_EXCEEDED:
        return DeadlineExceeded(text)
    if status in _CONFIG:
        return ConfigError(text)
    if status in _UNAVAILABLE:
        return TierUnavailable(text)
    if status == _RESOURCE_EXHAUSTED:
        return TierFull(text)
    return TierError(text)
