"""The daemon's gRPC front: the KVStore service of proto/kvstore.proto over the core.

A thin translation (the decisions are the core's, kvstore/daemon/core.py): each handler parses
its request, asks the core, and writes the answer; a `Refusal` becomes the gRPC status of the
same number. Requests arrive as raw bytes and are parsed here, so bytes that are not a protobuf
message get INVALID_ARGUMENT rather than gRPC's generic INTERNAL. The bulk messages use the
zero-copy codec (kvstore/net/grpc_messages.py): Get encodes its messages straight from the
block's pages, Put copies each message's data straight into the pages reserved for the frame.

Handlers run on the daemon's asyncio loop; storage calls (copies, disk reads, checksums) run on
a small thread pool so that one slow disk read never stalls other streams.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, NoReturn, TypeVar

import grpc  # type: ignore[import-untyped, unused-ignore]
from google.protobuf.message import DecodeError, Message

from kvstore._proto import kvstore_pb2 as pb
from kvstore.daemon.auth import Principal, bearer_token
from kvstore.daemon.block_io import IncomingBlock, OutgoingBlock, byte_range
from kvstore.daemon.core import BlockServiceCore, ServiceStatus
from kvstore.errors import InvalidFrame
from kvstore.keys import BlockKey, SessionKey
from kvstore.net.grpc_messages import decode_put_chunk, encode_get_chunk
from kvstore.net.grpc_options import KVSTORE_SERVICE
from kvstore.net.limits import CHUNK_BYTES
from kvstore.net.refusal import Refusal, RefusalReason
from kvstore.net.scope import Scope

__all__ = ["GrpcFront", "abort_with"]

T = TypeVar("T")
M = TypeVar("M", bound=Message)
_CODES = {code.value[0]: code for code in grpc.StatusCode}
# Lookups of up to this many keys run on the event loop itself (about a millisecond at most):
# cheaper than the hop to a worker thread, and a lookup must not queue behind puts that wait
# for the disk.
_INLINE_LOOKUP_KEYS = 4096
# A block of at most this many messages is encoded whole and checked before it is sent; a
# bigger one is streamed from its pages (M1: no prebuilt copy of a 512 MiB block per stream).
_PREBUILT_MESSAGES = 4


async def abort_with(context: Any, refusal: Refusal) -> NoReturn:
    """End a call with the status of the refusal's reason."""
    await context.abort(_CODES[int(refusal.reason)], refusal.message)
    raise AssertionError("context.abort returned")  # grpc.aio's abort always raises


