"""The connector's staging pipelines (connectors/vllm/staging) against the device's own copies,
in one run: `python -m benchmarks.gpu` calls `measure_staged` (also with `--device cpu`, at
small sizes, so these code paths run on machines without a GPU; figures there say nothing
about a GPU).

Blocks are Llama-3-8B shaped by default (32 layers x 8 KV heads x 128, 16 tokens, bf16) in a
paged flash-layout cache `[2, num_blocks, block_size, H, D]` per layer. Every rate is GB/s of
fp16-equivalent KV bytes (2 bytes per element whatever the codec sends), so an int8 path
beats the link when it moves its half-size bytes faster than the link moves fp16.

- baseline: one slot-sized copy host->device and device->host from/to page-locked memory
  (on the host: a memcpy between two buffers), repeated;
- save_{raw,int8}: gather of a step's blocks per layer from the paged cache, then
  `SavePipeline.save` with the staged framer (int8 quantized on the device, one copy per
  batch, frames sealed in place and put into a (page-locked on a GPU) host tier);
- restore_{raw,int8}[_variant]: `RestorePipeline.load` of those blocks from the host tier into
  other paged blocks: `hashed` (lent pages hashed beside the copy, the default), `trusted`
  (verified when they entered the tier, not again), `direct` (raw: one DMA per lent page run
  straight into the device slot, no host copy; CUDA only);
- restore_2048_tokens_s: seconds to restore 2,048 tokens (raw, default variant);
- stages: seconds per pipeline step per run, summed over threads (`StageTimes`).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from connectors.vllm.caches import PagedCaches
from connectors.vllm.layouts import cuda_layout
from connectors.vllm.staging import RestorePipeline, StagingConfig, writer_for
from connectors.vllm.staging.jobs import BatchJob, RestoreBlock, RestoreJob, StagedBlock
from connectors.vllm.staging.save import (
    FrameSettings,
    RingFramer,
    SaveBatch,
    SavePipeline,
    WriteBehind,
)
from kvstore.codecs import DEFAULT_INT8, get_codec
from kvstore.frame import BlockRead, FrameHeader, LayerRange
from kvstore.keys import BlockKey, ModelFingerprint, Namespace
from kvstore.store import StoreConfig, TieredStore
from kvstore.tiers.memory.host import HostTier

__all__ = ["Shape", "measure_staged", "TARGETS"]

TARGETS = {"restore_raw_vs_h2d_pinned": 0.6, "restore_int8_vs_h2d_pinned": 1.0,
           "save_raw_vs_d2h_pinned": 0.5, "save_int8_vs_d2h_pinned": 0.8}
"""Issue 9's targets for a GPU (ratios of fp16-equivalent rates to the pinned copies)."""


@dataclass(frozen=True, slots=True)
class Shape:
    layers: int = 32
    kv_heads: int = 8
    head_size: int = 128
    block_tokens: int = 16

    @property
    def block_kv_bytes(self) -> int:
        """fp16-equivalent bytes of one block, every layer."""
        return self.layers * 2 * self.block_tokens * self.kv_heads * self.head_size * 2


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(run: Callable[[], None], nbytes: int, repeats: int, device: torch.device
           ) -> tuple[float, float]:
    """(median GB/s, median seconds) of `run()` after one warm-up run."""
    run()
    _sync(device)
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        _sync(device)
        seconds.append(time.perf_counter() - start)
    median = statistics.median(seconds)
    return nbytes / median / 1e9, median


def _baselines(device: torch.device, slot_bytes: int, repeats: int) -> dict[str, float]:
    count = 8
    if device.type == "cuda":
        dev = torch.empty(slot_bytes, dtype=torch.uint8, device=device).fill_(3)
        host = torch.empty(slot_bytes, dtype=torch.uint8).pin_memory()

        def h2d() -> None:
            for _ in range(count):
                dev.copy_(host, non_blocking=True)

        def d2h() -> None:
            for _ in range(count):
                host.copy_(dev, non_blocking=True)
    else:  # the host's own ceiling: a memcpy between two touched buffers
        a, b = np.ones(slot_bytes, np.uint8), np.zeros(slot_bytes, np.uint8)

        def h2d() -> None:
            for _ in range(count):
                np.copyto(b, a)

        d2h = h2d
    return {"h2d_pinned_gbps": _timed(h2d, slot_bytes * count, repeats, device)[0],
            "d2h_pinned_gbps": _timed(d2h, slot_bytes * count, repeats, device)[0]}


def _caches(shape: Shape, num_blocks: int, device: torch.device) -> PagedCaches:
    spec = cuda_layout(num_kv_heads=shape.kv_heads, head_size=shape.head_size,
                       block_size=shape.block_tokens)
    gen = torch.Generator(device=device).manual_seed(0)
    caches = PagedCaches(spec, shape.layers)
    caches.bind([torch.randn((2, num_blocks, shape.block_tokens, shape.kv_heads,
                              shape.head_size), generator=gen, device=device,
                             dtype=torch.bfloat16) for _ in range(shape.layers)])
    return caches


def _keys(shape: Shape, codec: str, count: int) -> list[BlockKey]:
    fingerprint = ModelFingerprint("bench", "random", "bfloat16", shape.layers, shape.kv_heads,
                                   shape.head_size, shape.block_tokens, "cuda/tnhd", codec)
    return [BlockKey.of(fingerprint, Namespace("bench"), i.to_bytes(8, "little") * 4)
            for i in range(count)]


def _accept(_: FrameHeader) -> None:
    return None


