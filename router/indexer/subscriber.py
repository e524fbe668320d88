"""Subscribes to each worker's KV events over ZMQ and feeds them to the `KVBlockIndex`.

Wire format (vLLM's `ZmqEventPublisher`): multipart `[topic, 8-byte big-endian sequence,
msgpack(KVEventBatch)]`, the batch being `[ts, [event, ...], dp_rank]` and each event a map
with a `type` tag. Workers bind (`tcp://*:PORT`) and register that endpoint; the router
connects one SUB socket per worker, so it knows who sent what without trusting a topic, and
any number of router replicas can listen.

A gap in the sequence means lost events (the PUB socket drops on overflow); the index then
under-reports that worker until its blocks are stored again. That is counted, not repaired:
vLLM's replay socket is optional and a stale index only costs a weaker prefix score.

Intake is bounded per worker (`router.limits.Limits`): a message over
`kv_event_max_message_bytes` is refused by ZMQ itself (MAXMSGSIZE drops the connection), and
token buckets of `kv_event_bytes_per_s` and `kv_event_blocks_per_s` (with `kv_event_burst_s`
of slack) decide what is applied; the excess is dropped and counted (`dropped`, and the
router's `kvkeep_router_kv_events_dropped` metric through `on_drop`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack  # type: ignore[import-untyped]
import zmq
import zmq.asyncio

from router.indexer.events import KVBlockIndex
from router.limits import Limits, TokenBucket
from router.membership.workers import WorkerId

__all__ = ["KVEventSubscriber"]

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Feed:
    endpoint: str
    task: asyncio.Task[None]
    last_seq: int = -1


@dataclass(slots=True)
class _Budget:
    bytes: TokenBucket
    blocks: TokenBucket


def _blocks_in(event: dict[Any, Any]) -> int:
    hashes = event.get("block_hashes")
    return max(1, len(hashes)) if isinstance(hashes, list | tuple) else 1


@dataclass(slots=True)
class KVEventSubscriber:
    """One SUB socket and reader task per worker; `follow`/`unfollow` track membership."""

    index: KVBlockIndex
    limits: Limits = field(default_factory=Limits)
    on_drop: Callable[[str, int], None] | None = None
    """Told (reason, blocks) of what was dropped: "bytes" or "rate"."""
    on_apply: Callable[[int], None] | None = None
    """Told the blocks of each message applied to the index."""
    gaps: int = 0
    dropped: dict[str, int] = field(default_factory=dict)
    _ctx: zmq.asyncio.Context = field(default_factory=zmq.asyncio.Context)
    _feeds: dict[WorkerId, _Feed] = field(default_factory=dict)
    _budgets: dict[WorkerId, _Budget] = field(default_factory=dict)

    def follow(self, worker: WorkerId, endpoint: str | None) -> None:
        """Start (or retarget) the feed of `worker`; `None` stops it."""
        feed = self._feeds.get(worker)
        if feed is not None and feed.endpoint == endpoint:
            return
        self.unfollow(worker, forget=False)
        if endpoint:
            task = asyncio.get_running_loop().create_task(self._read(worker, endpoint),
                                                          name=f"kv-events-{worker}")
            self._feeds[worker] = _Feed(endpoint, task)

    def unfollow(self, worker: WorkerId, *, forget: bool = True) -> None:
        feed = self._feeds.pop(worker, None)
        if feed is not None:
            feed.task.cancel()
        self._budgets.pop(worker, None)
        if forget:
            self.index.forget_worker(worker)

    async def close(self) -> None:
        tasks = [f.task for f in self._feeds.values()]
        self._feeds.clear()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._ctx.term()

    async def _read(self, worker: WorkerId, endpoint: str) -> None:
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self.limits.kv_event_max_message_bytes)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        # A worker that comes back after a restart is a new cache: reconnecting is ZMQ's job.
        sock.connect(endpoint)
        try:
            while True:
                parts = await sock.recv_multipart()
                self.handle(worker, parts)
        finally:
            sock.close(0)

    def handle(self, worker: WorkerId, parts: list[bytes]) -> None:
        """Apply one ZMQ multipart message of `worker`'s KV event stream to the index, within
        the worker's intake budget."""
        if len(parts) < 3:
            return
        seq = int.from_bytes(parts[1], "big", signed=True)
        feed = self._feeds.get(worker)
        if feed is not None:
            if feed.last_seq >= 0 and seq != feed.last_seq + 1:
                self.gaps += 1
                log.debug("KV events from %s: gap %d -> %d", worker, feed.last_seq, seq)
            feed.last_seq = seq
        budget = self._budget(worker)
        if not budget.bytes.take(sum(len(p) for p in parts)):
            self._drop(worker, "bytes", 1)
            return
        try:
            batch: Any = msgpack.unpackb(parts[2], raw=False, strict_map_key=False)
        except (ValueError, msgpack.UnpackException):
            log.warning("undecodable KV event batch from %s", worker)
            return
        events = batch[1] if isinstance(batch, list | tuple) and len(batch) > 1 else ()
        if not isinstance(events, list | tuple):
            return
        applied = 0
        for i, event in enumerate(events):
            if not isinstance(event, dict):
                continue
            if not budget.blocks.take(_blocks_in(event)):
                self._drop(worker, "rate", sum(_blocks_in(e) for e in events[i:]
                                                if isinstance(e, dict)))
                break
            self.index.apply(worker, event)
            applied += _blocks_in(event)
        if applied and self.on_apply is not None:
            self.on_apply(applied)

    def _budget(self, worker: WorkerId) -> _Budget:
        budget = self._budgets.get(worker)
        if budget is None:
            lim = self.limits
            budget = self._budgets[worker] = _Budget(
                TokenBucket(lim.kv_event_bytes_per_s,
                            lim.kv_event_bytes_per_s * lim.kv_event_burst_s),
                TokenBucket(lim.kv_event_blocks_per_s,
                            lim.kv_event_blocks_per_s * lim.kv_event_burst_s))
        return budget

    def _drop(self, worker: WorkerId, reason: str, blocks: int) -> None:
        first = reason not in self.dropped
        self.dropped[reason] = self.dropped.get(reason, 0) + blocks
        if self.on_drop is not None:
            self.on_drop(reason, blocks)
        if first:
            log.warning("KV events of %s over its intake budget (%s): dropped and counted "
                        "from now on", worker, reason)
