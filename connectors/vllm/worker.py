"""The worker half: vLLM's worker-side connector calls, routed to the loader and the saver.

`Loader` (`connectors.vllm.loader`) restores blocks into the paged KV cache, `Saver`
(`connectors.vllm.saver`) checkpoints them, each on its own threads with its own failure rules;
both see the registered caches through one `PagedCaches` and report through one
`WorkerOutbox`. This facade also answers the scheduler's lookups (`Probe`) and writes the
manifests it relays, when the store lives only in this process (vLLM's multiprocess executor).

The order of a step: `begin_step` (answer probes, queue manifests, plan saves) ->
`start_load_kv` -> per layer `wait_for_layer_load`, attention, `save_kv_layer` ->
`wait_for_save` (settle the step's loads, then its saves: a failed load drops them).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch

from connectors.vllm.caches import PagedCaches
from connectors.vllm.config import ConnectorConfig
from connectors.vllm.layouts import LayoutSpec
from connectors.vllm.loader import Loader
from connectors.vllm.manifests import ManifestWriter
from connectors.vllm.metadata import (
    LoadSpec,
    Probe,
    ProbeAnswer,
    SaveSpec,
    StepMetadata,
    WorkerReport,
)
from connectors.vllm.outbox import WorkerOutbox
from connectors.vllm.saver import Saver
from connectors.vllm.sleep import SLEEP_DRAIN_S, SleepGate, refuse_step
from connectors.vllm.stats import Count, Counts
from connectors.vllm.telemetry import Telemetry
from connectors.vllm.worker_context import WorkerContext
from kvstore.codecs import get_codec
from kvstore.errors import ConfigError, KVKeepError
from kvstore.keys import BlockKey, ModelFingerprint, Namespace
from kvstore.manifest import SessionManifest
from kvstore.store import TieredStore

__all__ = ["WorkerSide"]

log = logging.getLogger(__name__)


class WorkerSide:
    def __init__(self, *, config: ConnectorConfig, fingerprint: ModelFingerprint,
                 layout: LayoutSpec, store: TieredStore, counters: Counts) -> None:
        if config.durability is not None \
                and store.max_replicated_copies < config.durability.replicas:
            raise ConfigError(f"durability.replicas is {config.durability.replicas}, but the "
                              f"store keeps at most {store.max_replicated_copies} remote copies")
        self._config = config
        self._fp = fingerprint
        self._store = store
        self._counters = counters
        codec = get_codec(config.codec).codec_id
        self._caches = PagedCaches(layout, fingerprint.num_layers)
        self._outbox = WorkerOutbox()
        self.telemetry = Telemetry()
        """Restore and save timings, for vLLM's metrics (connectors.vllm.prometheus)."""
        context = WorkerContext(store, self._caches, fingerprint, codec, self._outbox, counters,
                                config.mac_key, self.telemetry)
        self._loader = Loader(context, deadline_s=config.restore_deadline_s,
                              first_layers=config.restore_first_layers,
                              path=config.restore_path)
        self._saver = Saver(context, config)
        self._manifests = ManifestWriter(store, counters)
        self._sleep = SleepGate(config.store)
        self._registered: dict[str, torch.Tensor] = {}

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._registered = dict(kv_caches)
        self._caches.register(kv_caches)
        self._loader.prepare()
        self._saver.prepare()

    @property
    def asleep(self) -> bool:
        return self._sleep.asleep

    def unregister_kv_caches(self) -> None:
        """vLLM's sleep mode is about to unmap the caches (`connectors.vllm.sleep`): stop
        planning saves and loads, let the ones in flight end (bounded; loads still running
        are cancelled), and touch the caches no more until `restore_kv_caches`."""
        if not self._sleep.close():
            return
        cancelled = self._loader.drain(SLEEP_DRAIN_S)
        saves_done = self._saver.drain(SLEEP_DRAIN_S)
        log.info("kvkeep: KV caches unregistered for sleep (%d load(s) cancelled%s)", cancelled,
                 "" if saves_done else "; saves of gathered copies still finishing")

    def restore_kv_caches(self) -> None:
        """vLLM mapped the caches again after sleep (same tensors, contents discarded): bind
        them again and resume."""
        if not self._sleep.asleep:
            return
        if self._registered:
            self._caches.register(self._registered)
            self._loader.prepare()
            self._saver.prepare()
        self._sleep.open()
        log.info("kvkeep: KV caches registered again after sleep")

    def begin_step(self, meta: StepMetadata) -> None:
        """Before the forward pass: answer the scheduler's probes, queue its manifests, and
        decide which of the step's planned blocks to gather."""
        if self._sleep.asleep:
            refuse_step(meta, self._outbox)
        else:
            for probe in meta.probes:
                self._answer(probe)
        for encoded in meta.manifests:
            try:
                manifest = SessionManifest.decode(encoded)
            except KVKeepError:
                log.warning("kvkeep: undecodable manifest in the step metadata", exc_info=True)
                self._counters.add(Count.MANIFEST_ERRORS)
                continue
            self._manifests.submit(manifest)
        self._saver.plan(() if self._sleep.asleep else meta.saves)

    def start_load_kv(self, loads: Sequence[LoadSpec]) -> None:
        if not self._sleep.asleep:  # asleep: `begin_step` failed them already
            self._loader.start(loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        index = self._caches.index_of(layer_name)
        if index is not None:
            self._loader.wait_for_layer(index)

    def save_kv_layer(self, layer_name: str) -> None:
        index = self._caches.index_of(layer_name)
        if index is not None:
            self._saver.save_layer(index)

    def wait_for_save(self, saves: Sequence[SaveSpec]) -> None:
        if self._sleep.asleep:
            return  # `begin_step` reported this step's saves failed and released its flushes
        loads_ok = self._loader.finish_step()
        self._saver.finish_step(saves, loads_ok=loads_ok)

    def get_finished(self) -> tuple[set[str] | None, set[str] | None]:
        self._loader.finish_async()
        return self._outbox.take_finished()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._outbox.take_load_errors()

    def take_report(self) -> WorkerReport | None:
        return self._outbox.take_report()

    def drain_manifests(self, timeout: float = 10.0) -> None:
        """Wait until every manifest queued so far is written (tests, shutdown)."""
        self._manifests.drain(timeout)

    def shutdown(self) -> None:
        self._sleep.open()  # leaves this process's registry of sleeping workers
        self._loader.shutdown()
        self._saver.shutdown()
        self._manifests.shutdown()

    def _answer(self, probe: Probe) -> None:
        namespace = Namespace.from_label(probe.namespace)
        keys = [BlockKey.of(self._fp, namespace, h) for h in probe.block_hashes]
        budget = self._config.restore_deadline_s if probe.deadline_s is None \
            else probe.deadline_s
        try:
            where = self._store.locate(keys, deadline=time.monotonic() + budget)
        except KVKeepError:
            log.warning("kvkeep: lookup failed; computing instead", exc_info=True)
            self._counters.add(Count.LOOKUP_ERRORS)
            where = []
        hit = next((i for i, tier in enumerate(where) if tier < 0), len(where))
        in_process = self._store.in_process
        network = any(not in_process[tier] for tier in where[:hit])
        self._outbox.answer(ProbeAnswer(probe.req_id, probe.first, len(keys), hit, network))
