"""Memory under churn: a daemon and a router fed a stream of new blocks / sessions, far past
what their budgets hold, with their resident memory sampled all along.

    python -m benchmarks.soak --quick --json OUT.json

Daemon: one `kvkeep store serve` subprocess (the allocator settings it runs with in
production) with small budgets, fed new blocks by the project's own client (`RemoteTier`,
blocks over the TCP data plane) until many times its disk's block capacity have gone through
it; every `READ_EVERY`th put is followed by a read of a block put shortly before (it must hit).
Its RSS (and anonymous RSS) is read from /proc every `SAMPLES`th of the run. After a warm-up of
`WARMUP_CAPACITIES` disk capacities (the RAM tier full, the disk tier evicting, every pool and
buffer grown to size) the rest of the run must stay flat: `growth_mib` is the RSS at the end
minus the RSS when warm, `slope_kib_per_1k_blocks` a least-squares fit over the warm samples,
and `flat` says whether growth stayed within `FLAT_MARGIN` of the warm RSS.

Router (benchmarks/soak_router.py): `RouterCore` (its decisions without HTTP or etcd, in this
process) and `kvkeep router serve` (a subprocess, against a fake OpenAI worker on loopback), fed
new sessions whose prompts share rotating prefixes, sampled the same way, with the size of each
of the core's per-session and per-prefix structures at the end. `core` runs with the router's
default limits (caps of a million sessions and prefix keys: a run this short never reaches
them, so it shows the per-session cost until they apply); `core_bounded` with caps small
enough to be reached, and bindings that expire, to show the RSS once every bound applies.

Baselines measured in the same run: the RSS of an idle daemon right after start, and loopback
TCP throughput (the ceiling of the put stream), so the figures read as ratios on any machine.
Data dirs go to /dev/shm when it has room (a fsync there is free, so the soak measures the
daemon, not this machine's disk); `settings.data_dir_fs` says which.

Writes::

    {"baseline": {"tcp_loopback_gbps": f, "daemon_idle_rss_mib": f},
     "daemon": {"blocks": n, "disk_capacity_blocks": n, "capacities": f, "block_bytes": n,
                "puts_per_s": f, "put_gbps_over_loopback": f, "read_hits": n, "read_misses": n,
                "rss_mib": {"start": f, "warm": f, "end": f, "max": f},
                "growth_mib": f, "growth_ratio": f, "slope_kib_per_1k_items": f,
                "bytes_per_item_after_warmup": f, "flat": bool, "samples": [[blocks, mib]...],
                "anon": {... the same for RssAnon}},
     "router": {"core": {"items": n, "structures": {...}, "rss_mib": ..., "flat": bool, ...},
                "core_bounded": {... the same, with caps reached and bindings expiring},
                "http": {...}},
     "settings": {...}}
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.baselines import tcp_loopback_gbps
from benchmarks.cli import run_benchmark
from benchmarks.processes import bench_daemon
from kvstore.commands.store import MALLOC_ENV
from kvstore.frame import CodecId, Compression, DType, build_frame
from kvstore.keys import BlockKey, ModelFingerprint, Namespace
from kvstore.tiers.remote.tier import RemoteConfig, RemoteTier

__all__ = ["main", "rss_mib", "fit_slope"]

SAMPLES = 40
WARMUP_CAPACITIES = 3.0
FLAT_MARGIN = 0.05
"""RSS may grow this much (of the warm RSS) over the rest of the run and still count as flat."""
READ_EVERY = 16
_LAYERS = 8
_FINGERPRINT = ModelFingerprint("soak/model", "w", "float16", _LAYERS, 8, 128, 32, "nhd", "raw")
_NAMESPACE = Namespace("soak")


# -- measuring ----------------------------------------------------------------------------------

def rss_mib(pid: int) -> tuple[float, float]:
    """(VmRSS, RssAnon) of a process, in MiB."""
    values = {}
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            name, _, rest = line.partition(":")
            if name in ("VmRSS", "RssAnon"):
                values[name] = int(rest.split()[0]) / 1024
    return values.get("VmRSS", 0.0), values.get("RssAnon", 0.0)


def fit_slope(points: list[tuple[int, float]]) -> float:
    """Least-squares slope of y over x (0 for fewer than two points)."""
    if len(points) < 2:
        return 0.0
    xs = [float(x) for x, _ in points]
    ys = [y for _, y in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return 0.0 if var == 0 else sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var


def _summary(samples: list[tuple[int, float]], warm_at: int, items: int) -> dict[str, Any]:
    warm = [(n, mib) for n, mib in samples if n >= warm_at]
    warm_rss = warm[0][1] if warm else samples[-1][1]
    end_rss = statistics.fmean(mib for _, mib in samples[-3:])
    growth = end_rss - warm_rss
    slope = fit_slope(warm)  # MiB per item
    after = max(items - warm_at, 1)
    return {"rss_mib": {"start": round(samples[0][1], 1), "warm": round(warm_rss, 1),
                        "end": round(end_rss, 1), "max": round(max(m for _, m in samples), 1)},
            "growth_mib": round(growth, 2),
            "growth_ratio": round(growth / warm_rss, 4) if warm_rss else 0.0,
            "slope_kib_per_1k_items": round(slope * 1024 * 1000, 2),
            "bytes_per_item_after_warmup": round(max(growth, 0.0) * (1 << 20) / after, 1),
            "flat": growth <= FLAT_MARGIN * warm_rss,
            "samples": [[n, round(m, 1)] for n, m in samples]}


# -- the daemon ---------------------------------------------------------------------------------

def _data_root(disk_budget: int) -> Path:
    shm = Path("/dev/shm")
    with contextlib.suppress(OSError):
        if shm.is_dir() and shutil.disk_usage(shm).free > 3 * disk_budget:
            return shm
    return Path(tempfile.gettempdir())


def _frame(key: BlockKey, payload: bytes) -> bytes:
    seg = len(payload) // _LAYERS
    segments = [(memoryview(payload)[i * seg:(i + 1) * seg], Compression.NONE, seg)
                for i in range(_LAYERS)]
    return build_frame(segments, codec=CodecId.RAW, dtype=DType.FLOAT16, layout_id="nhd",
                       token_count=32, layer_shape=(8, seg // 16), key_digest=key.digest)


def soak_daemon(mem_budget: int, disk_budget: int, block_bytes: int, capacities: float
                ) -> dict[str, Any]:
    """Stream `capacities` x the disk's block capacity of new blocks through one daemon."""
    capacity = disk_budget // block_bytes
    blocks = int(capacity * capacities)
    warm_at = int(capacity * WARMUP_CAPACITIES)
    every = max(blocks // SAMPLES, 1)
    payload = os.urandom(block_bytes - 1024)
    root = _data_root(disk_budget)
    hits = misses = 0
    samples: list[tuple[int, float]] = []
    anon: list[tuple[int, float]] = []
    with tempfile.TemporaryDirectory(prefix="kvkeep-soak-", dir=root) as tmp, \
            bench_daemon(Path(tmp) / "daemon", mem_budget=mem_budget, disk_budget=disk_budget,
                         node_id="soak") as (address, pid):
        idle = rss_mib(pid)
        tier = RemoteTier.from_addresses({"soak": address}, RemoteConfig(
            replicas=1, extra_ranks=0, call_timeout=30.0, lookup_timeout=5.0))
        out = bytearray(block_bytes + 4096)
        started = time.perf_counter()
        try:
            for i in range(blocks):
                key = BlockKey.of(_FINGERPRINT, _NAMESPACE, f"b{i}".encode())
                if not tier.put(key, _frame(key, payload)):
                    raise RuntimeError(f"block {i} was not admitted")
                if i % READ_EVERY == READ_EVERY - 1:
                    recent = BlockKey.of(_FINGERPRINT, _NAMESPACE, f"b{i - 8}".encode())
                    if tier.get(recent, out=out) is not None:
                        hits += 1
                    else:
                        misses += 1
                if i % every == 0 or i == blocks - 1:
                    rss, rss_anon = rss_mib(pid)
                    samples.append((i, rss))
                    anon.append((i, rss_anon))
            elapsed = time.perf_counter() - started
        finally:
            tier.close()
    result = {"blocks": blocks, "disk_capacity_blocks": capacity, "capacities": capacities,
              "block_bytes": block_bytes, "mem_budget": mem_budget, "disk_budget": disk_budget,
              "puts_per_s": round(blocks / elapsed, 1),
              "put_gbps": round(blocks * block_bytes / elapsed / 1e9, 3),
              "read_hits": hits, "read_misses": misses, "idle_rss_mib": round(idle[0], 1),
              "data_dir_fs": str(root), **_summary(samples, warm_at, blocks)}
    result["anon"] = _summary(anon, warm_at, blocks)
    result["anon"].pop("samples")
    return result


# -- the router ---------------------------------------------------------------------------------

def soak_router(sessions: int) -> dict[str, Any]:
    from benchmarks.soak_router import soak_router_core, soak_router_http

    return {"core": soak_router_core(sessions),
            "core_bounded": soak_router_core(sessions, bounded=True),
            "http": soak_router_http(max(sessions // 10, 500))}


# -- the benchmark --------------------------------------------------------------------------------

def _measure(args: argparse.Namespace) -> dict[str, Any]:
    if args.quick:
        daemon = soak_daemon(16 << 20, 64 << 20, 16 << 10, 12.0)
        router_sessions = 20_000
    else:
        daemon = soak_daemon(64 << 20, 512 << 20, 128 << 10, 40.0)
        router_sessions = 200_000
    loopback = tcp_loopback_gbps(4 << 20, 16, 3)
    daemon["put_gbps_over_loopback"] = round(daemon["put_gbps"] / loopback, 4)
    results: dict[str, Any] = {
        "baseline": {"tcp_loopback_gbps": round(loopback, 3),
                     "daemon_idle_rss_mib": daemon["idle_rss_mib"]},
        "daemon": daemon,
        "settings": {"warmup_capacities": WARMUP_CAPACITIES, "flat_margin": FLAT_MARGIN,
                     "read_every": READ_EVERY, "malloc_env": MALLOC_ENV,
                     "data_dir_fs": daemon["data_dir_fs"]},
    }
    if not args.skip_router:
        results["router"] = soak_router(router_sessions)
    return results


def _render(results: dict[str, Any]) -> str:
    d = results["daemon"]
    lines = [f"daemon: {d['blocks']} blocks of {d['block_bytes']} B ({d['capacities']}x the disk's "
             f"{d['disk_capacity_blocks']}), {d['puts_per_s']} puts/s, reads {d['read_hits']} hit "
             f"/ {d['read_misses']} miss",
             f"  RSS MiB start {d['rss_mib']['start']} warm {d['rss_mib']['warm']} end "
             f"{d['rss_mib']['end']} (growth {d['growth_mib']} MiB, "
             f"{d['bytes_per_item_after_warmup']} B/block, flat={d['flat']})"]
    for name, r in results.get("router", {}).items():
        lines.append(f"router {name}: {r['items']} sessions, RSS warm {r['rss_mib']['warm']} end "
                     f"{r['rss_mib']['end']} (growth {r['growth_mib']} MiB, flat={r['flat']}); "
                     f"structures {r.get('structures')}")
    return "\n".join(lines)


def _extra(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--skip-router", action="store_true", help="soak the daemon only")


def main(argv: list[str] | None = None) -> int:
    if os.environ.get("KVKEEP_NO_MALLOC_TUNING") != "1" and any(
            os.environ.get(k) != v for k, v in MALLOC_ENV.items()):
        # The client runs under the daemon's allocator settings too (see kvstore/commands/store.py).
        args = [sys.executable, "-m", "benchmarks.soak", *(argv or sys.argv[1:])]
        os.execve(sys.executable, args, {**os.environ, **MALLOC_ENV})
    return run_benchmark("soak", _measure, _render, argv, _extra)


if __name__ == "__main__":
    raise SystemExit(main())
