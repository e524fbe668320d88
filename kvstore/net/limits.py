"""The sizes both ends of the wire agree on, whatever the transport.

The daemon and its clients import these from here, so a limit is raised on both ends at once.
"""

from __future__ import annotations

__all__ = ["CHUNK_BYTES", "MAX_MESSAGE_BYTES", "MAX_FRAME_BYTES", "MAX_KEYS_PER_CALL"]

CHUNK_BYTES = 4 << 20
"""Payload bytes per streamed gRPC message. 4 MiB messages measured fastest here (1 MiB: more
per-message overhead in Python; larger: gRPC buffers whole messages and page-faults more)."""

MAX_MESSAGE_BYTES = CHUNK_BYTES + (1 << 20)
"""The gRPC message limit on both ends: one chunk plus room for a frame header and fields.
Raised deliberately from gRPC's 4 MiB default; anything bigger is RESOURCE_EXHAUSTED."""

MAX_FRAME_BYTES = 1 << 30
"""The largest block frame a daemon admits (a 1 GiB block is ~100x any real model's)."""

MAX_KEYS_PER_CALL = 65536
"""Keys in one Lookup/Get/Delete; a batch of 1,000 is typical, 64 Ki keys of 64 bytes is 4 MiB."""
