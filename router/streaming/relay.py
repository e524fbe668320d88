"""Relaying a worker's SSE stream to the client, event by event, recording what was sent.

Every relayed event is decoded (token ids to keep for resumption) and re-encoded (token ids the
client did not ask for removed), through `StreamState.absorb`. Reads from the worker and writes
to the client fail differently on purpose: a worker failure raises `StreamBroken` (resume
elsewhere); a client failure propagates (stop, free the worker).

One SSE event is at most `max_event_bytes` (`router/limits.py`): a worker that sends a longer
line (or an endless one) has broken its stream (`EventTooLarge`), and the router's buffer for
the incomplete line never grows past that.

Two deadlines bound a worker's silence (trust review M8): until its first bytes, the
time-to-first-byte deadline (long: the request may wait in the worker's queue and a long prompt
prefills before the first token), then the idle timeout between reads. Passing the first is
`FirstByteTimeout`, a busy worker rather than a dead one (a soft failure); passing the second
a worker that stopped mid-answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncGenerator, Callable
from typing import Any

import aiohttp
import msgspec

from router.front.upstream import UPSTREAM_ERRORS
from router.streaming.replay import Replay
from router.streaming.sink import Sink
from router.streaming.state import StreamState

__all__ = ["StreamBroken", "EventTooLarge", "FirstByteTimeout", "WorkerLeft", "pump",
           "worker_reads", "decode_event", "encode_json", "sse", "note"]

LIVENESS_POLL_S = 1.0
"""How often a silent stream asks whether its worker is still registered: about the lease's
keepalive period, so a worker whose lease expired loses its streams within a second of it."""
_STD_ENCODE = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode
_Codec = tuple[Callable[[bytes], Any], Callable[[Any], bytes]]


def encode_json(obj: Any) -> bytes:
    return _STD_ENCODE(obj).encode()


# msgspec decodes and encodes events about 5x faster than the json module; for what it
# rejects (NaN, deep nesting) the json module takes over, with the same output.
_STD: _Codec = (json.loads, encode_json)
_CODECS: tuple[_Codec, ...] = ((msgspec.json.Decoder().decode, msgspec.json.Encoder().encode),
                               _STD)


def decode_event(payload: bytes) -> tuple[Any, Callable[[Any], bytes]] | None:
    """The event `payload` and the encoder to write it back with; None if it is not JSON."""
    for decode, encode in _CODECS:
        try:
            return decode(payload), encode
        except (ValueError, RecursionError):  # malformed, or beyond what this codec takes
            continue
    return None


def _encode(obj: Any, encode: Callable[[Any], bytes]) -> bytes:
    try:
        return encode(obj)
    except (TypeError, ValueError, OverflowError):
        return encode_json(obj)


class StreamBroken(Exception):
    """The worker's stream ended before its `[DONE]` (connection lost, idle timeout, engine
    error event). Internal to streaming: never reaches a client as an exception."""


class EventTooLarge(StreamBroken):
    """One SSE event of the worker's is over the router's limit."""


class WorkerLeft(StreamBroken):
    """The worker left the registry (its lease expired, or it deregistered) while its stream
    was silent: a frozen or partitioned node keeps its connections open, and waiting out the
    idle timeout would hold the client for nothing once the cluster has declared it gone."""


class FirstByteTimeout(StreamBroken):
    """The worker sent nothing of its answer before the time-to-first-byte deadline: queued
    or prefilling, not known to be dead (a soft failure of the worker)."""


def sse(obj: Any) -> bytes:
    """One SSE data event."""
    return b"data: " + _encode(obj, _CODECS[0][1]) + b"\n\n"


def note(obj: Any) -> bytes:
    """One SSE comment `: kvkeep {...}`: what the router tells of a stream (OpenAI clients
    ignore comments)."""
    return b": kvkeep " + _encode(obj, _CODECS[0][1]) + b"\n\n"


async def pump(resp: aiohttp.ClientResponse, out: Sink, state: StreamState,
               max_event_bytes: int = 16 << 20, *, first_byte_by: float | None = None,
               idle_s: float | None = None, replay: Replay | None = None,
               registered: Callable[[], bool] | None = None) -> bytes:
    """Relay `resp` to `out` until the worker's `[DONE]`; raise `StreamBroken` if the worker's
    side fails first. The `[DONE]` itself is not relayed: the proxy ends the stream after its
    own summary. Returns the client's bytes for the events that came in the same read as the
    `[DONE]`, unwritten, for the proxy to send together with the end of the stream.

    Reads whatever the socket has buffered and answers it with one write: a fast worker's
    chunks arrive several per read, and a syscall per chunk was the proxy's largest cost.
    Nothing is held back: every complete event read is written before the next read (the
    text of a stream with stop strings excepted: `stops.py`). A stop string the router found
    itself ends the relay as the `[DONE]` would (`state.ended`).

    `first_byte_by`: the loop time by which the worker's first bytes must arrive (None: no
    bound); `idle_s`: the longest silence after them (None: no bound). `replay`: the record
    of a stream that resumes by replay (`replay.py`), which sees every chunk first.
    `registered`: whether the worker is still in the registry, asked after every
    `LIVENESS_POLL_S` of silence (`WorkerLeft` once it is not).
    """
    pending = b""
    async with contextlib.aclosing(worker_reads(resp, first_byte_by=first_byte_by, idle_s=idle_s,
                                                registered=registered)) as reads:
        async for read in reads:
            lines = (pending + read if pending else read).split(b"\n")
            pending = lines.pop()  # an incomplete last line waits for the next read
            batch: list[bytes] = []
            try:
                for line in lines:
                    if len(line) > max_event_bytes:
                        raise EventTooLarge(f"an SSE event over {max_event_bytes} bytes")
                    if _relay_line(line.rstrip(b"\r"), state, batch, replay) or state.ended:
                        return b"".join(batch)
                if len(pending) > max_event_bytes:
                    raise EventTooLarge(f"an SSE event over {max_event_bytes} bytes")
            except BaseException:
                if batch:  # what came before the failure reaches the client
                    await out.write(b"".join(batch))
                raise
            if batch:
                await out.write(b"".join(batch) if len(batch) > 1 else batch[0])
    if state.finish_reason is None:
        raise StreamBroken("worker closed the stream before finishing")
    return b""


async def worker_reads(resp: aiohttp.ClientResponse, *, first_byte_by: float | None = None,
                       idle_s: float | None = None,
                       registered: Callable[[], bool] | None = None) -> AsyncGenerator[bytes, None]:
    """A worker's stream, read by read, until it ends, under the stream's deadlines: until
    `first_byte_by` (a loop time) for its first bytes (`FirstByteTimeout`), then `idle_s`
    between reads, and while its worker is registered (`WorkerLeft`). A read that fails is
    `StreamBroken`; the one loop every relay of a worker's stream reads through."""
    loop = asyncio.get_running_loop()
    by = first_byte_by
    first = True
    while True:
        try:
            data = await _read(resp.content, by, registered, loop)
        except TimeoutError as exc:
            if first:
                raise FirstByteTimeout("no answer from the worker before the first-byte "
                                       "deadline") from exc
            raise StreamBroken(f"the worker was silent for {idle_s} s mid-stream") from exc
        except UPSTREAM_ERRORS as exc:
            raise StreamBroken(f"{type(exc).__name__}: {exc}") from exc
        if not data:
            return
        first = False
        yield data
        by = None if idle_s is None else loop.time() + idle_s


