"""`KVKeepConnector`: vLLM's KV-connector API, delegating to the scheduler or worker half.

vLLM builds this class twice per engine, once per role. Each instance derives the model
fingerprint and layout from the config (the same on both sides), takes the process's shared
store for the configured spec, and builds only the half its role needs.

It supports vLLM's hybrid KV cache manager (`SupportsHMA`): with several KV cache groups each
group's blocks are kept under a layout and fingerprint of their own (`connectors.vllm.groups`),
and the worker half is one `WorkerSide` per group (`connectors.vllm.worker_groups`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from connectors.vllm.config import ConnectorConfig
from connectors.vllm.fingerprint import (
    check_engine_kv_scales,
    derive_fingerprint,
    derive_layout,
    fp8_scales,
)
from connectors.vllm.groups import group_fingerprint, group_layout, kv_groups
from connectors.vllm.hash_check import check_block_hashes_reproducible
from connectors.vllm.layouts import check_codec
from connectors.vllm.metadata import StepMetadata
from connectors.vllm.prefetch import Prefetcher
from connectors.vllm.prometheus import KVKeepPromMetrics, KVKeepStats, StatsReporter
from connectors.vllm.scheduler_side import SchedulerSide
from connectors.vllm.sleep import workers_asleep
from connectors.vllm.stats import Counts, CountSnapshot
from connectors.vllm.stores import (
    acquire_existing_store,
    acquire_store,
    release_store,
    tier_specs,
)
from connectors.vllm.worker import WorkerSide
from connectors.vllm.worker_groups import GroupedWorker
from kvstore.errors import ConfigError, KVKeepError
from kvstore.keys import ModelFingerprint
from kvstore.store import TieredStore

if TYPE_CHECKING:
    from collections.abc import Iterable

    from vllm.config import VllmConfig
    from vllm.config.kv_transfer import KVTransferConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorStats,
        PromMetric,
        PromMetricT,
    )
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["KVKeepConnector"]

log = logging.getLogger(__name__)


class KVKeepConnector(KVConnectorBase_V1, SupportsHMA):
    """Checkpoints KV blocks to a kvkeep store and restores them, verified, layer by layer."""

    _cache_hit_source = CacheHitSource.EXTERNAL_UNSPECIFIED

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self._config = _per_rank_store(
            ConnectorConfig.from_extra(self._kv_transfer_config.kv_connector_extra_config),
            vllm_config)
        check_block_hashes_reproducible(vllm_config.cache_config.prefix_caching_hash_algo,
                                        os.environ)
        layout = derive_layout(vllm_config)
        self._layout = layout
        check_codec(self._config.codec, layout, vllm_config.model_config.dtype)
        self._fingerprint = derive_fingerprint(vllm_config, self._config, layout)
        groups = kv_groups(kv_cache_config, layout.block_size)
        if len(groups) > 1 and self._config.prefetch is not None:
            raise ConfigError("kvkeep connector: prefetch is not supported with several KV "
                              "cache groups (hybrid attention with vLLM's hybrid KV cache "
                              "manager) yet")
        layouts = tuple(group_layout(layout, group, groups) for group in groups)
        group_fps = tuple(group_fingerprint(self._fingerprint, group_spec, group)
                          for group_spec, group in zip(layouts, groups, strict=True))
        self._groups = groups
        self._counters = Counts()
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | GroupedWorker | None = None
        self._store: TieredStore | None = None
        self._prefetcher: Prefetcher | None = None
        self._closed = False
        if role == KVConnectorRole.SCHEDULER:
            # The worker half is built first: if it runs in this process, its store is here
            # to share; if it runs in another (vLLM's multiprocess executor), the worker owns
            # the store and answers lookups through the step metadata.
            if self._config.lookup == "auto":
                self._store = acquire_existing_store(self._config.store)
            self._scheduler = SchedulerSide(
                config=self._config, fingerprint=self._fingerprint, store=self._store,
                block_size=layout.block_size, num_layers=self._fingerprint.num_layers,
                counters=self._counters, event_medium=_event_medium(vllm_config, self._config),
                groups=groups, group_fingerprints=group_fps)
        else:
            self._store = acquire_store(self._config.store)
            if len(groups) > 1:
                self._worker = GroupedWorker(config=self._config, groups=groups,
                                             layouts=layouts, fingerprints=group_fps,
                                             store=self._store, counters=self._counters)
            else:
                self._worker = WorkerSide(config=self._config, fingerprint=self._fingerprint,
                                          layout=layout, store=self._store,
                                          counters=self._counters)
            if self._config.prefetch is not None:
                # Manifests are the scheduler half's, written under rank 0's fingerprint.
                manifest_fp = derive_fingerprint(vllm_config, self._config,
                                                 derive_layout(vllm_config, rank=0))
                self._prefetcher = Prefetcher(
                    store=self._store, spec=self._config.prefetch, tenant=self._config.tenant,
                    manifest_fp=manifest_fp, block_fp=self._fingerprint,
                    counters=self._counters)
        # Only the worker half reports the store: the scheduler half may share the same one.
        self._reporter = StatsReporter(
            self._counters, block_size=layout.block_size,
            store=self._store if self._worker is not None else None,
            telemetry=self._worker.telemetry if self._worker is not None else None,
            unprotected=self._scheduler.unprotected_tokens if self._scheduler is not None
            else None)
        log.info("kvkeep connector (%s): model %s fingerprint %s layout %s codec %s, "
                 "%d KV cache group(s)", role.name, self._fingerprint.model_id,
                 self._fingerprint.hex, layout.layout_id, self._config.codec, len(groups))

    # -- introspection (tests, benchmarks, operators) ------------------------------------------

    @property
    def fingerprint(self) -> ModelFingerprint:
        return self._fingerprint

    @property
    def config(self) -> ConnectorConfig:
        return self._config

    @property
    def prefetcher(self) -> Prefetcher | None:
        """The worker half's failover prefetch, when `prefetch` is configured."""
        return self._prefetcher

    def drain_manifests(self, timeout: float = 10.0) -> None:
        """Wait until this half's queued manifest writes are done (tests, operators)."""
        if self._scheduler is not None:
            self._scheduler.drain_manifests(timeout)
        if self._worker is not None:
            self._worker.drain_manifests(timeout)

    def counters(self) -> CountSnapshot:
        """This half's counters (see `connectors.vllm.stats`), plus the shared store's own
        (`store_hits`, `store_misses`, `store_corrupt`, `store_errors`, `store_dropped`) and
        each tier's (`tier_<name>_hits`, `_misses`, `_corrupt`, `_errors`, `_rejected_puts`):
        tiers absorb their own failures (a dead daemon is a miss), so this is where they show."""
        mine = self._counters.snapshot().as_dict()
        if self._store is None:
            return CountSnapshot(MappingProxyType(mine))
        try:
            stats = self._store.stats()
        except KVKeepError:
            return CountSnapshot(MappingProxyType(mine))
        mine.update(store_hits=stats.hits, store_misses=stats.misses,
                    store_corrupt=stats.corrupt, store_errors=stats.errors,
                    store_dropped=stats.write_behind_dropped)
        for tier in stats.tiers:
            mine.update({f"tier_{tier.name}_hits": tier.hits,
                         f"tier_{tier.name}_misses": tier.misses,
                         f"tier_{tier.name}_corrupt": tier.corrupt,
                         f"tier_{tier.name}_errors": tier.errors,
                         f"tier_{tier.name}_rejected_puts": tier.rejected_puts})
        return CountSnapshot(MappingProxyType(mine))

    # -- metrics (connectors.vllm.prometheus: they reach vLLM's own /metrics) ------------------

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        return self._reporter.take()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None
                                 ) -> KVConnectorStats | None:
        return KVKeepStats(data=data) if data is not None else KVKeepStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig,
                           metric_types: dict[type[PromMetric], type[PromMetricT]],
                           labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]
                           ) -> KVKeepPromMetrics | None:
        transfer = vllm_config.kv_transfer_config
        extra = transfer.kv_connector_extra_config if transfer is not None else None
        config = ConnectorConfig.from_extra(extra)
        return KVKeepPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues,
                                 tier_names=[spec.name for spec in tier_specs(config.store)])

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        # Restores wait per layer and saves gather per layer: both must run between graph
        # pieces, or a replayed graph would attend to blocks that are still loading.
        return True

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: KVTransferConfig) -> bool:
        # vLLM 0.33 asks before it lets an engine with `enable_sleep_mode` start. True since
        # the worker half drains and stops before the unmap and resumes after it
        # (`unregister_kv_caches`, `restore_kv_caches`, `connectors.vllm.sleep`).
        return True

    @property
    def requires_kv_delivery(self) -> bool:
        # A best-effort cache: a dropped save is a future recompute, never a lost hand-off.
        return False

    # -- worker side ---------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self._layout.is_fp8:
            check_engine_kv_scales(fp8_scales(self._vllm_config),
                                   _engine_kv_scales(self._vllm_config, kv_caches))
        self._need_worker().register_kv_caches(kv_caches)

    def unregister_kv_caches(self) -> None:
        """vLLM 0.33's sleep mode unmaps the caches next: drain, stop (`connectors.vllm.sleep`)."""
        self._need_worker().unregister_kv_caches()

    def restore_kv_caches(self) -> None:
        """vLLM 0.33 woke up and mapped the caches again: register them again, resume."""
        self._need_worker().restore_kv_caches()

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        assert isinstance(connector_metadata, StepMetadata)
        # Decide the step's saves before the forward pass (save_kv_layer runs inside it).
        self._need_worker().begin_step(connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, StepMetadata)
        if meta.loads:
            self._need_worker().start_load_kv(meta.loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._need_worker().wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: AttentionMetadata, **kwargs: Any) -> None:
        self._need_worker().save_kv_layer(layer_name)

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, StepMetadata)
        self._need_worker().wait_for_save(meta.saves)

    def get_finished(self, finished_req_ids: set[str]
                     ) -> tuple[set[str] | None, set[str] | None]:
        return self._need_worker().get_finished()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._need_worker().get_block_ids_with_load_errors()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        worker = self._need_worker()
        if isinstance(worker, GroupedWorker):  # failed loads are whole requests' there
            return worker.transfer_results()
        return super().get_transfer_results(finished_req_ids)

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self._need_worker().take_report()

    # -- scheduler side ------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        scheduler = self._need_scheduler()
        if workers_asleep(self._config.store):
            # This process's worker half sleeps (its caches unmapped): nothing to load into.
            # A worker in another process answers its probes with 0 itself.
            return 0, False
        return scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        self._need_scheduler().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._need_scheduler().build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._need_scheduler().update_connector_output(connector_output)

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """vLLM with its hybrid KV cache manager off: one group."""
        return self._need_scheduler().request_finished(request, (block_ids,))

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM with its hybrid KV cache manager on (`SupportsHMA`): each group's blocks."""
        return self._need_scheduler().request_finished(request, block_ids)

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self._need_scheduler().bind_block_tables(kv_cache_manager.get_block_ids)

    def take_events(self) -> Iterable[KVCacheEvent]:
        """KV events for blocks the store now holds (published by vLLM when it publishes its
        own; see `connectors.vllm.scheduler_side`)."""
        return self._scheduler.take_events() if self._scheduler is not None else ()

    def has_pending_push_work(self) -> bool:
        return self._scheduler is not None and self._scheduler.has_pending_work()

    # -- lifecycle -----------------------------------------------------------------------------

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._prefetcher is not None:
            self._prefetcher.close()
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.shutdown()
        if self._store is not None:
            release_store(self._config.store)

    def _need_worker(self) -> WorkerSide | GroupedWorker:
        if self._worker is None:
            raise RuntimeError("kvkeep: worker-side call on the scheduler-side connector")
        return self._worker

    def _need_scheduler(self) -> SchedulerSide:
        if self._scheduler is None:
            raise RuntimeError("kvkeep: scheduler-side call on the worker-side connector")
        return self._scheduler


