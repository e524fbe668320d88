"""Streams: relaying a worker's SSE events to the client (`relay`), what has been delivered
(`state`), and a stream's life after its first byte, continued on another worker when it
breaks (`continuation`)."""

from router.streaming.relay import StreamBroken, note, pump, sse
from router.streaming.state import StreamState

__all__ = ["StreamBroken", "StreamState", "note", "pump", "sse"]
