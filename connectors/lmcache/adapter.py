"""The LMCache-facing half of the plugin: an LMCache 0.5 L2 adapter over `ObjectStore`.

    --l2-adapter '{"type": "plugin", "module_path": "connectors.lmcache.adapter",
                   "class_name": "KVKeepL2Adapter",
                   "adapter_params": {"etcd": "http://etcd:2379", "tenant": "team-a",
                                      "token_file": "/etc/kvkeep/token"}}'

LMCache finds `KVKeepL2AdapterConfig` by its name (class name + "Config"), parses
`adapter_params` with it (connectors/lmcache/config.py) and hands the adapter the result.
This module only translates: LMCache's keys and memory objects in, its task ids, event fds,
bitmaps and store results out. Tasks run on two small thread pools, one for stores and one for
lookups and loads (LMCache's store and prefetch controllers call from separate threads and
must not wait on each other); every task completes, failed or not, so LMCache never waits on
one forever.

Locks are client side, as in LMCache's native RESP adapter: kvkeep daemons evict on their own
budget and know nothing of LMCache's locks. An object evicted between lookup and load is a
load miss (LMCache recomputes), never wrong bytes.

Importing this module needs LMCache (and torch); everything else of the plugin does not.
"""

from __future__ import annotations

import logging
import threading
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from lmcache.lmcache_native import Bitmap  # type: ignore[import-not-found, unused-ignore]
from lmcache.v1.distributed.api import (  # type: ignore[import-not-found, unused-ignore]
    MemoryLayoutDesc,
    ObjectKey,
)
from lmcache.v1.distributed.internal_api import (  # type: ignore[import-not-found, unused-ignore]
    L2StoreResult,
)
from lmcache.v1.distributed.l2_adapters.base import (  # type: ignore[import-not-found, unused-ignore]
    L2AdapterInterface,
    L2TaskId,
)
from lmcache.v1.distributed.l2_adapters.config import (  # type: ignore[import-not-found, unused-ignore]
    L2AdapterConfigBase,
)
from lmcache.v1.memory_management import MemoryObj  # type: ignore[import-not-found, unused-ignore]
from lmcache.v1.platform import create_event_notifier  # type: ignore[import-not-found, unused-ignore]

from connectors.lmcache import config as _config_module
from connectors.lmcache.config import PluginSettings
from connectors.lmcache.store import ObjectStore

__all__ = ["KVKeepL2Adapter", "KVKeepL2AdapterConfig"]

_log = logging.getLogger(__name__)


class KVKeepL2AdapterConfig(L2AdapterConfigBase):  # type: ignore[misc, unused-ignore]
    """LMCache's config object for the plugin: the validated `PluginSettings`."""

    def __init__(self, settings: PluginSettings) -> None:
        self.settings = settings

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> KVKeepL2AdapterConfig:
        return cls(PluginSettings.from_params(d))

    @classmethod
    def help(cls) -> str:
        return _config_module.__doc__ or ""


