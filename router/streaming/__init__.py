"""Streams: relaying a worker's SSE events to the client (`relay`) through a `Sink` (`sink`),
what has been delivered (`state`), and resuming a broken stream on another worker (`resume`;
not to be confused with `router/conversations/`, stateful conversations). A stream's life from
its first byte to its end is the request director's (`router/front/director.py`)."""

from router.streaming.relay import StreamBroken, note, pump, sse
from router.streaming.sink import Sink, StreamSink
from router.streaming.state import StreamState

__all__ = ["Sink", "StreamBroken", "StreamSink", "StreamState", "note", "pump", "sse"]