def _engine_kv_scales(vllm_config: VllmConfig, kv_caches: dict[str, torch.Tensor]
                      ) -> dict[str, tuple[float, float]]:
    """Each registered attention layer's (k_scale, v_scale) as the loaded model holds them."""
    layers = vllm_config.compilation_config.static_forward_context
    out: dict[str, tuple[float, float]] = {}
    for name in kv_caches:
        layer = layers.get(name)
        k = getattr(layer, "_k_scale_float", None)
        v = getattr(layer, "_v_scale_float", None)
        if k is None or v is None:
            raise ConfigError(f"kvkeep connector: cannot read the fp8 KV scales of layer "
                              f"{name}; refusing to key its KV without them")
        out[name] = (float(k), float(v))
    return out


def _per_rank_store(config: ConnectorConfig, vllm_config: VllmConfig) -> ConnectorConfig:
    """With tensor parallelism each rank is its own process and stores its own shard (its
    layout id names the rank): an nvme directory serves one process, so each rank gets
    `<path>/tp<rank>of<world>` and its share of the byte budget. Without, the config as is."""
    parallel = vllm_config.parallel_config
    world = parallel.tensor_parallel_size
    nvme = config.store.nvme
    if world <= 1 or nvme is None:
        return config
    rank = parallel.rank % world
    shard = dataclasses.replace(nvme, path=str(Path(nvme.path) / f"tp{rank}of{world}"),
                                byte_budget=max(nvme.byte_budget // world, 1))
    return dataclasses.replace(config, store=dataclasses.replace(config.store, nvme=shard))


def _event_medium(vllm_config: VllmConfig, config: ConnectorConfig) -> str | None:
    """The medium of the store's KV events, or None where vLLM publishes no KV events: a store
    with remote daemons or a Redis serves every worker (shared); one without serves this node
    only."""
    events = vllm_config.kv_events_config
    if events is None or not events.enable_kv_cache_events:
        return None
    shared = config.store.remote is not None or config.store.redis is not None
    return "KVKEEP_SHARED" if shared else "KVKEEP_LOCAL"
