"""The GPU side of the block store against the same GPU's own ceilings, measured in one run.

    python -m benchmarks.gpu --quick --json OUT.json
    python -m benchmarks.gpu --device cpu --quick      (the staged paths only, small blocks)

Needs CUDA (torch) unless `--device cpu`; `--device cuda` without it says so and exits 2.
The staging pipelines' figures (`staged`: 8B-shaped blocks through the connector's
staging pipelines against pinned copies, issue 9's targets, 2,048-token restore time,
per-stage breakdown) come from `benchmarks.gpu_staged`; the rest below. Blocks are shaped
like the store benchmark's: 32 layers x (K, V) x 32 tokens x 8 KV heads x 128 head size in
fp16 = 4 MiB, in vLLM's CUDA flash-attention layout `[2, num_blocks, block_size, H, D]` per
layer. Every figure is GB/s of fp16 KV bytes. Baselines, measured in the same run:

- device-to-device copy (`Tensor.copy_` on the GPU);
- host<->device copies of one 4 MiB block, from pinned and from pageable host memory (our
  frames live in pageable memory: the pageable copy is the ceiling a frame can reach).

Paths measured:

- save: gather a step's blocks out of the paged cache (as the connector does), then
  `encode_block` each (raw, and int8 quantized on the device before the copy to host). The
  int8 path sends about half the bytes over PCIe; `layerwise` is the old way (one encode and
  one copy per layer) for comparison with the batched one (one set of kernels per block).
- restore: frames from the host tier into the paged cache: decoded on the host into a staging
  tensor then copied up; decoded on the device block by block; and batched, every block's
  segment of a layer in one copy up and one decode there (what the connector does on a GPU;
  int8: half the bytes cross PCIe).
- hbm tier: put (frame -> device pages) and get (device pages -> caller buffer).
- int8 quantize on the device alone (no copy to host), against the device copy.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from benchmarks.cli import run_benchmark
from benchmarks.gpu_staged import Shape, measure_staged
from kvstore.block import decode_layer, decode_layer_batch, encode_block
from kvstore.codecs import get_codec, torch_ops, warmup
from kvstore.frame import BlockRead, Compression, DType, build_frame
from kvstore.keys import BlockKey, ModelFingerprint, Namespace
from kvstore.tiers.memory.host import HostTier

if TYPE_CHECKING:
    import torch

    from connectors.vllm.layouts import BoundLayout

LAYERS, TOKENS, HEADS, HEAD_SIZE = 32, 32, 8, 128
BLOCK_SHAPE = (2, TOKENS, HEADS, HEAD_SIZE)  # one layer of one block, canonical order
KV_BYTES = LAYERS * 2 * TOKENS * HEADS * HEAD_SIZE * 2  # fp16
LAYOUT = "cuda/tnhd"


def _timed(run: Callable[[], None], nbytes: int, repeats: int) -> float:
    """Median GB/s of `run()` (which must leave the GPU idle when it returns)."""
    import torch

    run()
    torch.cuda.synchronize()
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        torch.cuda.synchronize()
        rates.append(nbytes / (time.perf_counter() - start) / 1e9)
    return statistics.median(rates)


def _discard(_: object) -> None:
    """Lets a lambda call a function for its effect on the GPU."""


def _baselines(repeats: int, big: int) -> dict[str, float]:
    import torch

    src = torch.empty(big, dtype=torch.uint8, device="cuda").fill_(7)
    dst = torch.empty_like(src)
    block = torch.empty(KV_BYTES, dtype=torch.uint8, device="cuda").fill_(3)
    pinned = torch.empty(KV_BYTES, dtype=torch.uint8).pin_memory()
    pageable = torch.from_numpy(np.ones(KV_BYTES, np.uint8))
    count = 64

    def blocks(copy: Callable[[], object]) -> Callable[[], None]:
        def run() -> None:
            for _ in range(count):
                copy()
        return run

    return {
        "d2d_gbps": _timed(lambda: _discard(dst.copy_(src)), big, repeats),
        "h2d_pinned_gbps": _timed(blocks(lambda: block.copy_(pinned, non_blocking=True)),
                                  KV_BYTES * count, repeats),
        "d2h_pinned_gbps": _timed(blocks(lambda: pinned.copy_(block, non_blocking=True)),
                                  KV_BYTES * count, repeats),
        "h2d_pageable_gbps": _timed(blocks(lambda: block.copy_(pageable)), KV_BYTES * count,
                                    repeats),
        "d2h_pageable_gbps": _timed(blocks(lambda: pageable.copy_(block)), KV_BYTES * count,
                                    repeats),
    }


def _keys(count: int) -> list[BlockKey]:
    fingerprint = ModelFingerprint("bench", "random", "float16", LAYERS, HEADS, HEAD_SIZE, TOKENS,
                                   LAYOUT, "raw")
    return [BlockKey.of(fingerprint, Namespace("bench"), i.to_bytes(8, "little") * 4)
            for i in range(count)]


def _paged_cache(num_blocks: int) -> list[torch.Tensor]:
    import torch

    gen = torch.Generator(device="cuda").manual_seed(0)
    return [torch.randn((2, num_blocks, TOKENS, HEADS, HEAD_SIZE), generator=gen, device="cuda",
                        dtype=torch.float16) for _ in range(LAYERS)]


def _save(caches: list[torch.Tensor], keys: list[BlockKey], repeats: int
          ) -> dict[str, float]:
    import torch

    from connectors.vllm.layouts import cuda_layout

    spec = cuda_layout(num_kv_heads=HEADS, head_size=HEAD_SIZE, block_size=TOKENS)
    bound = [spec.bind(cache) for cache in caches]
    ids = torch.arange(len(keys), device="cuda")

    def save(codec: str, layerwise: bool) -> Callable[[], None]:
        coder = get_codec(codec)

        def run() -> None:
            gathered = [b.gather(cache, ids) for b, cache in zip(bound, caches, strict=True)]
            for j, key in enumerate(keys):
                layers = [g[j] for g in gathered]
                if layerwise:  # one encode and one copy to host per layer, then the frame
                    segments = [coder.encode(x).data for x in layers]
                    build_frame([(seg, Compression.NONE, len(seg)) for seg in segments],
                                codec=coder.codec_id, dtype=DType.FLOAT16, layout_id=LAYOUT,
                                token_count=TOKENS, layer_shape=BLOCK_SHAPE,
                                key_digest=key.digest)
                else:
                    encode_block(layers, codec=codec, key=key, token_count=TOKENS,
                                 layout_id=LAYOUT, compression="none")
        return run

    nbytes = KV_BYTES * len(keys)
    return {f"save_{codec}{'_layerwise' if layerwise else ''}_gbps":
            _timed(save(codec, layerwise), nbytes, repeats)
            for codec in ("raw", "int8") for layerwise in (False, True)}


def _restore(caches: list[torch.Tensor], keys: list[BlockKey], repeats: int
             ) -> dict[str, float]:
    import torch

    from connectors.vllm.layouts import cuda_layout

    spec = cuda_layout(num_kv_heads=HEADS, head_size=HEAD_SIZE, block_size=TOKENS)
    bound = [spec.bind(cache) for cache in caches]
    ids = torch.arange(len(keys), device="cuda")
    targets = torch.arange(len(keys), 2 * len(keys), device="cuda")
    out: dict[str, float] = {}
    for codec in ("raw", "int8"):
        gathered = [b.gather(cache, ids) for b, cache in zip(bound, caches, strict=True)]
        tier = HostTier(4 * KV_BYTES * len(keys))
        for j, key in enumerate(keys):
            tier.put(key, encode_block([g[j] for g in gathered], codec=codec, key=key,
                                       token_count=TOKENS, layout_id=LAYOUT,
                                       compression="none"))
        reads = [tier.get(key) for key in keys]
        if any(read is None for read in reads):
            raise RuntimeError("the host tier lost a block during the benchmark")
        for where in ("host", "device", "batched"):
            restore = _restorer([r for r in reads if r is not None], keys, bound, caches,
                                targets, where)
            out[f"restore_{codec}_{where}_decode_gbps"] = _timed(restore, KV_BYTES * len(keys),
                                                                 repeats)
        if codec == "int8":
            restored = torch.cat([caches[layer][:, len(keys):2 * len(keys)].flatten()
                                  for layer in range(LAYERS)]).double()
            original = torch.cat([caches[layer][:, :len(keys)].flatten()
                                  for layer in range(LAYERS)]).double()
            out["int8_rel_rms_error"] = float(((restored - original).pow(2).mean().sqrt()
                                               / original.pow(2).mean().sqrt()).item())
        tier.close()
    return out


def _restorer(reads: list[BlockRead], keys: list[BlockKey], bound: list[BoundLayout],
              caches: list[torch.Tensor], targets: torch.Tensor, where: str
              ) -> Callable[[], None]:
    """Every layer of every block into the paged cache at `targets`, decoded on `where`.

    host: into a host staging tensor, then one copy up per layer (the connector until now);
    device: each block's segment decoded straight into a device tensor, one by one;
    batched: all blocks' segments of a layer in one copy up, decoded there together
    (`decode_layer_batch`, what the connector does on a GPU).
    """
    import torch

    device = "cpu" if where == "host" else "cuda"
    staging = torch.empty((len(keys), *BLOCK_SHAPE), dtype=torch.float16, device=device)

    def run() -> None:
        for layer in range(LAYERS):
            if where == "batched":
                errors = decode_layer_batch(reads, layer, staging, keys=keys)
                if any(error is not None for error in errors):
                    raise RuntimeError(f"a block failed to decode: {errors}")
            else:
                for i, read in enumerate(reads):
                    decode_layer(read, layer, out=staging[i], key=keys[i])
            bound[layer].scatter(caches[layer], targets, staging.to("cuda"))
    return run


def _hbm(keys: list[BlockKey], repeats: int) -> dict[str, float]:
    from kvstore.tiers.memory.hbm import HbmTier

    rng = np.random.default_rng(1)
    frames = [encode_block([rng.standard_normal(BLOCK_SHAPE, dtype=np.float32).astype(np.float16)
                            for _ in range(LAYERS)], codec="raw", key=key, token_count=TOKENS,
                           layout_id=LAYOUT, compression="none") for key in keys]
    tier = HbmTier(2 * len(frames[0]) * len(keys))
    buffer = bytearray(len(frames[0]))

    def put() -> None:
        tier.delete(keys)
        for key, frame in zip(keys, frames, strict=True):
            if not tier.put(key, frame):
                raise RuntimeError("the hbm tier refused a block during the benchmark")

    def get() -> None:
        for key in keys:
            if tier.get(key, out=buffer) is None:
                raise RuntimeError("the hbm tier lost a block during the benchmark")

    nbytes = KV_BYTES * len(keys)
    result = {"hbm_put_gbps": _timed(put, nbytes, repeats), "hbm_get_gbps": _timed(get, nbytes,
                                                                                   repeats)}
    tier.close()
    return result


def _stages(caches: list[torch.Tensor], repeats: int) -> dict[str, float]:
    """Where one block's save and restore time goes: GB/s of each step alone (4 MiB blocks)."""
    import torch
    import xxhash

    layers = [cache[:, 0] for cache in caches]  # one block's layers, as strided device views
    stacked = torch.stack(layers).reshape(LAYERS, -1).view(torch.uint8)
    flat = stacked.reshape(-1)
    pinned = torch.empty(KV_BYTES, dtype=torch.uint8).pin_memory()
    reused = np.ones(KV_BYTES, np.uint8)
    host_segments = [segment.data for segment in reused.reshape(LAYERS, -1)]
    digest = bytes(16)
    count = 16

    def each(step: Callable[[], object]) -> Callable[[], None]:
        def run() -> None:
            for _ in range(count):
                step()
        return run

    nbytes = KV_BYTES * count
    steps: dict[str, Callable[[], object]] = {
        "stack_on_device": lambda: torch.stack(layers),
        "d2h_into_fresh_numpy": lambda: torch.from_numpy(np.empty(KV_BYTES, np.uint8)).copy_(flat),
        "d2h_into_reused_numpy": lambda: torch.from_numpy(reused).copy_(flat),
        "d2h_into_pinned": lambda: pinned.copy_(flat),
        "pinned_to_numpy_memcpy": lambda: np.copyto(reused, pinned.numpy()),
        "fresh_numpy_touch": lambda: np.empty(KV_BYTES, np.uint8).fill(0),
        "xxh3_128": lambda: xxhash.xxh3_128_digest(reused.data),
        "build_frame": lambda: build_frame([(seg, Compression.NONE, len(seg))
                                            for seg in host_segments], codec=get_codec("raw")
                                           .codec_id, dtype=DType.FLOAT16, layout_id=LAYOUT,
                                           token_count=TOKENS, layer_shape=BLOCK_SHAPE,
                                           key_digest=digest),
        "h2d_from_reused_numpy": lambda: flat.copy_(torch.from_numpy(reused)),
        "h2d_from_pinned": lambda: flat.copy_(pinned),
    }
    return {name: _timed(each(step), nbytes, repeats) for name, step in steps.items()}