class KVKeepL2Adapter(L2AdapterInterface):  # type: ignore[misc, unused-ignore]
    """LMCache objects stored in kvkeep daemons. Thread-safe."""

    def __init__(self, config: KVKeepL2AdapterConfig | dict[str, Any], **_kwargs: object
                 ) -> None:
        # LMCache passes the config object, or the raw dict when built without one; extra
        # keyword arguments (l1_memory_desc) are for adapters that register L1 memory.
        settings = (config.settings if isinstance(config, KVKeepL2AdapterConfig)
                    else PluginSettings.from_params(config))
        super().__init__(max_capacity_bytes=settings.max_capacity_bytes)
        self._settings = settings
        self._objects = ObjectStore.open(settings)
        self._store_efd = create_event_notifier()
        self._lookup_efd = create_event_notifier()
        self._load_efd = create_event_notifier()
        self._store_pool = ThreadPoolExecutor(1, thread_name_prefix="kvkeep-l2-store")
        self._read_pool = ThreadPoolExecutor(2, thread_name_prefix="kvkeep-l2-read")
        self._lock = threading.Lock()
        self._next_id: L2TaskId = 0
        self._stores: dict[L2TaskId, L2StoreResult] = {}
        self._lookups: dict[L2TaskId, Bitmap] = {}
        self._loads: dict[L2TaskId, Bitmap] = {}
        self._locks: dict[ObjectKey, int] = defaultdict(int)
        self._sizes: dict[ObjectKey, int] = {}
        """Bytes of each object this adapter stored, for LMCache's usage accounting."""
        self._closed = False

    # -- event fds ------------------------------------------------------------------------

    def get_store_event_fd(self) -> int:
        return int(self._store_efd.fileno())

    def get_lookup_and_lock_event_fd(self) -> int:
        return int(self._lookup_efd.fileno())

    def get_load_event_fd(self) -> int:
        return int(self._load_efd.fileno())

    # -- store ----------------------------------------------------------------------------

    def submit_store_task(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2TaskId:
        task = self._task_id()
        self._submit(self._store_pool, self._store, task, list(keys), list(objects))
        return task

    def pop_completed_store_tasks(self) -> dict[L2TaskId, L2StoreResult]:
        with self._lock:
            done, self._stores = self._stores, {}
        return done

    # -- lookup and lock ------------------------------------------------------------------

    def submit_lookup_and_lock_task(self, keys: list[ObjectKey],
                                    group_layout_descs: dict[int, MemoryLayoutDesc]
                                    ) -> L2TaskId:
        # The layout hint is for adapters that forward it (P2P); stored objects carry theirs.
        task = self._task_id()
        self._submit(self._read_pool, self._lookup, task, list(keys))
        return task

    def query_lookup_and_lock_result(self, task_id: L2TaskId) -> Bitmap | None:
        with self._lock:
            return self._lookups.pop(task_id, None)

    def submit_unlock(self, keys: list[ObjectKey]) -> None:
        with self._lock:
            for key in keys:
                count = self._locks.get(key, 0)
                if count <= 1:
                    self._locks.pop(key, None)
                else:
                    self._locks[key] = count - 1

    # -- load -----------------------------------------------------------------------------

    def submit_load_task(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2TaskId:
        task = self._task_id()
        self._submit(self._read_pool, self._load, task, list(keys), list(objects))
        return task

    def query_load_result(self, task_id: L2TaskId) -> Bitmap | None:
        with self._lock:
            return self._loads.pop(task_id, None)

    # -- eviction, status, close ------------------------------------------------------------

    def delete(self, keys: list[ObjectKey]) -> None:
        """Remove objects from the daemons (LMCache's L2 eviction); best effort, never raises.

        Every object this adapter accounted for leaves its usage once the delete went through,
        held or not: a daemon may have evicted it on its own budget already, and usage that
        never shrank would make LMCache's eviction ask again forever.
        """
        if not keys or self._closed:
            return
        try:
            outcome = self._objects.delete(keys)
        except Exception:
            _log.exception("kvkeep LMCache plugin: delete failed")
            return
        if outcome is None:
            return
        gone: list[ObjectKey] = []
        sizes: list[int] = []
        with self._lock:
            for key in keys:
                size = self._sizes.pop(key, None)
                if size is not None:
                    gone.append(key)
                    sizes.append(size)
        if gone:
            self._notify_keys_deleted(gone, sizes)

    def debug_has_key(self, key: ObjectKey) -> bool:
        """Whether the daemons hold `key`, asked synchronously: the hook LMCache's
        storage-manager tests poll on an adapter (its mock has the same)."""
        return not self._closed and self._objects.lookup([key]) == [True]

    def report_status(self) -> dict[str, Any]:
        return {"is_healthy": (not self._closed) and self._objects.healthy(),
                "type": "KVKeepL2Adapter", "tenant": self._settings.tenant,
                "model_revision": self._settings.model_revision,
                "daemons": self._objects.daemons(), "objects": self._objects.counters()}

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._store_pool.shutdown(wait=True)
        self._read_pool.shutdown(wait=True)
        self._objects.close()
        for notifier in (self._store_efd, self._lookup_efd, self._load_efd):
            notifier.close()

    # -- tasks (on the pools) ---------------------------------------------------------------

    def _store(self, task: L2TaskId, keys: list[ObjectKey], objects: list[MemoryObj]) -> None:
        result = L2StoreResult(False, 0)
        try:
            payloads = [obj.byte_array for obj in objects]
            outcome = self._objects.store(keys, payloads)
            fresh: list[ObjectKey] = []
            sizes: list[int] = []
            with self._lock:
                for key, payload, written in zip(keys, payloads, outcome.written, strict=True):
                    if written and key not in self._sizes:
                        self._sizes[key] = len(payload)
                        fresh.append(key)
                        sizes.append(len(payload))
            result = L2StoreResult(outcome.ok, sum(sizes))
            if fresh:
                self._notify_keys_stored(fresh, sizes)
        except Exception:
            _log.exception("kvkeep LMCache plugin: store task %d failed", task)
        finally:
            with self._lock:
                self._stores[task] = result
            self._store_efd.notify()

    def _lookup(self, task: L2TaskId, keys: list[ObjectKey]) -> None:
        bitmap = Bitmap(len(keys))
        try:
            found = self._objects.lookup(keys)
            with self._lock:
                for i, (key, hit) in enumerate(zip(keys, found, strict=True)):
                    if hit:
                        bitmap.set(i)
                        self._locks[key] += 1
        except Exception:
            _log.exception("kvkeep LMCache plugin: lookup task %d failed", task)
            bitmap = Bitmap(len(keys))
        finally:
            with self._lock:
                self._lookups[task] = bitmap
            self._lookup_efd.notify()

    def _load(self, task: L2TaskId, keys: list[ObjectKey], objects: list[MemoryObj]) -> None:
        bitmap = Bitmap(len(keys))
        try:
            loaded = self._objects.load(keys,
                                        [obj.byte_array for obj in objects])
            hits = [key for key, ok in zip(keys, loaded, strict=True) if ok]
            for i, ok in enumerate(loaded):
                if ok:
                    bitmap.set(i)
            if hits:
                self._notify_keys_accessed(hits)
        except Exception:
            _log.exception("kvkeep LMCache plugin: load task %d failed", task)
            bitmap = Bitmap(len(keys))
        finally:
            with self._lock:
                self._loads[task] = bitmap
            self._load_efd.notify()

    # -- helpers ----------------------------------------------------------------------------

    def _task_id(self) -> L2TaskId:
        with self._lock:
            task = self._next_id
            self._next_id += 1
            return task

    def _submit(self, pool: ThreadPoolExecutor, fn: Callable[..., None], task: L2TaskId,
                *args: Any) -> None:
        if self._closed:
            raise RuntimeError("the kvkeep L2 adapter is closed")
        pool.submit(fn, task, *args)
