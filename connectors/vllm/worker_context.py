"""What the loader and the saver share: the store, the registered caches, the model's
fingerprint and codec, where results go (`WorkerOutbox`), the worker half's counters and
timings, and the tenant's MAC key when it has one (saves are signed, loads refuse frames not
signed with it)."""

from __future__ import annotations

from dataclasses import dataclass, field

from connectors.vllm.caches import PagedCaches
from connectors.vllm.outbox import WorkerOutbox
from connectors.vllm.stats import Counts
from connectors.vllm.telemetry import Telemetry
from kvstore.frame import CodecId
from kvstore.keys import ModelFingerprint
from kvstore.mac import MacKey
from kvstore.store import TieredStore

__all__ = ["WorkerContext"]


@dataclass(frozen=True, slots=True)
class WorkerContext:
    store: TieredStore
    caches: PagedCaches
    fingerprint: ModelFingerprint
    codec: CodecId
    outbox: WorkerOutbox
    counters: Counts
    mac_key: MacKey | None = None
    telemetry: Telemetry = field(default_factory=Telemetry)