def measure_staged(device: torch.device, *, shape: Shape, count: int, repeats: int,
                   slot_bytes: int = 64 << 20, workers: int = 4) -> dict[str, Any]:
    """Every staged figure for `count` blocks per step (see the module docstring)."""
    cuda = device.type == "cuda"
    caches = _caches(shape, 2 * count, device)
    nbytes = shape.block_kv_bytes * count
    base = StagingConfig(slot_bytes=slot_bytes, workers=workers)
    baseline = _baselines(device, base.slot_bytes, repeats)
    ids = torch.arange(count, device=device)
    paths: dict[str, float] = {}
    stages: dict[str, dict[str, float]] = {}
    seconds: dict[str, float] = {}
    for codec in ("raw", DEFAULT_INT8):
        label = "raw" if codec == "raw" else "int8"
        codec_id = get_codec(codec).codec_id
        keys = _keys(shape, codec, count)
        tier = HostTier(3 * count * shape.block_kv_bytes + (64 << 20), pinned=cuda)
        store = TieredStore([tier], config=StoreConfig(promote=False))
        try:
            framer = RingFramer(caches, FrameSettings(codec_id, "none", None), base)
            saver = SavePipeline(framer, WriteBehind(store))
            failed: list[int] = []

            def save(saver: SavePipeline = saver, keys: list[BlockKey] = keys,
                     store: TieredStore = store, failed: list[int] = failed) -> None:
                store.delete(keys)
                layers = [caches.bound[i].gather(caches.tensors[i], ids)
                          for i in range(shape.layers)]
                ready = [torch.cuda.current_stream(device).record_event()] if cuda else []
                saver.save(SaveBatch(keys, layers, range(len(keys)), ready),
                           lambda j, saved: None if saved.stored else failed.append(j))

            try:
                paths[f"save_{label}_gbps"], _ = _timed(save, nbytes, repeats, device)
                stages[f"save_{label}"] = _per_run(framer.times.snapshot(), repeats + 1)
            finally:
                saver.close()
            if failed:
                raise RuntimeError(f"the staged save failed {len(failed)} puts")
            variants = {"hashed": StagingConfig(slot_bytes=slot_bytes, workers=workers),
                        "trusted": StagingConfig(slot_bytes=slot_bytes, workers=workers,
                                                 trust_host_pages=True)}
            if cuda and codec == "raw":
                variants["direct"] = StagingConfig(slot_bytes=slot_bytes, workers=workers,
                                                   direct_from_pinned=True)
            for variant, config in variants.items():
                name = f"restore_{label}_{variant}"
                rate, median = _restore(caches, store, codec_id, config, keys, count, shape,
                                        repeats, device, stages, name)
                paths[f"{name}_gbps"] = rate
                seconds[name] = median
        finally:
            store.close()
    per_block = seconds["restore_raw_hashed"] / count
    return {
        "baseline": baseline, "paths": paths, "stages": stages,
        "restore_2048_tokens_s": per_block * 2048 / shape.block_tokens,
        "ratios": {
            "restore_raw_vs_h2d_pinned": paths["restore_raw_hashed_gbps"]
            / baseline["h2d_pinned_gbps"],
            "restore_raw_trusted_vs_h2d_pinned": paths["restore_raw_trusted_gbps"]
            / baseline["h2d_pinned_gbps"],
            "restore_int8_vs_h2d_pinned": paths["restore_int8_hashed_gbps"]
            / baseline["h2d_pinned_gbps"],
            "save_raw_vs_d2h_pinned": paths["save_raw_gbps"] / baseline["d2h_pinned_gbps"],
            "save_int8_vs_d2h_pinned": paths["save_int8_gbps"] / baseline["d2h_pinned_gbps"],
        },
        "targets": TARGETS,
        "shape": {"layers": shape.layers, "kv_heads": shape.kv_heads,
                  "head_size": shape.head_size, "block_tokens": shape.block_tokens,
                  "dtype": "bfloat16", "blocks_per_step": count, "slot_bytes": slot_bytes,
                  "workers": workers, "device": str(device)},
    }


def _restore(caches: PagedCaches, store: TieredStore, codec_id: Any, config: StagingConfig,
             keys: list[BlockKey], count: int, shape: Shape, repeats: int,
             device: torch.device, stages: dict[str, dict[str, float]], name: str
             ) -> tuple[float, float]:
    stage = (LayerRange(0, shape.layers),)

    def read_lower(job: RestoreJob, layers: LayerRange, blocks: Any) -> list[BlockRead | None]:
        wanted: list[RestoreBlock] = list(blocks)
        return store.get_many([block.key for block in wanted], None)

    pipeline = RestorePipeline(store, writer_for(caches, store, codec_id, "staged", config),
                               read=read_lower, refusal=_accept)

    def run() -> None:
        job = BatchJob([StagedBlock(count + i, key) for i, key in enumerate(keys)],
                       time.monotonic() + 120, shape.layers)
        pipeline.load(job, stage)
        if job.failed:
            raise RuntimeError(f"{name}: {len(job.failed)} blocks failed: "
                               f"{sorted(set(job.failed.values()))}")
        for layer in range(shape.layers):
            event = job.device_done[layer]
            if event is not None:
                event.synchronize()

    try:
        result = _timed(run, shape.block_kv_bytes * count, repeats, device)
        stages[name] = _per_run(pipeline.times.snapshot(), repeats + 1)
    finally:
        pipeline.close()
    return result


def _per_run(snapshot: dict[str, float], runs: int) -> dict[str, float]:
    return {step: round(total / runs, 6) for step, total in snapshot.items()}
