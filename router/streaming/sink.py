"""Where a relayed stream goes: the client's side of a stream, as the request director and
the relay write it, without HTTP (the HTTP front wraps aiohttp's `StreamResponse` in one; a
test or a simulator passes its own)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

__all__ = ["Sink", "StreamSink"]


class Sink(Protocol):
    """What the relay writes a stream's events to (aiohttp's `StreamResponse` is one)."""

    async def write(self, data: bytes) -> None: ...


class StreamSink(Sink, Protocol):
    """A client's stream, opened by the director once a worker's stream has started."""

    async def prepare(self, headers: Mapping[str, str]) -> None:
        """Send the status (200) and `headers`; nothing is written before."""

    async def write_eof(self, data: bytes) -> None:
        """Write `data`, the stream's last bytes, and end it."""
