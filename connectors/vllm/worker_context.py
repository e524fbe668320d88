"""What the loader and the saver share: the store, the registered caches, the model's
fingerprint and codec, where results go (`WorkerOutbox`) and the worker half's counters and
timings."""

from __future__ import annotations

from dataclasses import dataclass, field

from connectors.vllm.caches import PagedCaches
from connectors.vllm.outbox import WorkerOutbox
from connectors.vllm.stats import Counters
from connectors.vllm.telemetry import Telemetry
from kvstore.frame import CodecId
from kvstore.keys import ModelFingerprint
from kvstore.store import TieredStore

__all__ = ["WorkerContext"]


@dataclass(frozen=True, slots=True)
class WorkerContext:
    store: TieredStore
    caches: PagedCaches
    fingerprint: ModelFingerprint
    codec: CodecId
    outbox: WorkerOutbox
    counters: Counters
    telemetry: Telemetry = field(default_factory=Telemetry)
