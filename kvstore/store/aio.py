"""`AsyncTieredStore`: a `TieredStore`'s calls for asyncio code, each run in a worker thread.

Tiers are synchronous (see `kvstore.tiers.base`), so every call hops to the default executor
(`asyncio.to_thread`). A call that takes a deadline gets it fixed before the hop, so time spent
queueing for a thread counts against it. Each method has the signature of the store's method of
the same name (`in_thread` keeps it, for mypy too).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
from collections.abc import Callable, Coroutine
from typing import Any, Concatenate, ParamSpec, TypeVar

from kvstore.store.facade import TieredStore

__all__ = ["AsyncTieredStore"]

P = ParamSpec("P")
R = TypeVar("R")


def in_thread(method: Callable[Concatenate[TieredStore, P], R]
              ) -> Callable[Concatenate[AsyncTieredStore, P], Coroutine[Any, Any, R]]:
    """`method` of the wrapped store, awaited in a worker thread."""
    takes_deadline = "deadline" in inspect.signature(method).parameters

    @functools.wraps(method)
    async def call(self: AsyncTieredStore, /, *args: P.args, **kwargs: P.kwargs) -> R:
        if takes_deadline:
            kwargs["deadline"] = self.store.deadline(kwargs.get("deadline"))  # type: ignore[arg-type]
        return await asyncio.to_thread(method, self.store, *args, **kwargs)

    return call


class AsyncTieredStore:
    """Awaitable get/put/lookup/delete/manifests/flush/close of one `TieredStore`."""

    def __init__(self, store: TieredStore) -> None:
        self.store = store

    get = in_thread(TieredStore.get)
    get_many = in_thread(TieredStore.get_many)
    put = in_thread(TieredStore.put)
    put_many = in_thread(TieredStore.put_many)
    lookup = in_thread(TieredStore.lookup)
    delete = in_thread(TieredStore.delete)
    put_manifest = in_thread(TieredStore.put_manifest)
    get_manifest = in_thread(TieredStore.get_manifest)
    get_record = in_thread(TieredStore.get_record)
    delete_manifest = in_thread(TieredStore.delete_manifest)
    flush = in_thread(TieredStore.flush)
    close = in_thread(TieredStore.close)
