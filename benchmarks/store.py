"""Block store throughput against this machine's own ceilings, measured in one run.

    python -m benchmarks.store --quick --json OUT.json

Blocks are shaped like a real model's: 32 layers x (K, V) x 32 tokens x 8 KV heads x 128 head
size in fp16 = 4 MiB. Every figure is GB/s of fp16 KV bytes; the `ratios` section divides by the
baseline each target names (issue 2):

- host get >= 0.5x memcpy; int8 quantize >= 0.5x and dequantize >= 0.25x memcpy;
- nvme put >= 0.7x a raw fsync'd write, nvme get >= 0.7x a raw cold read;
- int8 relative RMS error <= 1 % on Gaussian data.

Gets copy into a caller-provided, already-touched buffer and puts copy from one, as the vLLM
connector does. nvme puts include the fsyncs that make them durable; nvme gets are cold (each
file is evicted from the page cache before it is read).

The `small` section is the nvme tier with 256 KiB blocks (LMCache's chunk size, a short vLLM
block) written as the daemons' write-behind writes them, `put_many` of 16 at a time, durable,
against this disk's rate for writing and fsyncing files of that size one by one (the floor of
a tier that keeps a file per block, as this one does), and the start-up scan of what it wrote.
Its rates are GB/s of frame bytes, the bytes its floor writes. Beside them, what creating one
empty file costs on this disk (`file_create_us`), the fixed part of both. Reported, with no
target.

The `reads` section is the store's read path as the connector uses it: `TieredStore.get` of a
host hit and of an nvme hit (a disk read: the tier drops each block's pages once read), alone
and followed by decoding every layer. Each read is verified once (the nvme tier hashes its own
reads, the store the host tier's; decoding hashes neither), so `get + decode` costs a copy and
a hash over `get`'s figure, no more. Reported, with no target.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.baselines import (
    disk_cold_read_gbps,
    disk_write_fsync_gbps,
    drop_file_cache,
    file_create_us,
    memcpy_gbps,
)
from benchmarks.cli import run_benchmark
from benchmarks.plots import RatioPanel
from benchmarks.progress import progress
from kvstore.block import decode_layers, encode_block
from kvstore.codecs import get_codec, warmup
from kvstore.frame import DType
from kvstore.keys import BlockKey, ModelFingerprint, Namespace
from kvstore.store import StoreConfig, TieredStore
from kvstore.tiers.memory.host import HostTier
from kvstore.tiers.nvme.tier import NvmeTier

LAYERS, TOKENS, HEADS, HEAD_SIZE = 32, 32, 8, 128
LAYER_SHAPE = (2, TOKENS, HEADS, HEAD_SIZE)
SMALL_TOKENS = 2  # 32 layers x 2 x 2 tokens x 8 heads x 128 x fp16 = 256 KiB
KV_BYTES = LAYERS * 2 * TOKENS * HEADS * HEAD_SIZE * 2  # fp16


def _rate(nbytes: int, run: Callable[[int], None], count: int, repeats: int) -> float:
    """Median GB/s over `repeats` of `count` calls of run(i), each moving `nbytes`."""
    run(0)
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        for i in range(count):
            run(i)
        rates.append(nbytes * count / (time.perf_counter() - start) / 1e9)
    return statistics.median(rates)


def _blocks(count: int, tokens: int = TOKENS) -> tuple[list[BlockKey], list[bytes]]:
    fingerprint = ModelFingerprint("bench", "random", "float16", LAYERS, HEADS, HEAD_SIZE, tokens,
                                   "bench-2thd", "raw")
    rng = np.random.default_rng(0)
    keys, frames = [], []
    for i in range(count):
        key = BlockKey.of(fingerprint, Namespace("bench"), i.to_bytes(8, "little") * 4)
        layers = [rng.standard_normal((2, tokens, HEADS, HEAD_SIZE), dtype=np.float32)
                  .astype(np.float16) for _ in range(LAYERS)]
        keys.append(key)
        frames.append(encode_block(layers, codec="raw", key=key, token_count=tokens,
                                   layout_id="bench-2thd", compression="none"))
    return keys, frames


def _codec(repeats: int) -> dict[str, float]:
    warmup((DType.FLOAT16,))
    codec = get_codec("int8")
    rng = np.random.default_rng(1)
    # A whole block's worth of layers, quantized as the connector does it: layer by layer.
    layers = [rng.standard_normal(LAYER_SHAPE, dtype=np.float32).astype(np.float16)
              for _ in range(LAYERS)]
    size = codec.encoded_size(LAYER_SHAPE, DType.FLOAT16)
    encoded = [np.empty(size, np.uint8) for _ in range(LAYERS)]
    decoded = [np.empty_like(x) for x in layers]

    def quantize(_: int) -> None:
        for x, out in zip(layers, encoded, strict=True):
            codec.encode(x, out=out)

    def dequantize(_: int) -> None:
        for data, out in zip(encoded, decoded, strict=True):
            codec.decode(data, LAYER_SHAPE, DType.FLOAT16, out=out)

    q = _rate(KV_BYTES, quantize, 20, repeats)
    dq = _rate(KV_BYTES, dequantize, 20, repeats)
    ref = np.concatenate([x.astype(np.float64).ravel() for x in layers])
    got = np.concatenate([x.astype(np.float64).ravel() for x in decoded])
    rel_rms = float(np.sqrt(np.mean((ref - got) ** 2)) / np.sqrt(np.mean(ref**2)))
    return {"int8_quantize_gbps": q, "int8_dequantize_gbps": dq, "int8_rel_rms_error": rel_rms}


def _host(keys: list[BlockKey], frames: list[bytes], repeats: int) -> dict[str, float]:
    frame_size = len(frames[0])
    sources = [bytearray(f) for f in frames]  # caller-owned, already-touched buffers
    out = bytearray(frame_size)
    tier = HostTier(frame_size * (len(keys) + 2))
    for key, frame in zip(keys, sources, strict=True):  # fault the slabs in once
        tier.put(key, frame)
    n = len(keys)

    def put(i: int) -> None:
        tier.delete([keys[i % n]])
        tier.put(keys[i % n], sources[i % n])

    def get(i: int) -> None:
        if tier.get(keys[i % n], out=out) is None:
            raise RuntimeError("host tier lost a block during the benchmark")

    result = {"host_put_gbps": _rate(KV_BYTES, put, 4 * n, repeats),
              "host_get_gbps": _rate(KV_BYTES, get, 4 * n, repeats)}
    tier.close()
    return result


def _nvme(directory: Path, keys: list[BlockKey], frames: list[bytes], repeats: int
          ) -> dict[str, float]:
    out = bytearray(len(frames[0]))
    n = len(keys)
    puts, gets = [], []
    for attempt in range(repeats):
        with tempfile.TemporaryDirectory(dir=directory) as tmp:
            tier = NvmeTier(Path(tmp) / "nvme", 8 * KV_BYTES * (n + 2))
            start = time.perf_counter()
            for key, frame in zip(keys, frames, strict=True):
                if not tier.put(key, frame):
                    raise RuntimeError("nvme tier refused a block during the benchmark")
            puts.append(KV_BYTES * n / (time.perf_counter() - start) / 1e9)
            for path in (Path(tmp) / "nvme").rglob("*"):
                if path.is_file():
                    drop_file_cache(path)
            start = time.perf_counter()
            for key in keys:
                if tier.get(key, out=out) is None:
                    raise RuntimeError("nvme tier lost a block during the benchmark")
            gets.append(KV_BYTES * n / (time.perf_counter() - start) / 1e9)
            tier.close()
        del attempt
    return {"nvme_put_gbps": statistics.median(puts), "nvme_get_gbps": statistics.median(gets)}


def _small(directory: Path, count: int, repeats: int) -> dict[str, float]:
    """256 KiB blocks: durable put_many in 16s, the per-file write+fsync floor, the scan."""
    keys, frames = _blocks(count, SMALL_TOKENS)
    nbytes = sum(len(f) for f in frames)
    puts, scans = [], []
    for _ in range(repeats):
        with tempfile.TemporaryDirectory(dir=directory) as tmp:
            root = Path(tmp) / "nvme"
            with NvmeTier(root, 2 * nbytes) as tier:
                start = time.perf_counter()
                for i in range(0, count, 16):
                    if not all(tier.put_many(list(zip(keys[i:i + 16], frames[i:i + 16],
                                                      strict=True)))):
                        raise RuntimeError("nvme tier refused a block during the benchmark")
                puts.append(nbytes / (time.perf_counter() - start) / 1e9)
            start = time.perf_counter()
            with NvmeTier(root, 2 * nbytes) as tier:
                scans.append((time.perf_counter() - start) / count)
                if tier.stats().blocks != count:
                    raise RuntimeError("the start-up scan lost a block during the benchmark")
    floor = disk_write_fsync_gbps(directory, len(frames[0]), count, repeats)
    put = statistics.median(puts)
    return {"frame_bytes": len(frames[0]), "nvme_put_many_gbps": put,
            "disk_write_fsync_per_file_gbps": floor, "put_many_vs_per_file_fsync": put / floor,
            "scan_us_per_block": 1e6 * statistics.median(scans),
            "file_create_us": file_create_us(directory, count)}


def _store_reads(directory: Path, keys: list[BlockKey], frames: list[bytes], repeats: int
                 ) -> dict[str, float]:
    out = bytearray(len(frames[0]))
    layers = [np.empty(LAYER_SHAPE, np.float16) for _ in range(LAYERS)]
    n = len(keys)
    result: dict[str, float] = {}
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        stores = {"host": TieredStore([HostTier(len(frames[0]) * (n + 2))]),
                  "nvme": TieredStore([NvmeTier(Path(tmp) / "nvme", 8 * KV_BYTES * (n + 2))],
                                      config=StoreConfig(promote=False, get_deadline_s=30.0))}
        for name, store in stores.items():
            for key, frame in zip(keys, frames, strict=True):
                if not store.put(key, frame):
                    raise RuntimeError(f"{name} store refused a block during the benchmark")

            def get(i: int, store: TieredStore = store) -> None:
                if store.get(keys[i % n], out=out) is None:
                    raise RuntimeError("the store lost a block during the benchmark")

            def get_decode(i: int, store: TieredStore = store) -> None:
                read = store.get(keys[i % n], out=out)
                if read is None:
                    raise RuntimeError("the store lost a block during the benchmark")
                decode_layers(read, out=layers, key=keys[i % n])

            result[f"{name}_store_get_gbps"] = _rate(KV_BYTES, get, 2 * n, repeats)
            result[f"{name}_store_get_decode_gbps"] = _rate(KV_BYTES, get_decode, 2 * n, repeats)
            store.close()
    return result


def measure(args: argparse.Namespace) -> dict[str, Any]:
    repeats = 3 if args.quick else 7
    count = 16 if args.quick else 64
    directory = Path(args.dir)
    keys, frames = _blocks(count)
    progress(f"baselines: memcpy, disk write+fsync, cold disk read ({repeats} repeats)")
    baseline = {
        "memcpy_gbps": memcpy_gbps(256 << 20, repeats),
        "disk_write_fsync_gbps": disk_write_fsync_gbps(directory, len(frames[0]), count, repeats),
        "disk_read_gbps": disk_cold_read_gbps(directory, len(frames[0]), count, repeats),
    }
    progress("codecs: int8 quantize / dequantize")
    codec = _codec(repeats)
    progress(f"tiers: host and nvme put/get of {count} blocks")
    tiers = {**_host(keys, frames, repeats), **_nvme(directory, keys, frames, repeats)}
    progress("the store: verified reads and decodes")
    reads = _store_reads(directory, keys, frames, repeats)
    progress("nvme: 256 KiB blocks, durable put_many and the start-up scan")
    small = _small(directory, 64 if args.quick else 256, repeats)
    memcpy = baseline["memcpy_gbps"]
    ratios = {
        "host_get_vs_memcpy": tiers["host_get_gbps"] / memcpy,
        "int8_quantize_vs_memcpy": codec["int8_quantize_gbps"] / memcpy,
        "int8_dequantize_vs_memcpy": codec["int8_dequantize_gbps"] / memcpy,
        "nvme_put_vs_fsync_write": tiers["nvme_put_gbps"] / baseline["disk_write_fsync_gbps"],
        "nvme_get_vs_cold_read": tiers["nvme_get_gbps"] / baseline["disk_read_gbps"],
    }
    targets = {"host_get_vs_memcpy": 0.5, "int8_quantize_vs_memcpy": 0.5,
               "int8_dequantize_vs_memcpy": 0.25, "nvme_put_vs_fsync_write": 0.7,
               "nvme_get_vs_cold_read": 0.7}
    met = {name: ratios[name] >= target for name, target in targets.items()}
    met["int8_rel_rms_error"] = codec["int8_rel_rms_error"] <= 0.01
    return {"baseline": baseline, "codec": codec, "tiers": tiers, "reads": reads, "small": small,
            "ratios": ratios,
            "targets": targets, "targets_met": met,
            "block": {"layers": LAYERS, "tokens": TOKENS, "kv_heads": HEADS,
                      "head_size": HEAD_SIZE, "dtype": "float16", "kv_bytes": KV_BYTES,
                      "frame_bytes": len(frames[0])}}


def render(results: dict[str, Any]) -> str:
    lines = [f"{'figure':34s} {'GB/s':>8s}"]
    for section in ("baseline", "codec", "tiers", "reads", "small"):
        for name, value in results[section].items():
            lines.append(f"{section + '.' + name:34s} {value:8.3f}")
    lines.append("")
    lines.append(f"{'ratio':34s} {'value':>8s} {'target':>8s}  met")
    for name, value in results["ratios"].items():
        target = results["targets"][name]
        lines.append(f"{name:34s} {value:8.2f} {target:8.2f}  {results['targets_met'][name]}")
    return "\n".join(lines)


def plots(results: dict[str, Any]) -> list[RatioPanel]:
    return [RatioPanel("the store against this machine's memcpy and disk",
                       results["ratios"], baseline="memcpy / disk", targets=results["targets"])]


def _extra(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dir", default=tempfile.gettempdir(),
                        help="a directory on the disk to measure (default: the temp dir)")


if __name__ == "__main__":
    sys.exit(run_benchmark("store", measure, render, extra_args=_extra, plots=plots))
