"""Catches grpc.aio channels (and servers) left open on an event loop that has closed.

Why a test must not do that: grpc.aio has one completion queue per process, drained by
whichever live event loop is woken. When a call of a channel left on a closed loop completes
(its server stops, or the garbage collector closes the channel), the drain hands that event to
the closed loop, raises "Event loop is closed" and drops the events behind it in the same
batch. A later test's call can be among them: its future never resolves and the test hangs
until pytest-timeout (CI's hang of test_etcd_outage_is_survived). So a leak fails the test
that made it, with the stack that opened the channel, instead of hanging a test that did
nothing wrong.
"""

from __future__ import annotations

import traceback
import weakref
from typing import Any

from grpc.aio import _channel, _server  # type: ignore[import-untyped, unused-ignore]

__all__ = ["install", "leaked"]


_open: weakref.WeakSet[Any] = weakref.WeakSet()
# Leaks found when the garbage collector finalised the object, before a check could see them.
_collected: list[str] = []


def _still_open(obj: Any) -> bool:
    if isinstance(obj, _server.Server):
        return bool(obj._server.is_running())
    return not obj._channel.closed()


def _track(cls: Any, what: str) -> None:
    original_init, original_del = cls.__init__, cls.__del__

    def tracked_init(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        self._kvkeep_opened_at = f"a {what}, opened at:\n" + "".join(
            traceback.format_stack(limit=14)[:-1])
        _open.add(self)

    def tracked_del(self: Any) -> None:
        if (hasattr(self, "_kvkeep_opened_at") and self._loop.is_closed()
                and _still_open(self)):
            _collected.append(self._kvkeep_opened_at)
        original_del(self)

    tracked_init._kvkeep_tracked = True  # type: ignore[attr-defined]
    cls.__init__ = tracked_init
    cls.__del__ = tracked_del


def install() -> None:
    """Register every grpc.aio channel and server as it opens (idempotent)."""
    if getattr(_channel.Channel.__init__, "_kvkeep_tracked", False):
        return
    _track(_channel.Channel, "channel")
    _track(_server.Server, "server")


def leaked() -> list[str]:
    """Where the channels and servers still open on a closed loop were opened; each once."""
    leaks = _collected[:]
    _collected.clear()
    for obj in list(_open):
        if not _still_open(obj):
            _open.discard(obj)
        elif obj._loop.is_closed():
            _open.discard(obj)
            leaks.append(obj._kvkeep_opened_at)
    return leaks
