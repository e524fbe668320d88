"""Streams: relaying a worker's SSE events to the client (`relay`), what has been delivered
(`state`), and resuming a broken stream on another worker (`resume`; not to be confused with
`router/continuation/`, stateful conversations)."""

from router.streaming.relay import StreamBroken, note, pump, sse
from router.streaming.state import StreamState

__all__ = ["StreamBroken", "StreamState", "note", "pump", "sse"]