class GrpcFront:
    """The KVStore gRPC service over one `BlockServiceCore`."""

    def __init__(self, core: BlockServiceCore, executor: ThreadPoolExecutor, *,
                 chunk_bytes: int = CHUNK_BYTES) -> None:
        self._core = core
        self._executor = executor
        self._chunk = chunk_bytes

    def generic_handler(self) -> Any:
        def unary(fn: Callable[[Any, Any], Awaitable[Message]], cls: type[Message]) -> Any:
            async def handler(raw: bytes, context: Any) -> Message:
                try:
                    return await fn(_parse(cls, raw), context)
                except Refusal as refusal:
                    await abort_with(context, refusal)
            return grpc.unary_unary_rpc_method_handler(handler, response_serializer=_serialize)

        async def get(raw: bytes, context: Any) -> AsyncIterator[bytes]:
            try:
                async for message in self.get(_parse(pb.GetRequest, raw), context):
                    yield message
            except Refusal as refusal:
                await abort_with(context, refusal)

        async def put(raw: AsyncIterator[bytes], context: Any) -> pb.PutReply:
            try:
                return await self.put(raw, context)
            except Refusal as refusal:
                await abort_with(context, refusal)

        handlers = {
            "Put": grpc.stream_unary_rpc_method_handler(put, response_serializer=_serialize),
            "Get": grpc.unary_stream_rpc_method_handler(get, response_serializer=None),
            "Lookup": unary(self.lookup, pb.LookupRequest),
            "Delete": unary(self.delete, pb.DeleteRequest),
            "PutManifest": unary(self.put_manifest, pb.PutManifestRequest),
            "GetManifest": unary(self.get_manifest, pb.ManifestKey),
            "DeleteManifest": unary(self.delete_manifest, pb.ManifestKey),
            "Stat": unary(self.stat, pb.StatRequest),
        }
        return grpc.method_handlers_generic_handler(KVSTORE_SERVICE, handlers)

    # -- RPCs (each raises Refusal; generic_handler turns it into the call's status) ------------

    async def put(self, requests: AsyncIterator[bytes], context: Any) -> pb.PutReply:
        core = self._core
        principal = self._principal(context)
        core.admit_put_call()
        statuses: list[pb.PutStatus] = []
        scope: Scope | None = None
        incoming: IncomingBlock | None = None
        received = 0
        messages = requests.__aiter__()
        with contextlib.ExitStack() as holding:
            try:
                while True:
                    raw = await self._next_message(messages, incoming)
                    if raw is None:
                        break
                    try:
                        msg = decode_put_chunk(raw)
                    except InvalidFrame as exc:
                        raise Refusal(RefusalReason.INVALID_ARGUMENT,
                                      f"bad PutChunk: {exc}") from None
                    if scope is None:
                        if msg.scope is None:
                            raise Refusal(RefusalReason.INVALID_ARGUMENT,
                                          "the first message of a put must carry the scope")
                        scope = self._scope(principal, msg.scope)
                        holding.enter_context(core.put_stream(scope, principal))
                    if msg.block_hash:
                        if incoming is not None:
                            raise core.invalid_put("a block began before the last one ended")
                        incoming = core.begin_put(scope, bytes(msg.block_hash),
                                                  int(msg.frame_size), principal)
                        received = 0
                    elif incoming is None:
                        raise core.invalid_put("data outside a block")
                    data = msg.data
                    core.count(put_bytes_received=len(data))
                    if received + len(data) > incoming.size:
                        raise core.invalid_put(
                            f"block carries more than its {incoming.size} bytes")
                    incoming.write(received, data)
                    received += len(data)
                    if received == incoming.size:
                        block, incoming = incoming, None
                        block.wait_for_disk = False  # waited for below, off the executor
                        admitted = await self._run(block.commit)
                        if admitted:
                            await self._wait_for_disk(block.size)
                        statuses.append(pb.PUT_STATUS_STORED if admitted else
                                        pb.PUT_STATUS_NOT_ADMITTED)
                if incoming is not None:
                    raise core.invalid_put("the put stream ended in the middle of a block")
                return pb.PutReply(status=statuses)
            finally:
                if incoming is not None:
                    incoming.abort()

    async def _wait_for_disk(self, size: int) -> None:
        """`BlockServiceCore.wait_for_disk` on the event loop: a put held back by a slow disk
        holds no executor thread, so other tenants' Gets, Deletes and manifest calls are not
        queued behind it (M2)."""
        core = self._core
        loop = asyncio.get_running_loop()
        caught_up = asyncio.Event()

        def wake() -> None:  # on the writer thread that brings the queue to the mark
            loop.call_soon_threadsafe(caught_up.set)

        cancel = core.when_disk_within(core.backpressure_mark(size), wake)
        try:
            async with asyncio.timeout(core.backpressure_timeout):
                await caught_up.wait()
        except TimeoutError:
            raise core.backpressure_refusal() from None
        finally:
            cancel()

    async def _next_message(self, messages: AsyncIterator[bytes],
                            incoming: IncomingBlock | None) -> bytes | None:
        """The next message of a put stream, None at its end; DEADLINE_EXCEEDED when none came
        within the put idle timeout, or the block being received ran past its deadline."""
        wait = self._core.limits.put_idle_s
        if incoming is not None:
            wait = min(wait, incoming.deadline - time.monotonic())
        try:
            async with asyncio.timeout(max(wait, 0.0)):
                return await messages.__anext__()
        except StopAsyncIteration:
            return None
        except TimeoutError:
            raise Refusal(RefusalReason.DEADLINE_EXCEEDED,
                          "put stream stalled: no data within the put deadline") from None

    async def get(self, request: pb.GetRequest, context: Any) -> AsyncIterator[bytes]:
        principal = self._principal(context)
        scope = self._scope(principal, request.scope)
        keys = self._core.keys(scope, request.block_hashes, remember=False)
        layers = (request.layers.start, request.layers.stop) if request.HasField("layers") \
            else None
        single = request.single_reply
        if single and len(keys) != 1:
            raise Refusal(RefusalReason.INVALID_ARGUMENT, "single_reply needs exactly one key")
        with self._core.read_stream(scope, principal):  # M1: reads in progress, per tenant
            for index, key in enumerate(keys):
                async for message in self._block(scope, principal, key, layers, index, single):
                    yield message

    async def _block(self, scope: Scope, principal: Principal, key: BlockKey,
                     layers: tuple[int, int] | None, index: int, single: bool
                     ) -> AsyncIterator[bytes]:
        """The Get messages of one block, holding its bytes against the tenant's read budget
        while they are sent (M1). A block of a few messages is encoded whole and checked before
        any is sent (a corrupt copy lent from RAM is dropped and read again); a bigger one is
        streamed a message at a time from its pages, so a reader that does not read costs the
        daemon one message, not a copy of the block, and the client's own check rejects a copy
        found corrupt after it was sent."""
        core = self._core
        for _ in range(2):
            block = await self._run(core.open_read, key, layers)
            if block is None:
                break
            finished = False
            try:
                with core.read_bytes(scope, block.size, principal):
                    if single or block.size <= _PREBUILT_MESSAGES * self._chunk:
                        messages, sent = await self._run(self._encode, block, index, single)
                        finished = True
                        if not await self._run(block.finish):
                            continue
                        core.count(get_bytes_sent=sent)
                        for message in messages:
                            yield message
                        return
                    size, chunk = block.size, self._chunk
                    first, _ = await self._run(self._encode, block, index, single, chunk)
                    # Counted as each message is handed to grpc, not after the last: the
                    # generator resumes after its last yield only when grpc asks for more,
                    # which may be after the client has read the whole block and asked Stat.
                    core.count(get_bytes_sent=min(chunk, size))
                    yield first[0]
                    for start in range(chunk, size, chunk):
                        message = await self._run(partial(
                            encode_get_chunk, byte_range(block.pieces, start, start + chunk),
                            index=index))
                        core.count(get_bytes_sent=min(chunk, size - start))
                        yield message
                    finished = True
                    await self._run(block.finish)
                    return
            finally:
                if not finished:  # refused, cancelled, or the client went: give pages back
                    block.finish()
        yield encode_get_chunk(b"", index=index, found=False)

    async def lookup(self, request: pb.LookupRequest, context: Any) -> pb.LookupReply:
        scope = self._scope(self._principal(context), request.scope)
        keys = self._core.keys(scope, request.block_hashes)
        if len(keys) <= _INLINE_LOOKUP_KEYS:
            present = self._core.lookup(keys)
        else:
            present = await self._run(self._core.lookup, keys)
        prefix = next((i for i, hit in enumerate(present) if not hit), len(present))
        return pb.LookupReply(present=present, prefix_length=prefix)

    async def delete(self, request: pb.DeleteRequest, context: Any) -> pb.DeleteReply:
        scope = self._scope(self._principal(context), request.scope)
        keys = self._core.keys(scope, request.block_hashes, remember=False)
        return pb.DeleteReply(deleted=await self._run(self._core.delete, keys))

    async def put_manifest(self, request: pb.PutManifestRequest, context: Any
                           ) -> pb.PutManifestReply:
        await self._run(self._core.put_manifest, self._principal(context), request.manifest)
        return pb.PutManifestReply()

    async def get_manifest(self, request: pb.ManifestKey, context: Any) -> pb.GetManifestReply:
        manifest = await self._run(self._core.get_manifest, self._session_key(request, context))
        if manifest is None:
            return pb.GetManifestReply(found=False)
        return pb.GetManifestReply(found=True, manifest=manifest.encode())

    async def delete_manifest(self, request: pb.ManifestKey, context: Any) -> pb.DeleteReply:
        deleted = await self._run(self._core.delete_manifest, self._session_key(request, context))
        return pb.DeleteReply(deleted=int(bool(deleted)))

    async def stat(self, request: pb.StatRequest, context: Any) -> pb.StatReply:
        self._principal(context)
        return _stat_reply(await self._run(self._core.status))

    # -- helpers ------------------------------------------------------------------------------

    def _encode(self, block: OutgoingBlock, index: int, single: bool,
                stop: int | None = None) -> tuple[list[bytes], int]:
        """The Get messages of `block` up to byte `stop` (all of it by default), encoded
        straight from its pages (one copy), and the payload bytes they carry."""
        chunk, size = self._chunk, block.size
        # single_reply and too big for one message: no data, the client will stream it.
        first = 0 if single and size > chunk else min(size, chunk)
        messages = [encode_get_chunk(byte_range(block.pieces, 0, first), index=index,
                                     found=True, header=block.header.pack(),
                                     layers=(block.layers.start, block.layers.stop),
                                     payload_size=size)]
        if single:
            return messages, first
        end = size if stop is None else min(stop, size)
        messages += [encode_get_chunk(byte_range(block.pieces, start, min(start + chunk, end)),
                                      index=index)
                     for start in range(chunk, end, chunk)]
        return messages, end

    def _principal(self, context: Any) -> Principal:
        return self._core.authenticate(bearer_token(context.invocation_metadata()))

    def _scope(self, principal: Principal, msg: pb.Scope) -> Scope:
        return self._core.scope(principal, bytes(msg.fingerprint), msg.tenant, msg.salt)

    def _session_key(self, request: pb.ManifestKey, context: Any) -> SessionKey:
        scope = self._scope(self._principal(context), request.scope)
        return self._core.session_key(scope, request.session_id)

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)