def _quantize_on_device(repeats: int) -> float:
    import torch

    block = torch.randn((LAYERS, *BLOCK_SHAPE), device="cuda", dtype=torch.float16)
    return _timed(lambda: _discard(torch_ops.quantize_many(block)), KV_BYTES, repeats * 4)


def _device(args: argparse.Namespace) -> str:
    import torch

    if args.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.stderr.write("benchmarks.gpu --device cuda needs a CUDA device\n")
        raise SystemExit(2)
    return str(args.device)


def _staged(device: str, quick: bool) -> dict[str, Any]:
    import torch

    if device == "cpu":  # small: exercises the code paths, says nothing about a GPU
        return measure_staged(torch.device("cpu"), shape=Shape(4, 2, 64, 16), count=8,
                              repeats=2, slot_bytes=1 << 20, workers=2)
    tokens = 16
    return measure_staged(torch.device("cuda"), shape=Shape(block_tokens=tokens),
                          count=(1024 if quick else 2048) // tokens, repeats=3 if quick else 7)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    device = _device(args)
    if device == "cpu":
        return {"device": "cpu", "torch": torch.__version__,
                "staged": _staged(device, args.quick)}
    warmup((DType.FLOAT16,))
    repeats = 5 if args.quick else 15
    count = 16 if args.quick else 64
    baseline = _baselines(repeats, (256 if args.quick else 1024) << 20)
    keys = _keys(count)
    caches = _paged_cache(2 * count)
    paths = {**_save(caches, keys, repeats), **_restore(caches, keys, repeats),
             **_hbm(keys, repeats), "int8_quantize_on_device_gbps": _quantize_on_device(repeats)}
    stages = _stages(caches, repeats)
    pageable_d2h, pageable_h2d = baseline["d2h_pageable_gbps"], baseline["h2d_pageable_gbps"]
    ratios = {
        "save_raw_vs_d2h_pageable": paths["save_raw_gbps"] / pageable_d2h,
        "save_int8_vs_d2h_pageable": paths["save_int8_gbps"] / pageable_d2h,
        "save_int8_batched_vs_layerwise": paths["save_int8_gbps"]
        / paths["save_int8_layerwise_gbps"],
        "restore_raw_vs_h2d_pageable": paths["restore_raw_host_decode_gbps"] / pageable_h2d,
        "restore_int8_host_decode_vs_h2d_pageable":
            paths["restore_int8_host_decode_gbps"] / pageable_h2d,
        "restore_int8_device_decode_vs_h2d_pageable":
            paths["restore_int8_device_decode_gbps"] / pageable_h2d,
        "restore_raw_batched_vs_h2d_pageable":
            paths["restore_raw_batched_decode_gbps"] / pageable_h2d,
        "restore_int8_batched_vs_h2d_pageable":
            paths["restore_int8_batched_decode_gbps"] / pageable_h2d,
        "hbm_put_vs_h2d_pageable": paths["hbm_put_gbps"] / pageable_h2d,
        "hbm_get_vs_d2h_pageable": paths["hbm_get_gbps"] / pageable_d2h,
        "int8_quantize_vs_d2d": paths["int8_quantize_on_device_gbps"] / baseline["d2d_gbps"],
    }
    return {"baseline": baseline, "paths": paths, "stages": stages, "ratios": ratios,
            "staged": _staged(device, args.quick),
            "device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "block": {"layers": LAYERS, "tokens": TOKENS, "kv_heads": HEADS,
                      "head_size": HEAD_SIZE, "dtype": "float16", "kv_bytes": KV_BYTES,
                      "blocks_per_step": count}}


