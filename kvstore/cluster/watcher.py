"""One prefix watcher for every membership view (daemons, workers) and table (session
bindings) kept from etcd.

It lists the prefix, then watches from the listed revision; after any failure (etcd restarted,
a reset stream, a compacted revision) it backs off and lists again, so a missed event never
leaves a stale view for longer than one reconnect; with `resync_s` it also re-lists whenever the
watch has been silent that long (a safety net against a silently stuck stream).

Every record passes through `decode` first, and nothing a record holds can stop the watch:
- `decode` gets the record with the name its key gives and must return the item or raise;
  `UntrustedRegistration` is counted under its reason, any other exception (deep nesting's
  `RecursionError`, a mistyped field's `AttributeError`) under "malformed". Either way the
  record is skipped, counted once per key and revision, and logged once.
- `require_lease`: a record not attached to a lease is skipped ("no-lease"). etcd deletes a
  key when its lease ends, so a record that carries a lease is one whose lease is alive; a
  lease-less one lives forever and was written by hand, not by a registrar.
- `exclusive`: the identities (addresses) an item claims; a second name claiming one held by
  another member is skipped ("duplicate") and held back until the holder leaves. The oldest
  registration (by creation revision) wins a listing.
- An item the sink raises on is logged and counted ("sink-error"), never fatal.

Departures: a name whose key vanished (a delete, or a re-listing without it) leaves only once
`grace_s` passed without it coming back: when etcd stalls past the leases' TTL it expires
every lease at once on resuming, and every live registrar writes its key again within TTL/3;
acting on those deletes would drop every healthy member for that moment. A record replaced by
one that fails the checks is not a departure to wait for: its name goes at once.

With a grace or `exclusive` the watcher keeps the current items (a few thousand members at
most); without (session bindings: up to millions) it keeps nothing and the sink's `reset`
does the diff.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable, Hashable, Iterable, Mapping
from typing import Any, Generic, Protocol, TypeVar

from kvstore.cluster.clients import ClientSource
from kvstore.cluster.records import EtcdRecord
from kvstore.cluster.retry import LOOP_RETRY, Backoff, RetryPolicy
from kvstore.errors import UntrustedRegistration

__all__ = ["PrefixWatcher", "WatchSink", "ThreadedWatch"]

T = TypeVar("T")
T_contra = TypeVar("T_contra", contravariant=True)

_log = logging.getLogger(__name__)
_END = object()  # the watch stream ended
_REMEMBERED = 4096  # (key, revision) pairs already counted and logged
_MAX_HELD = 1024  # duplicate claims kept aside, waiting for their identity's holder to leave


class WatchSink(Protocol[T_contra]):
    def reset(self, items: Mapping[str, T_contra]) -> None: ...

    def put(self, name: str, item: T_contra) -> None: ...

    def delete(self, name: str, revision: int) -> None: ...


class PrefixWatcher(Generic[T]):
    """Feeds `sink` the items registered under `prefix` (asyncio, one loop)."""

    def __init__(self, clients: ClientSource, prefix: bytes,
                 decode: Callable[[EtcdRecord], T], sink: WatchSink[T], *,
                 what: str = "record", require_lease: bool = False, grace_s: float = 0.0,
                 resync_s: float | None = None,
                 exclusive: Callable[[T], Iterable[Hashable]] | None = None,
                 retry: RetryPolicy = LOOP_RETRY, timeout: float = 2.0,
                 on_reject: Callable[[str], None] | None = None) -> None:
        self._clients = clients
        self._prefix = prefix
        self._decode = decode
        self._sink = sink
        self._what = what
        self._require_lease = require_lease
        self._grace = grace_s
        self._resync = resync_s
        self._exclusive = exclusive
        self._retry = retry
        self._timeout = timeout
        self._on_reject = on_reject
        self._tracked = grace_s > 0 or exclusive is not None
        self._items: dict[str, T] = {}
        self._claims: dict[Hashable, str] = {}  # identity -> the member holding it
        self._held: dict[str, tuple[EtcdRecord, T]] = {}  # duplicates waiting for a holder
        self._leaving: dict[str, asyncio.TimerHandle] = {}
        self._counted: OrderedDict[tuple[bytes, int], None] = OrderedDict()
        self.rejected: Counter[str] = Counter()
        """Records skipped, by reason (each key and revision counted once)."""
        self.synced = asyncio.Event()
        """Set once the first listing succeeded."""

    @property
    def prefix(self) -> bytes:
        return self._prefix

    async def run(self) -> None:
        """List and watch until cancelled; nothing but a cancellation ends it."""
        backoff = Backoff(self._retry)
        try:
            while True:
                client = await self._clients.acquire()
                # Bound before the try: a cancellation skips both assignments below, and an
                # unbound name here raised inside the release (swallowed by its suppress), so a
                # cancelled watcher never closed its client (tests/grpc_leaks.py found it).
                failed = False
                try:
                    await self._list_and_watch(client, backoff)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # aetcd's own tree, raw grpc errors, OSError alike
                    failed = True
                    _log.info("etcd watch on %s broke (%s: %s); re-listing",
                              self._prefix.decode(errors="replace"), type(exc).__name__, exc)
                finally:
                    with contextlib.suppress(Exception):
                        await self._clients.release(
                            client, failures=backoff.failures + 1 if failed else 0)
                await backoff.wait()
        finally:
            for timer in self._leaving.values():
                timer.cancel()
            self._leaving.clear()

    # --- listing and watching ------------------------------------------------------------
    async def _list_and_watch(self, client: Any, backoff: Backoff) -> None:
        revision = await self._relist(client)
        watch = await client.watch_prefix(self._prefix, start_revision=revision + 1)
        backoff.reset()
        # A pump task moves events into a queue, so that waiting for the next event can time
        # out (to re-list) without cancelling, and so closing, aetcd's event iterator.
        events: asyncio.Queue[Any] = asyncio.Queue()

        async def pump() -> None:
            try:
                async for event in watch:
                    events.put_nowait(event)
                events.put_nowait(_END)
            except Exception as exc:  # the watch broke: hand the error to the reader
                events.put_nowait(exc)

        pumper = asyncio.create_task(pump())
        try:
            while True:
                try:
                    # asyncio.timeout, not wait_for (which can swallow a cancellation on 3.11).
                    async with asyncio.timeout(self._resync):
                        event = await events.get()
                except TimeoutError:
                    revision = await self._relist(client)
                    continue
                if event is _END:
                    return
                if isinstance(event, Exception):
                    raise event
                record = EtcdRecord.of(self._prefix, event.kv)
                if record.mod_revision and record.mod_revision <= revision:
                    continue  # already in the listing
                revision = max(revision, record.mod_revision)
                if event.kind == "PUT":
                    self._on_put(record)
                else:
                    self._on_delete(record)
        finally:
            pumper.cancel()
            with contextlib.suppress(Exception):
                async with asyncio.timeout(self._timeout):
                    await watch.cancel()

    async def _relist(self, client: Any) -> int:
        listing = await client.get_prefix(self._prefix)
        records = sorted((EtcdRecord.of(self._prefix, kv) for kv in listing),
                         key=lambda r: (r.create_revision, r.key))
        fresh: dict[str, T] = {}
        claims: dict[Hashable, str] = {}
        self._held.clear()
        listed: set[str] = set()
        for record in records:
            listed.add(record.name)
            item = self._admit(record)
            if item is None:
                continue
            if self._tracked:
                idents = self._identities(item)
                if any(claims.get(i, record.name) != record.name for i in idents):
                    self._hold(record, item, claims)
                    continue
                claims.update((i, record.name) for i in idents)
                self._cancel_departure(record.name)
            fresh[record.name] = item
        if self._tracked:
            for name, item in self._items.items():
                if name not in listed and self._defer_departure(name):
                    fresh[name] = item  # absent from this listing: leaves after the grace
                    claims.update((i, name) for i in self._identities(item))
            self._items, self._claims = fresh, claims
        self._call(self._sink.reset, fresh)
        self.synced.set()
        return int(listing.header.revision)

    # --- events --------------------------------------------------------------------------
    def _on_put(self, record: EtcdRecord) -> None:
        name = record.name
        self._held.pop(name, None)
        item = self._admit(record)
        if item is None:  # replaced by a value that fails the checks: gone at once
            if not self._tracked:
                self._call(self._sink.delete, name, record.mod_revision)
            elif name in self._items:
                self._cancel_departure(name)
                self._remove(name, record.mod_revision)
            return
        if not self._tracked:
            self._call(self._sink.put, name, item)
            return
        idents = self._identities(item)
        if any(self._claims.get(i, name) != name for i in idents):
            if name in self._items:  # moved onto another member's identity
                self._cancel_departure(name)
                self._remove(name, record.mod_revision)
            self._hold(record, item, self._claims)
            return
        self._cancel_departure(name)
        self._set(name, item)

    def _on_delete(self, record: EtcdRecord) -> None:
        name = record.name
        self._held.pop(name, None)
        if not self._tracked:
            self._call(self._sink.delete, name, record.mod_revision)
        elif name in self._items and not self._defer_departure(name):
            self._remove(name, record.mod_revision)

    # --- members -------------------------------------------------------------------------
    def _set(self, name: str, item: T) -> None:
        old = self._items.get(name)
        if old is not None:
            for ident in self._identities(old):
                if self._claims.get(ident) == name:
                    del self._claims[ident]
        self._items[name] = item
        self._claims.update((i, name) for i in self._identities(item))
        self._call(self._sink.put, name, item)
        if old is not None:
            self._readmit_held()

    def _remove(self, name: str, revision: int) -> None:
        item = self._items.pop(name, None)
        if item is None:
            return
        for ident in self._identities(item):
            if self._claims.get(ident) == name:
                del self._claims[ident]
        self._call(self._sink.delete, name, revision)
        self._readmit_held()

    def _hold(self, record: EtcdRecord, item: T, claims: Mapping[Hashable, str]) -> None:
        if len(self._held) >= _MAX_HELD and record.name not in self._held:
            # An etcd writer can make any number of aliases: past the cap the newest are not
            # kept (the next listing reconsiders them), so they cannot exhaust memory.
            self._held.pop(max(self._held, key=lambda n: self._held[n][0].create_revision))
        self._held[record.name] = (record, item)
        holder = next((claims[i] for i in self._identities(item) if i in claims), "?")
        self._reject(record, UntrustedRegistration(
            "duplicate", f"{record.name} claims an address {holder} already registers"))

    def _readmit_held(self) -> None:
        """A member left or moved: the oldest held-back claim on its identity may come in."""
        for name, (_record, item) in sorted(self._held.items(),
                                            key=lambda e: e[1][0].create_revision):
            if all(self._claims.get(i, name) == name for i in self._identities(item)):
                del self._held[name]
                self._set(name, item)

    def _identities(self, item: T) -> tuple[Hashable, ...]:
        return () if self._exclusive is None else tuple(self._exclusive(item))

    # --- departures ----------------------------------------------------------------------
    def _defer_departure(self, name: str) -> bool:
        """Start (or keep running) the grace of a member whose key vanished; False when it is
        no member or there is no grace (then it goes now)."""
        if self._grace <= 0 or name not in self._items:
            return False
        if name not in self._leaving:
            self._leaving[name] = asyncio.get_running_loop().call_later(
                self._grace, self._depart, name)
        return True

    def _cancel_departure(self, name: str) -> None:
        if (timer := self._leaving.pop(name, None)) is not None:
            timer.cancel()

    def _depart(self, name: str) -> None:
        self._leaving.pop(name, None)
        self._remove(name, 0)

    # --- checks --------------------------------------------------------------------------
    def _admit(self, record: EtcdRecord) -> T | None:
        """The item `record` registers if it passes every check; else None (counted)."""
        try:
            item = self._decode(record)  # first: a forgery is counted as what it fails
            if self._require_lease and not record.lease:
                raise UntrustedRegistration(
                    "no-lease", f"{record.name}: not attached to a lease (written by hand?)")
            return item
        except UntrustedRegistration as exc:
            self._reject(record, exc)
        except Exception as exc:  # the decoder's bug or a value it did not foresee: skipped
            self._reject(record, UntrustedRegistration(
                "malformed", f"{record.name}: {type(exc).__name__}: {str(exc)[:200]}"))
        return None

    def _reject(self, record: EtcdRecord, exc: UntrustedRegistration) -> None:
        mark = (record.key, record.mod_revision)
        if mark in self._counted:  # seen before (a re-list): no second count
            return
        self._counted[mark] = None
        if len(self._counted) > _REMEMBERED:
            self._counted.popitem(last=False)
        self.rejected[exc.reason] += 1
        if self._on_reject is not None:
            with contextlib.suppress(Exception):
                self._on_reject(exc.reason)
        _log.warning("ignoring registration %r (a %s): %s", record.key[:200], self._what, exc)

    def _call(self, fn: Callable[..., None], *args: Any) -> None:
        try:
            fn(*args)
        except Exception:  # the sink's bug on one item must not stop the watch
            self.rejected["sink-error"] += 1
            if self._on_reject is not None:
                with contextlib.suppress(Exception):
                    self._on_reject("sink-error")
            _log.exception("%s sink failed on %s", self._what, fn.__name__)


class _Watch(Protocol):
    @property
    def synced(self) -> asyncio.Event: ...

    async def run(self) -> None: ...


class ThreadedWatch:
    """A `PrefixWatcher` (or a view built on one, like daemon membership) on an event loop of
    its own, on a daemon thread: for synchronous users (the remote tier's daemon discovery, the
    vLLM connector's prefetch hints)."""

    def __init__(self, watcher: _Watch, name: str) -> None:
        self._watcher = watcher
        self._loop = asyncio.new_event_loop()
        self._task: asyncio.Task[None] | None = None
        started = threading.Event()
        self._thread = threading.Thread(target=self._main, args=(started,), name=name,
                                        daemon=True)
        self._thread.start()
        started.wait()

    def wait_synced(self, timeout: float) -> bool:
        """Wait until the first listing arrived; False if it did not within `timeout`."""
        future = asyncio.run_coroutine_threadsafe(
            asyncio.wait_for(self._watcher.synced.wait(), timeout), self._loop)
        try:
            future.result(timeout + 1.0)
        except TimeoutError:
            return False
        return True

    def close(self, timeout: float = 5.0) -> None:
        if self._task is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._task.cancel)
        self._thread.join(timeout)

    def _main(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        self._task = self._loop.create_task(self._watcher.run())
        started.set()
        with contextlib.suppress(asyncio.CancelledError):
            self._loop.run_until_complete(self._task)
        # The watch stream is an async generator: closed here, not left to the loop's
        # collection (which logs it as a task destroyed while pending).
        self._loop.run_until_complete(self._loop.shutdown_asyncgens())
        self._loop.close()