async def _read(content: aiohttp.StreamReader, by: float | None,
                registered: Callable[[], bool] | None,
                loop: asyncio.AbstractEventLoop) -> bytes:
    """The next bytes of `content`, waiting until `by` (None: without end); raises
    `TimeoutError` past `by` and `WorkerLeft` once `registered()` turns False. A `readany`
    cut short by a poll's timeout loses nothing: bytes that arrive later wait in the
    reader's buffer for the next one."""
    if registered is None:
        if by is None:
            return await content.readany()
        async with asyncio.timeout_at(by):
            return await content.readany()
    while True:
        poll = loop.time() + LIVENESS_POLL_S
        try:
            async with asyncio.timeout_at(poll if by is None else min(by, poll)):
                return await content.readany()
        except TimeoutError:
            if by is not None and loop.time() >= by:
                raise
            if not registered():
                raise WorkerLeft("the worker left the registry (its lease expired) "
                                 "mid-stream") from None


def _relay_line(line: bytes, state: StreamState, batch: list[bytes],
                replay: Replay | None = None) -> bool:
    """Append the client's bytes for one SSE line to `batch`; True at the worker's [DONE]."""
    if not line.startswith(b"data:"):
        return False  # blank separators (re-added on write), comments, event names
    payload = line[5:].strip()
    if payload == b"[DONE]":
        state.done = True
        return True
    decoded = decode_event(payload)
    if decoded is None:
        batch.append(line + b"\n\n")
        return False
    obj, encode = decoded
    if isinstance(obj, dict) and "error" in obj and "choices" not in obj:
        # vLLM reports an engine failure mid-stream as an error event: a broken stream.
        raise StreamBroken(f"worker error event: {str(obj['error'])[:200]}")
    if replay is not None and isinstance(obj, dict):
        obj = replay.observe(obj)  # recorded, or on a replay cut to what the client lacks
        if obj is None:
            return False
    chunk = state.absorb(obj) if isinstance(obj, dict) else obj
    if chunk is not None:
        batch.append(b"data: " + _encode(chunk, encode) + b"\n\n")
    return False