def render(results: dict[str, Any]) -> str:
    lines = [f"device: {results['device']} (torch {results['torch']})",
             f"{'figure':46s} {'GB/s':>8s}"]
    for section in ("baseline", "paths", "stages"):
        for name, value in results.get(section, {}).items():
            lines.append(f"{section + '.' + name:46s} {value:8.3f}")
    lines.append("")
    for name, value in results.get("ratios", {}).items():
        lines.append(f"{name:46s} {value:8.2f}")
    staged = results["staged"]
    lines.append("")
    for section in ("baseline", "paths"):
        for name, value in staged[section].items():
            lines.append(f"{'staged.' + section + '.' + name:46s} {value:8.3f}")
    for name, value in staged["ratios"].items():
        target = staged["targets"].get(name)
        lines.append(f"{'staged.' + name:46s} {value:8.2f}"
                     + ("" if target is None else f"  (target >= {target})"))
    lines.append(f"{'staged.restore_2048_tokens_s':46s} {staged['restore_2048_tokens_s']:8.4f}")
    return "\n".join(lines)


def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                        help="cpu: only the staged paths at small sizes (no GPU needed)")


def main(argv: list[str] | None = None) -> int:
    return run_benchmark("gpu", measure, render, argv, extra_args=_arguments)


if __name__ == "__main__":
    raise SystemExit(main())
