"""The worker half for an engine with several KV cache groups (vLLM's hybrid KV cache manager).

One `WorkerSide` per group, each bound to that group's layers, store layout and fingerprint
(`connectors.vllm.groups`), with its own loader and saver; this facade routes each step's
loads and saves by their run's group and each layer call by its layer, and speaks for the
request across groups:

- an asynchronous load is finished once every group that loads part of it has finished, and
  failed (`failed_recving`: vLLM recomputes the request) if any group's part failed. vLLM
  cannot map a failed block id back to a request when there are several groups (ids repeat
  across groups), so block-level errors never reach it from here;
- a finished request's flush is done once every group's flush is;
- a block index counts as saved when no group failed it, and a probe's hit is the shortest of
  the groups' (`WorkerReport.aggregate`, as across tensor-parallel ranks);
- restore reports carry the first full-attention group's count, or 0 for a failed request.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

from connectors.vllm.config import ConnectorConfig
from connectors.vllm.groups import KVGroup
from connectors.vllm.layouts import LayoutSpec
from connectors.vllm.metadata import LoadReport, LoadSpec, SaveSpec, StepMetadata, WorkerReport
from connectors.vllm.stats import Counts
from connectors.vllm.telemetry import Telemetry
from connectors.vllm.worker import WorkerSide
from kvstore.keys import ModelFingerprint
from kvstore.store import TieredStore

__all__ = ["GroupedWorker"]

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Receiving:
    """One request's asynchronous load across groups."""

    groups: set[int]
    """Groups whose part has not finished yet."""
    block_groups: dict[int, set[int]] = field(default_factory=dict)
    """group -> the block ids its part writes (to pin a failed block on this request)."""
    failed: bool = False
    report: LoadReport | None = None


class GroupedWorker:
    def __init__(self, *, config: ConnectorConfig, groups: tuple[KVGroup, ...],
                 layouts: tuple[LayoutSpec, ...], fingerprints: tuple[ModelFingerprint, ...],
                 store: TieredStore, counters: Counts) -> None:
        self._groups = groups
        self._sides = [WorkerSide(config=config, fingerprint=fp, layout=layout, store=store,
                                  counters=counters)
                       for fp, layout in zip(fingerprints, layouts, strict=True)]
        self._by_index = {group.index: side for group, side in zip(groups, self._sides,
                                                                    strict=True)}
        self._side_of_layer = {name: side for group, side in zip(groups, self._sides,
                                                                 strict=True)
                               for name in group.layer_names}
        primary = next((g for g in groups if g.kind == "full"), groups[0])
        self._primary = primary.index
        self.telemetry: Telemetry = self._by_index[primary.index].telemetry
        self._receiving: dict[str, _Receiving] = {}
        self._sending: dict[str, set[int]] = {}
        self._report = WorkerReport()
        self._loads_done: list[LoadReport] = []

    @property
    def asleep(self) -> bool:
        return self._sides[0].asleep

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        for group, side in zip(self._groups, self._sides, strict=True):
            side.register_kv_caches({name: kv_caches[name] for name in group.layer_names
                                     if name in kv_caches})

    def unregister_kv_caches(self) -> None:
        for side in self._sides:
            side.unregister_kv_caches()

    def restore_kv_caches(self) -> None:
        for side in self._sides:
            side.restore_kv_caches()

    def begin_step(self, meta: StepMetadata) -> None:
        for spec in meta.saves:
            if spec.flush:
                self._sending.setdefault(spec.run.req_id, set()).add(spec.run.group)
        for load in meta.loads:
            run = load.run
            receiving = self._receiving.setdefault(run.req_id, _Receiving(set()))
            receiving.groups.add(run.group)
            receiving.block_groups.setdefault(run.group, set()).update(run.block_ids)
        for index, side in self._by_index.items():
            side.begin_step(StepMetadata(
                loads=tuple(load for load in meta.loads if load.run.group == index),
                saves=tuple(spec for spec in meta.saves if spec.run.group == index),
                probes=meta.probes,  # each group answers with its own keys; the least hit wins
                manifests=meta.manifests if index == self._primary else ()))

    def start_load_kv(self, loads: Sequence[LoadSpec]) -> None:
        for index, side in self._by_index.items():
            mine = [load for load in loads if load.run.group == index]
            if mine:
                side.start_load_kv(mine)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if (side := self._side_of_layer.get(layer_name)) is not None:
            side.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str) -> None:
        if (side := self._side_of_layer.get(layer_name)) is not None:
            side.save_kv_layer(layer_name)

    def wait_for_save(self, saves: Sequence[SaveSpec]) -> None:
        for index, side in self._by_index.items():
            side.wait_for_save([spec for spec in saves if spec.run.group == index])

    def transfer_results(self) -> KVConnectorTransferResults:
        """What finished across every group since the last call (see the module docstring)."""
        sent: set[str] = set()
        received: set[str] = set()
        failed: set[str] = set()
        for index, side in self._by_index.items():
            sending, recving = side.get_finished()
            for block_id in side.get_block_ids_with_load_errors():
                self._fail_block(index, block_id)
            self._take_report(index, side)
            for req_id in sending or ():
                waiting = self._sending.get(req_id)
                if waiting is not None:
                    waiting.discard(index)
                    if not waiting:
                        del self._sending[req_id]
                        sent.add(req_id)
            for req_id in recving or ():
                receiving = self._receiving.get(req_id)
                if receiving is None:
                    continue
                receiving.groups.discard(index)
                if receiving.groups:
                    continue
                del self._receiving[req_id]
                received.add(req_id)
                if receiving.failed:
                    failed.add(req_id)
                if receiving.report is not None:
                    self._loads_done.append(receiving.report if not receiving.failed else
                                            LoadReport(receiving.report.req_id,
                                                       receiving.report.first,
                                                       receiving.report.count, 0))
        return KVConnectorTransferResults(finished_sending=sent, finished_recving=received,
                                          failed_recving=failed)

    def get_finished(self) -> tuple[set[str] | None, set[str] | None]:
        results = self.transfer_results()
        return results.finished_sending or None, results.finished_recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        # Failed loads are reported per request (`transfer_results`): with several groups
        # vLLM cannot take block ids.
        return set()

    def take_report(self) -> WorkerReport | None:
        for index, side in self._by_index.items():
            self._take_report(index, side)
        report, self._report = self._report, WorkerReport()
        loads, self._loads_done = tuple(self._loads_done), []
        if not (report.saves or report.probes or loads):
            return None
        return WorkerReport(report.saves, report.probes, loads)

    def drain_manifests(self, timeout: float = 10.0) -> None:
        self._by_index[self._primary].drain_manifests(timeout)

    def shutdown(self) -> None:
        for side in self._sides:
            side.shutdown()

    def _take_report(self, index: int, side: WorkerSide) -> None:
        report = side.take_report()
        if report is None:
            return
        for load in report.loads:
            receiving = self._receiving.get(load.req_id)
            if receiving is not None and index == self._primary:
                receiving.report = load
        merged = self._report.aggregate(WorkerReport(report.saves, report.probes))
        assert isinstance(merged, WorkerReport)
        self._report = merged

    def _fail_block(self, index: int, block_id: int) -> None:
        for receiving in self._receiving.values():
            if block_id in receiving.block_groups.get(index, ()):
                receiving.failed = True
                return
        log.warning("kvkeep: group %d reported a failed load of block %d outside any "
                    "asynchronous load", index, block_id)
