"""vLLM's sleep mode (0.33's `unregister_kv_caches` / `restore_kv_caches`), the connector's side.

What vLLM 0.33 does (`vllm/v1/engine/core.py: sleep`, `vllm/v1/worker/gpu_worker.py`): it pauses
the scheduler (aborting or keeping the requests), synchronizes the device, and then each worker
calls `unregister_kv_caches` right before its sleep-mode allocator unmaps the KV cache's memory
(level 1 and 2 discard its contents; `release_kv_cache_memory` discards it alone); on wake-up it
maps the same virtual addresses again (the tensors vLLM registered stay the same objects, their
contents gone) and calls `restore_kv_caches`. vLLM drains its own work; the connector's threads
are ours to drain: an asynchronous load scattering into the cache after the unmap would fault
or, once remapped, write into memory vLLM has handed to something else.

So, before sleep: the gate closes (no step plans a save, gathers a layer or starts a load), the
loads in flight get `SLEEP_DRAIN_S` to end and are then cancelled (nothing is written after a
cancel), and the saver thread gets as long to put what it has (it encodes gathered copies, never
the paged cache, so a save still running afterwards is harmless). While asleep: lookups answer
0 blocks (the worker's probe answers, and the scheduler half's own lookups in this process),
loads fail (vLLM recomputes), saves report failed (the scheduler plans them again) and
finished requests are released without a flush. After wake-up the caches are registered again
and everything resumes.
"""

from __future__ import annotations

import threading
from collections import Counter as Multiset

from connectors.vllm.config import StoreSpec
from connectors.vllm.metadata import (
    LoadReport,
    ProbeAnswer,
    SaveReport,
    StepMetadata,
)
from connectors.vllm.outbox import WorkerOutbox

__all__ = ["SLEEP_DRAIN_S", "SleepGate", "refuse_step", "workers_asleep"]

SLEEP_DRAIN_S = 5.0
"""How long `unregister_kv_caches` waits for loads (then cancels them) and, as long again, for
the saver thread: vLLM's sleep waits on it, and a restore deadline is far shorter."""

_lock = threading.Lock()
_asleep: Multiset[StoreSpec] = Multiset()
"""Worker halves asleep in this process, by their store spec: the scheduler half in the same
process shares the store of that spec (`connectors.vllm.stores`), so this is how it learns."""


def workers_asleep(spec: StoreSpec) -> bool:
    """Whether a worker half of this process that uses the store `spec` is asleep."""
    with _lock:
        return _asleep[spec] > 0


class SleepGate:
    """One worker half's sleep state. `close` and `open` are idempotent (vLLM may call either
    twice: a discard, then a sleep) and say whether they changed anything."""

    def __init__(self, spec: StoreSpec) -> None:
        self._spec = spec
        self._closed = False

    @property
    def asleep(self) -> bool:
        return self._closed

    def close(self) -> bool:
        with _lock:
            if self._closed:
                return False
            self._closed = True
            _asleep[self._spec] += 1
            return True

    def open(self) -> bool:
        with _lock:
            if not self._closed:
                return False
            self._closed = False
            _asleep[self._spec] -= 1
            if _asleep[self._spec] <= 0:
                del _asleep[self._spec]
            return True


def refuse_step(meta: StepMetadata, outbox: WorkerOutbox) -> None:
    """Answer a step that reaches a sleeping worker (vLLM pauses its scheduler first, so this
    is a guard, not the normal path) without touching the caches: lookups find nothing, loads
    fail as a whole, saves fail and are planned again, finished requests are released."""
    for probe in meta.probes:
        outbox.answer(ProbeAnswer(probe.req_id, probe.first, len(probe.block_hashes), 0))
    for load in meta.loads:
        run = load.run
        outbox.loads([LoadReport(run.req_id, run.first, len(run), 0)], run.block_ids)
        # As for any failed load: the scheduler must not count these blocks as restored.
        outbox.saves(SaveReport(run.req_id, run.first + i, h, False, True)
                     for i, h in enumerate(run.block_hashes))
        if load.is_async:
            outbox.finished_recving([run.req_id])
    for save in meta.saves:
        run = save.run
        outbox.saves(SaveReport(run.req_id, run.first + i, h, False)
                     for i, h in enumerate(run.block_hashes))
        if save.flush:
            outbox.finished_sending(run.req_id)
