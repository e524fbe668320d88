"""Counts that say what the connector did and, when it fell back to recompute, why.

Each half keeps its own `Counts`; `snapshot()` returns a frozen copy that can be indexed by a
`Count` member or by its value (`snapshot[Count.LOADED_BLOCKS] == snapshot["loaded_blocks"]`):
the values are stable, dashboards and tests read them.

scheduler half
    lookups, lookup_hit_blocks       batched store lookups and the blocks they found
    lookup_deadline                  lookups that ran out of time (reported 0)
    lookup_errors                    lookups that raised (reported 0)
    restore_none                     requests that asked for no restore
    partial_layer_unusable           `{"layers": [a, b]}` hints that cannot be used (see docs)
    bad_params                       malformed kv_transfer_params (ignored)
    restores_hinted                  requests the router sent with a `restore_reason` (their
                                     session's KV is elsewhere: they get the longer deadline)
    hinted_blocks_missing            blocks such a request's lookup did not find in the store
                                     (a failover that finds less than its prefix recomputes it)
    manifests_written, manifest_errors
    published_blocks                 blocks announced in KV events (see `scheduler_side`), counted
                                     once per event that carries them
    decided_restore, decided_recompute, decided_partial
                                     lookups with a hit, by what the restore-or-recompute
                                     decision (`restore_cost`) made of it: load all of it,
                                     none, or a shorter prefix
    decided_restore_tokens           stored tokens the decision chose to load
    decided_recompute_tokens         stored tokens it chose to compute instead (cheaper)
    async_loads                      restores loaded outside the forward pass (`load_mode`:
                                     "async", or "auto" with blocks on a network tier)
worker half
    loaded_blocks                    blocks restored into the paged cache, verified
    load_missing                     blocks the store no longer had (evicted, deleted)
    load_corrupt                     blocks whose frame failed verification or did not decode
    load_mismatch                    frames for another codec, dtype, layout or shape
    load_forged                      frames without a valid MAC under `mac_key_file`
    load_late                        blocks past the restore deadline
    load_errors                      other failures of a load (store down, bug)
    saved_blocks, save_skipped_present, save_failed, save_dropped_after_load_error,
    save_backpressure                saves not attempted because too many were in flight
    durable_blocks                   with `durability`: blocks held by R daemons before the step
                                     that completed them returned (saved so, or found so)
    durable_missed                   with `durability`: blocks a step returned without (deadline,
                                     too few daemons, refused, skipped): not durable then
    save_wait_us                     without `durability`: microseconds steps waited for their
                                     saves (0 unless `save_timeout_ms` > 0 asks them to)
    durable_wait_us                  with `durability`: microseconds steps waited for it (the
                                     latency the setting costs; the lag itself is the store's
                                     `kvkeep_store_copy_lag_seconds{tier="remote"}`, on vLLM's
                                     /metrics `kvkeep_connector_store_copy_lag_seconds`)
    manifests_written, manifest_errors  (manifests the scheduler handed over in step metadata)
    prefetch_hints, prefetch_blocks  failover hints taken, blocks pulled into host RAM by them
    prefetch_present, prefetch_missing, prefetch_skipped, prefetch_errors
                                     blocks already there, not found; hints stale, repeated or
                                     over the queue; failures (`connectors.vllm.prefetch`)
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

__all__ = ["Count", "Counts", "CountSnapshot", "LOAD_FAILURES"]


class Count(enum.StrEnum):
    """What the connector counts (named `Count`, not `Counter`: prometheus_client's `Counter`
    is the metric type these are exported as, `connectors/vllm/prometheus.py`)."""

    LOOKUPS = "lookups"
    LOOKUP_HIT_BLOCKS = "lookup_hit_blocks"
    LOOKUP_DEADLINE = "lookup_deadline"
    LOOKUP_ERRORS = "lookup_errors"
    RESTORE_NONE = "restore_none"
    PARTIAL_LAYER_UNUSABLE = "partial_layer_unusable"
    BAD_PARAMS = "bad_params"
    RESTORES_HINTED = "restores_hinted"
    HINTED_BLOCKS_MISSING = "hinted_blocks_missing"
    MANIFESTS_WRITTEN = "manifests_written"
    MANIFEST_ERRORS = "manifest_errors"
    PUBLISHED_BLOCKS = "published_blocks"
    DECIDED_RESTORE = "decided_restore"
    DECIDED_RECOMPUTE = "decided_recompute"
    DECIDED_PARTIAL = "decided_partial"
    DECIDED_RESTORE_TOKENS = "decided_restore_tokens"
    DECIDED_RECOMPUTE_TOKENS = "decided_recompute_tokens"
    ASYNC_LOADS = "async_loads"
    LOADED_BLOCKS = "loaded_blocks"
    LOAD_MISSING = "load_missing"
    LOAD_CORRUPT = "load_corrupt"
    LOAD_MISMATCH = "load_mismatch"
    LOAD_FORGED = "load_forged"
    LOAD_LATE = "load_late"
    LOAD_ERRORS = "load_errors"
    SAVED_BLOCKS = "saved_blocks"
    SAVE_SKIPPED_PRESENT = "save_skipped_present"
    SAVE_FAILED = "save_failed"
    SAVE_DROPPED_AFTER_LOAD_ERROR = "save_dropped_after_load_error"
    SAVE_BACKPRESSURE = "save_backpressure"
    DURABLE_BLOCKS = "durable_blocks"
    DURABLE_MISSED = "durable_missed"
    DURABLE_WAIT_US = "durable_wait_us"
    SAVE_WAIT_US = "save_wait_us"
    PREFETCH_HINTS = "prefetch_hints"
    PREFETCH_BLOCKS = "prefetch_blocks"
    PREFETCH_PRESENT = "prefetch_present"
    PREFETCH_MISSING = "prefetch_missing"
    PREFETCH_SKIPPED = "prefetch_skipped"
    PREFETCH_ERRORS = "prefetch_errors"


LOAD_FAILURES = frozenset({Count.LOAD_MISSING, Count.LOAD_CORRUPT, Count.LOAD_MISMATCH,
                           Count.LOAD_FORGED, Count.LOAD_LATE, Count.LOAD_ERRORS})
"""The reasons a block fails to load (each is also the counter that counts it)."""


@dataclass(frozen=True, slots=True)
class CountSnapshot:
    """Counts by name; a `Count` member is its name (a `StrEnum`). Names beyond the
    enum (the store's `store_*`, `tier_*`, added by the connector) read the same way."""

    values: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))

    def __getitem__(self, name: str) -> int:
        return self.values.get(str(name), 0)

    def as_dict(self) -> dict[str, int]:
        return dict(self.values)


class Counts:
    """Thread-safe counters (loader and saver threads count too)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, int] = {}

    def add(self, counter: Count, amount: int = 1) -> None:
        if amount:
            name = counter.value
            with self._lock:
                self._values[name] = self._values.get(name, 0) + amount

    def snapshot(self) -> CountSnapshot:
        with self._lock:
            return CountSnapshot(MappingProxyType(dict(self._values)))