def _stat_reply(status: ServiceStatus) -> pb.StatReply:
    c, tiers = status.counters, status.tiers
    # The lowest tier holds (nearly) everything the upper ones cache: count blocks there.
    return pb.StatReply(
        node_id=status.node_id, draining=status.draining,
        blocks=max((t.blocks for t in tiers), default=0),
        bytes_used=sum(t.bytes_used for t in tiers),
        bytes_budget=sum(t.bytes_budget for t in tiers),
        put_bytes_received=c.put_bytes_received, get_bytes_sent=c.get_bytes_sent,
        puts=c.puts, rejected_puts=c.rejected_puts, invalid_puts=c.invalid_puts,
        gets=c.gets, hits=c.hits, misses=c.misses, lookups=c.lookups,
        repaired_blocks=c.repaired_blocks, data_port=status.data_port,
        pending_writes=status.pending_writes,
        tiers=[pb.TierStat(name=t.name, blocks=t.blocks, bytes_used=t.bytes_used,
                           bytes_budget=t.bytes_budget, hits=t.hits, misses=t.misses,
                           puts=t.puts, rejected_puts=t.rejected_puts, corrupt=t.corrupt,
                           errors=t.errors) for t in tiers])


def _serialize(message: Any) -> bytes:
    return bytes(message.SerializeToString())


def _parse(cls: type[M], raw: bytes) -> M:
    try:
        return cls.FromString(raw)
    except DecodeError as exc:
        raise Refusal(RefusalReason.INVALID_ARGUMENT,
                      f"not a {cls.DESCRIPTOR.name} message: {exc}") from None
