"""What the scheduler half tells the worker half each step, and what comes back.

Both directions cross a process boundary in vLLM's multiprocess mode (pickled), so these are
small frozen dataclasses of ints, bytes and strings: no torch, no requests, no stores.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

__all__ = ["BlockRun", "LoadReport", "LoadSpec", "SaveSpec", "Probe", "StepMetadata",
           "SaveReport", "ProbeAnswer", "WorkerReport"]


@dataclass(frozen=True, slots=True)
class BlockRun:
    """Consecutive full blocks of one request: its block indices `first..first+len-1`, the
    paged block id each occupies now, and vLLM's chained hash of each."""

    req_id: str
    namespace: str
    """`Namespace.label` of the request (tenant and cache salt)."""
    first: int
    block_ids: tuple[int, ...]
    block_hashes: tuple[bytes, ...]
    group: int = 0
    """The KV cache group whose block ids these are (`connectors.vllm.groups`)."""

    def __post_init__(self) -> None:
        if len(self.block_ids) != len(self.block_hashes):
            raise ValueError("block ids and hashes differ in length")

    def __len__(self) -> int:
        return len(self.block_ids)


@dataclass(frozen=True, slots=True)
class LoadSpec:
    """Blocks to restore from the store into the paged cache before they are attended to."""

    run: BlockRun
    is_async: bool = False
    deadline_s: float | None = None
    """Seconds the load may take from its start; None: the config's `restore_deadline_ms`
    (a request the router hinted gets `hinted_restore_deadline_ms`)."""


@dataclass(frozen=True, slots=True)
class SaveSpec:
    """Completed blocks to save. `flush` marks a finished request whose blocks vLLM keeps
    until the worker reports it in `finished_sending` (saved outside a forward pass)."""

    run: BlockRun
    flush: bool = False


@dataclass(frozen=True, slots=True)
class Probe:
    """A lookup the scheduler half asks the worker half to run, when the store lives only in
    the worker's process (vLLM's multiprocess executor): the longest stored prefix of
    `block_hashes`, which start at block index `first` of the request."""

    req_id: str
    namespace: str
    first: int
    block_hashes: tuple[bytes, ...]
    deadline_s: float | None = None
    """Seconds the lookup may take; None: the config's `restore_deadline_ms`."""


@dataclass(frozen=True, slots=True)
class StepMetadata(KVConnectorMetadata):
    loads: tuple[LoadSpec, ...] = ()
    saves: tuple[SaveSpec, ...] = ()
    probes: tuple[Probe, ...] = ()
    manifests: tuple[bytes, ...] = ()
    """Encoded session manifests for the worker to store (when the scheduler has no store)."""

    @property
    def empty(self) -> bool:
        return not (self.loads or self.saves or self.probes or self.manifests)


@dataclass(frozen=True, slots=True)
class SaveReport:
    """The outcome of saving one block: stored (or already present) or not."""

    req_id: str
    index: int
    block_hash: bytes
    ok: bool
    retry_now: bool = False
    """For a failed save: the store is fine, retry at the next step (the step's loads failed,
    so its saves were dropped); otherwise wait for the next checkpoint."""


@dataclass(frozen=True, slots=True)
class ProbeAnswer:
    req_id: str
    first: int
    count: int
    hit: int
    network: bool = False
    """Some of the hit lies on a network tier (daemons, Redis): `load_mode: auto` loads it
    asynchronously."""


@dataclass(frozen=True, slots=True)
class LoadReport:
    """How much of one request's load came from the store: `restored` blocks from `first` on,
    the contiguous run vLLM keeps (it recomputes from the first block that failed)."""

    req_id: str
    first: int
    count: int
    restored: int


@dataclass(frozen=True, slots=True)
class WorkerReport(KVConnectorWorkerMetadata):
    """Save outcomes and probe answers of one step, from every worker. With tensor
    parallelism each rank saves its own shard, so a block counts as saved only when no rank
    failed it, and a prefix as stored only as far as every rank holds it."""

    saves: tuple[SaveReport, ...] = field(default=())
    probes: tuple[ProbeAnswer, ...] = field(default=())
    loads: tuple[LoadReport, ...] = field(default=())

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, WorkerReport):
            return self
        failed = {(s.req_id, s.index, s.block_hash) for s in (*self.saves, *other.saves)
                  if not s.ok}
        merged: dict[tuple[str, int, bytes], SaveReport] = {}
        for report in (*self.saves, *other.saves):
            key = (report.req_id, report.index, report.block_hash)
            merged[key] = SaveReport(*key, ok=key not in failed, retry_now=report.retry_now)
        hits: dict[tuple[str, int, int], int] = {}
        for answer in (*self.probes, *other.probes):
            probe = (answer.req_id, answer.first, answer.count)
            hits[probe] = min(hits.get(probe, answer.hit), answer.hit)
        restored: dict[tuple[str, int, int], int] = {}
        for load in (*self.loads, *other.loads):  # a block is restored only if every rank has it
            run = (load.req_id, load.first, load.count)
            restored[run] = min(restored.get(run, load.restored), load.restored)
        return WorkerReport(tuple(merged.values()),
                            tuple(ProbeAnswer(*probe, hit) for probe, hit in hits.items()),
                            tuple(LoadReport(*run, n) for run, n in restored.items()))
