"""Counters that say what the connector did and, when it fell back to recompute, why.

Each half keeps its own `Counters`; `snapshot()` returns a frozen copy. The names are stable
(tests and dashboards read them):

scheduler half
    lookups, lookup_hit_blocks       batched store lookups and the blocks they found
    lookup_deadline                  lookups that ran out of time (reported 0)
    lookup_errors                    lookups that raised (reported 0)
    restore_none                     requests that asked for no restore
    partial_layer_unusable           `{"layers": [a, b]}` hints that cannot be used (see docs)
    bad_params                       malformed kv_transfer_params (ignored)
    manifests_written, manifest_errors
    published_blocks                 blocks announced in KV events (see `scheduler`), counted
                                     once per event that carries them
worker half
    loaded_blocks                    blocks restored into the paged cache, verified
    load_missing                     blocks the store no longer had (evicted, deleted)
    load_corrupt                     blocks whose frame failed verification or did not decode
    load_mismatch                    frames for another codec, dtype, layout or shape
    load_late                        blocks past the restore deadline
    load_errors                      other failures of a load (store down, bug)
    saved_blocks, save_skipped_present, save_failed, save_dropped_after_load_error,
    save_backpressure                saves not attempted because too many were in flight
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

__all__ = ["Counters", "CounterSnapshot"]


@dataclass(frozen=True, slots=True)
class CounterSnapshot:
    values: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))

    def __getitem__(self, name: str) -> int:
        return self.values.get(name, 0)

    def as_dict(self) -> dict[str, int]:
        return dict(self.values)


class Counters:
    """Thread-safe named counters (loader and saver threads count too)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: Counter[str] = Counter()

    def add(self, name: str, amount: int = 1) -> None:
        if amount:
            with self._lock:
                self._values[name] += amount

    def snapshot(self) -> CounterSnapshot:
        with self._lock:
            return CounterSnapshot(MappingProxyType(dict(self._values)))
