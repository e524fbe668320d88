"""The one exception tree of kvkeep.

Every error kvkeep raises derives from `KVKeepError`, so callers can catch the whole family at a
boundary. Errors from libraries (OSError, grpc.RpcError, redis errors) are translated where they
enter our code with `raise ... from`, never leaked.

Reading paths treat `CorruptBlock`, `TierUnavailable` and `DeadlineExceeded` as a miss: a sick
cache behaves like an empty one, and a miss means recompute. Serving wrong KV is never an option.
"""

from __future__ import annotations

__all__ = [
    "KVKeepError",
    "InvalidKey",
    "InvalidFrame",
    "CorruptBlock",
    "ForgedBlock",
    "CodecError",
    "TierError",
    "TierUnavailable",
    "TierFull",
    "DeadlineExceeded",
    "ConfigError",
    "UntrustedRegistration",
]


class KVKeepError(Exception):
    """Root of every error kvkeep raises."""


class ConfigError(KVKeepError):
    """A configuration value is missing, malformed or inconsistent."""


class InvalidKey(KVKeepError, ValueError):
    """A session id, tenant, salt or block hash failed validation (length, charset)."""


class CorruptBlock(KVKeepError):
    """A stored block failed verification (checksum, header, key binding).

    Callers turn this into a miss and delete the block; the data is never used.
    """


class InvalidFrame(CorruptBlock, ValueError):
    """Bytes that do not parse as a block frame (bad magic, version, truncated header).

    A subclass of `CorruptBlock` so that every read path treats it as a miss; a write path
    (a client handing us garbage) reports it as invalid input.
    """


class ForgedBlock(CorruptBlock):
    """A frame without a valid MAC, read by a reader that holds its tenant's MAC key
    (kvstore/mac.py): not written by the tenant's writers. A miss, like any corrupt copy."""


class CodecError(KVKeepError):
    """A tensor cannot be encoded or decoded by the requested codec (dtype, shape)."""


class TierError(KVKeepError):
    """A storage tier failed an operation."""


class TierUnavailable(TierError):
    """A tier (or a remote daemon) cannot be reached right now; reads become misses."""


class TierFull(TierError):
    """A tier cannot admit a block (budget exhausted, disk full). Reads keep working."""


class DeadlineExceeded(KVKeepError, TimeoutError):
    """An operation ran past its deadline; for reads this is a miss."""


class UntrustedRegistration(KVKeepError):
    """A daemon registration a client does not believe (kvstore/cluster/daemon_trust.py):
    malformed, unsigned, badly signed, or unprovable; `reason` is the short word it is
    counted under."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
