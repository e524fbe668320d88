"""Relaying a Responses API stream (`POST /v1/responses`): passed through event by event, never
resumed, and ended with the API's own failure events when the worker breaks it.

vLLM streams typed SSE events (`event: response.output_text.delta` + `data: {"type": ...,
"sequence_number": n, "item_id": ...}`), from `response.created` to one terminal event
(`response.completed`, `response.incomplete` or `response.failed`), and no `[DONE]`. A break is
not resumed: a continuation on another worker would be a new response, with its own response
and item ids and its own sequence numbers, and the client's record of the answer (ids it may
name in `previous_response_id`, the stored response itself, which vLLM keeps in the worker's
memory) would point at a worker that no longer has it. So what a broken stream gets is what
the Responses API defines for a failure: an `error` event (`ResponseErrorEvent`: `code`,
`message`, `param`, `sequence_number`) and a `response.failed` event carrying the response as
it was created, with status `failed` and its `error`; then the stream ends. Both follow the
worker's last sequence number, so a client that checks them sees no gap. A break before any
event reached the client is not a break the client sees: the director sends the request to
another worker instead (`router/front/director.py`).

The worker's own `error` event (vLLM sends one for an engine failure mid-stream; an untyped
`{"error": ...}` data line counts as one too) is a broken
stream as it is for the other endpoints (`streaming/relay.py`): the worker is marked, and the
client gets the failure events above, which carry the worker's message.

Bounds are the other streams': one event (all its lines) at most `max_event_bytes`, the
first-byte deadline, the idle timeout, and the worker's registration (`relay._read`). The
router does not count this stream's tokens (its events carry text, not token ids): the worker
enforces `max_output_tokens`, and the event-size bound limits what one event may carry.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp

from router.streaming.relay import (
    EventTooLarge,
    StreamBroken,
    decode_event,
    encode_json,
    worker_reads,
)
from router.streaming.sink import Sink

__all__ = ["EventStream", "TERMINAL_EVENTS", "pump_events", "failure_events"]

TERMINAL_EVENTS = frozenset({"response.completed", "response.incomplete", "response.failed"})
"""The events that end a Responses API stream (vLLM closes it after one)."""


@dataclass(slots=True)
class EventStream:
    """What the client has been sent of a Responses API stream."""

    events: int = 0
    """Events relayed to the client (0: a failure may still go to another worker unseen)."""
    sequence: int | None = None
    """The highest `sequence_number` relayed."""
    response: dict[str, Any] | None = None
    """The response object as the last event that carried one had it (`response.created`,
    `response.in_progress`): what `response.failed` reports."""
    done: bool = False
    """The worker sent its terminal event."""


async def pump_events(resp: aiohttp.ClientResponse, out: Sink, stream: EventStream,
                      max_event_bytes: int = 16 << 20, *, first_byte_by: float | None = None,
                      idle_s: float | None = None,
                      registered: Callable[[], bool] | None = None) -> bytes:
    """Relay `resp`'s events to `out` until the worker's terminal event; raise `StreamBroken`
    if the worker's side fails first. Returns the client's bytes for the events read with the
    terminal one, unwritten, for the director to send with the stream's end (`relay.pump`'s
    contract, with the terminal event in place of `[DONE]`)."""
    pending = b""
    lines: list[bytes] = []  # the current event's lines
    size = 0
    async with contextlib.aclosing(worker_reads(resp, first_byte_by=first_byte_by, idle_s=idle_s,
                                                registered=registered)) as reads:
        async for data in reads:
            split = (pending + data).split(b"\n")
            pending = split.pop()  # an incomplete last line waits for the next read
            batch: list[bytes] = []
            try:
                for raw in split:
                    line = raw.rstrip(b"\r")
                    size += len(line) + 1
                    if size > max_event_bytes:
                        raise EventTooLarge(f"an SSE event over {max_event_bytes} bytes")
                    if line:
                        lines.append(line)
                        continue
                    if lines and _relay_event(lines, stream, batch):
                        return b"".join(batch)
                    lines, size = [], 0
                if size + len(pending) > max_event_bytes:
                    raise EventTooLarge(f"an SSE event over {max_event_bytes} bytes")
            except BaseException:
                if batch:  # what came before the failure reaches the client
                    await out.write(b"".join(batch))
                raise
            if batch:
                await out.write(b"".join(batch))
    raise StreamBroken("worker closed the stream before its terminal event")

def _relay_event(lines: list[bytes], stream: EventStream, batch: list[bytes]) -> bool:
    """Append one whole event (its lines, as the worker sent them) to `batch`, noting what
    `stream` keeps; True when it is the terminal event."""
    payload = b"\n".join(line[5:].lstrip(b" ") for line in lines if line.startswith(b"data:"))
    obj = decode_event(payload)
    event = obj[0] if obj is not None else None
    kind = event.get("type") if isinstance(event, dict) else None
    if kind is None:  # `event:` names the type when the data does not
        kind = next((line[6:].strip().decode("utf-8", "replace") for line in lines
                     if line.startswith(b"event:")), None)
    if kind == "error" or (isinstance(event, dict) and "error" in event and kind is None):
        # (vLLM's engine failure mid-stream; an untyped `{"error": ...}` is the format the
        # other endpoints use for one, and no event of this API has that shape)
        detail = event if isinstance(event, dict) else payload[:200]
        raise StreamBroken(f"worker error event: {str(detail)[:200]}")
    if isinstance(event, dict):
        seq = event.get("sequence_number")
        if isinstance(seq, int) and not isinstance(seq, bool) \
                and (stream.sequence is None or seq > stream.sequence):
            stream.sequence = seq
        snapshot = event.get("response")
        if isinstance(snapshot, dict):
            stream.response = snapshot
    batch.append(b"\n".join(lines) + b"\n\n")
    stream.events += 1
    if kind in TERMINAL_EVENTS:
        stream.done = True
        return True
    return False


def failure_events(stream: EventStream, message: str) -> bytes:
    """The Responses API's end of a failed stream: an `error` event, then `response.failed`
    (when the worker had sent the response it created), numbered after what was sent."""
    seq = 0 if stream.sequence is None else stream.sequence + 1
    out = [_event("error", {"type": "error", "code": "server_error", "message": message,
                            "param": None, "sequence_number": seq})]
    if stream.response is not None:
        failed = {**stream.response, "status": "failed",
                  "error": {"code": "server_error", "message": message}}
        out.append(_event("response.failed", {"type": "response.failed", "response": failed,
                                              "sequence_number": seq + 1}))
    return b"".join(out)


def _event(kind: str, data: dict[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + encode_json(data) + b"\n\n"
