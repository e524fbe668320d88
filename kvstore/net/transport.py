"""The seam between the remote tier and the wire: one daemon's block GET and PUT.

`BlockTransport` is what a client needs to move block bytes to and from one daemon; it has one
implementation per transport (grpc_transport.py, tcp_transport.py). `DaemonClient` chooses one
per daemon, once (kvstore/net/daemon_client.py), and everything above it — the remote tier's
replication, placement, breakers and repair, the daemons' re-replication — calls only this.

Contract of both implementations:
- `get` returns the block (or the segments of `layers`) unverified, or None on a miss; with an
  `out` buffer large enough, the payload lands in it. Callers verify every block before use.
- `put` stores whole frames, one admitted flag per block, each stored whole or not at all.
- Failures are kvkeep exceptions (kvstore/net/refusal.py says which status becomes which);
  `TransportUnreachable` means nothing reached the daemon, so the call may be retried on another
  transport (GET and PUT are idempotent).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from kvstore.errors import TierUnavailable
from kvstore.frame import BlockRead, LayerRange
from kvstore.net.scope import Scope
from kvstore.tiers.base import Buffer

__all__ = ["BlockTransport", "TransportUnreachable", "FrameBytes"]

FrameBytes = bytes | bytearray | memoryview


class TransportUnreachable(TierUnavailable):
    """The transport could not connect, or lost the connection before any reply: the daemon did
    nothing, and another transport may be tried within the same deadline."""


class BlockTransport(Protocol):
    """Block bytes to and from one daemon (see the module docstring). Thread-safe."""

    @property
    def kind(self) -> str:
        """"grpc" or "tcp"."""
        ...

    @property
    def address(self) -> str:
        """host:port the blocks travel to."""
        ...

    def get(self, scope: Scope, block_hash: bytes, layers: LayerRange | None = None, *,
            out: Buffer | None = None, timeout: float) -> BlockRead | None: ...

    def put(self, scope: Scope, blocks: Sequence[tuple[bytes, FrameBytes]], *,
            timeout: float) -> list[bool]: ...

    def close(self) -> None: ...
