"""kvkeep as an LMCache L2 backend, beside LMCache's own fs_native and RESP (Redis) adapters, with
the machine's baselines, all in one run:

    python -m benchmarks.lmcache --quick --json OUT.json [--lmcache-venv .venv-lmcache]

Runs in kvkeep's own venv (it starts the kvkeep daemons and redis-server and measures the
baselines); LMCache's benchmark, `lmcache bench l2`, runs in the LMCache venv that
`make bench-lmcache` builds, once per adapter and phase, so every adapter sees the same driver:

- kvkeep: the plugin (`connectors.lmcache.adapter.KVKeepL2Adapter`) on one daemon, one copy
  (`kvkeep`), on two daemons with two copies of every object (`kvkeep_r2`), and on one daemon
  that does not fsync its disk tier (`kvkeep_nofsync`, `--disk-fsync off`: the durability
  fs_native and redis give, so that one row compares like with like);
- fs_native: LMCache's C++ filesystem adapter on this machine's disk (no fsync);
- resp: LMCache's C++ RESP adapter on a local redis-server (--save '' --appendonly no).

Per adapter, object size and repetition: one `lmcache bench l2` run does store, lookup
(`--lookup-max-hit-rate 1`) and load (warm: fs_native's files are in the page cache); then the
stored files are evicted from the page cache and a second run (`--only load`, the same keys)
loads cold. kvkeep's daemon serves from its RAM tier either way (it also writes behind to its
disk), redis from RAM. Each repetition stores into a fresh place (new fs directory, flushed
redis, new kvkeep scope), and adapters are interleaved per repetition so that all see the
same machine load.

Baselines in the same run: memcpy into a touched buffer, disk write (+fsync, and without),
cold sequential disk read, loopback TCP, redis-py GET/SET of one object size. GB/s are 10^9
bytes per second from the median round duration of LMCache's benchmark (keys per round x
object size / duration). `cold_run_server_cpu_ms_per_object` is the CPU the processes
serving an adapter (the daemons, redis-server; none for fs_native) spent per object of the
load-only run. LMCache's own process cannot be measured so (its start-up would swamp it), so
`plugin_direct` drives the plugin's kvkeep side (`ObjectStore`, no LMCache) on the first
daemon the way LMCache's benchmark drives the adapter, in this process, and records the CPU
per object of both sides: where a rate is bound by CPU, this says whose. The JSON::

    {"baseline": {...}, "adapters": {"kvkeep": {"256KiB": {"store_gbps", "load_gbps",
     "load_cold_gbps", "lookup_us_per_key", "cold_run_server_cpu_ms_per_object", ...}},
     "fs_native": ..., "resp": ...},
     "plugin_direct": {"256KiB": {"store_gbps", "load_gbps", "cpu_ms_per_object": {"store":
     {"client", "server"}, "load": {...}}}, ...},
     "ratios": {"kvkeep/fs_native": {...}, "kvkeep/resp": {...}}, "settings": {...}}
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.baselines import (
    disk_cold_read_gbps,
    disk_write_fsync_gbps,
    drop_file_cache,
    median_gbps,
    memcpy_gbps,
    tcp_loopback_gbps,
)
from benchmarks.cli import run_benchmark
from benchmarks.processes import process_cpu_s
from deploy.local.daemons import DaemonProcess, start_daemon
from deploy.local.services import RedisServer, start_redis
from kvstore.commands.store import MALLOC_ENV

__all__ = ["main", "run"]

ROOT = Path(__file__).resolve().parent.parent
GB = 1e9


@dataclass(frozen=True, slots=True)
class Workload:
    label: str
    object_bytes: int
    keys_per_submit: int
    rounds: int


QUICK = (Workload("256KiB", 256 << 10, 32, 4), Workload("4MiB", 4 << 20, 16, 4))
FULL = (Workload("256KiB", 256 << 10, 32, 10), Workload("4MiB", 4 << 20, 16, 8),
        Workload("16MiB", 16 << 20, 8, 6))


def _progress(message: str) -> None:
    print(f"[lmcache bench] {message}", flush=True)


# -- the baselines ----------------------------------------------------------------------------


def _disk_write_gbps(directory: Path, block_bytes: int, blocks: int = 32) -> float:
    """Files of `block_bytes` written without fsync (what fs_native does), page cache dropped
    afterwards so that each repeat writes into free pages."""
    payload = memoryview(os.urandom(block_bytes))
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        counter = [0]

        def run() -> None:
            for _ in range(blocks):
                counter[0] += 1
                path = Path(tmp) / f"w{counter[0]}"
                with path.open("wb") as f:
                    f.write(payload)

        return median_gbps(block_bytes * blocks, run, 3)


def _redis_gbps(port: int, value_bytes: int, count: int = 32) -> tuple[float, float]:
    """redis-py + hiredis SET then GET of `count` values, sequential: (set GB/s, get GB/s)."""
    import redis

    client = redis.Redis(host="127.0.0.1", port=port)
    value = os.urandom(value_bytes)
    names = [f"baseline:{value_bytes}:{i}" for i in range(count)]
    try:
        set_rate = median_gbps(value_bytes * count,
                               lambda: [client.set(n, value) for n in names] and None, 3)
        get_rate = median_gbps(value_bytes * count,
                               lambda: [client.get(n) for n in names] and None, 3)
        client.delete(*names)
    finally:
        client.close()
    return set_rate, get_rate


def _baselines(tmp: Path, redis_port: int, workloads: tuple[Workload, ...]) -> dict[str, Any]:
    _progress("machine baselines")
    out: dict[str, Any] = {
        "memcpy_gbps": memcpy_gbps(),
        "disk_write_fsync_gbps": disk_write_fsync_gbps(tmp, blocks=32),
        "disk_write_gbps": _disk_write_gbps(tmp, 4 << 20),
        "disk_cold_read_gbps": disk_cold_read_gbps(tmp, blocks=32),
        "tcp_loopback_gbps": tcp_loopback_gbps(4 << 20, 32),
        "redis_set_gbps": {}, "redis_get_gbps": {},
        # kvkeep's daemons make every block durable (one file each, fsync'd, written behind
        # RAM with bounded back-pressure): their store ceiling at each object size.
        "disk_write_fsync_gbps_per_object": {
            w.label: disk_write_fsync_gbps(tmp, block_bytes=w.object_bytes,
                                           blocks=max(8, min(64, (64 << 20) // w.object_bytes)))
            for w in workloads},
    }
    for w in workloads:
        out["redis_set_gbps"][w.label], out["redis_get_gbps"][w.label] = _redis_gbps(
            redis_port, w.object_bytes)
    return out


# -- LMCache's benchmark, per adapter -------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Adapter:
    name: str
    spec: dict[str, Any]
    files: Path | None = None
    """Where the adapter keeps files (evicted from the page cache before the cold load)."""
    servers: tuple[int, ...] = ()
    """The pids of the processes that serve it (kvkeep daemons, redis-server): their CPU time
    counts with LMCache's own."""


def _plugin_direct(daemon: DaemonProcess, w: Workload) -> dict[str, Any]:
    """The plugin's kvkeep side (`ObjectStore`: no LMCache, this venv) on `daemon`, driven like
    LMCache's benchmark drives the adapter (a task of `keys_per_submit` objects stored, then
    loaded, one warm-up round), in this process: GB/s from the median round, and the CPU per
    object of this process (the plugin's client work) and of the daemon, for each operation."""
    from connectors.lmcache.config import PluginSettings
    from connectors.lmcache.keys import ObjectRef
    from connectors.lmcache.store import ObjectStore

    assert daemon.proc is not None
    pid, n = daemon.proc.pid, w.keys_per_submit
    store = ObjectStore.open(PluginSettings.from_params({
        "daemons": {daemon.node_id: daemon.address}, "replicas": 1,
        "model_revision": f"bench-direct-{w.label}-{time.time_ns()}"}))
    payloads = [os.urandom(w.object_bytes) for _ in range(n)]
    outs = [bytearray(w.object_bytes) for _ in range(n)]
    seconds: dict[str, list[float]] = {"store": [], "load": []}
    cpu = {op: {"client": 0.0, "server": 0.0} for op in seconds}
    try:
        for round_ in range(w.rounds + 1):
            refs = [ObjectRef(os.urandom(16), "bench", i) for i in range(n)]
            for op in ("store", "load"):
                client, server = time.process_time(), process_cpu_s(pid)
                started = time.perf_counter()
                ok = (store.store(refs, payloads).ok if op == "store"
                      else all(store.load(refs, outs)))
                elapsed = time.perf_counter() - started
                if not ok:
                    raise RuntimeError(f"plugin_direct: a {op} of {n} objects failed")
                if round_:  # the first round warms up
                    seconds[op].append(elapsed)
                    cpu[op]["client"] += time.process_time() - client
                    cpu[op]["server"] += process_cpu_s(pid) - server
    finally:
        store.close()
    objects = n * w.rounds
    return {f"{op}_gbps": n * w.object_bytes / statistics.median(times) / GB
            for op, times in seconds.items()} | {
        "cpu_ms_per_object": {op: {side: 1e3 * v / objects for side, v in sides.items()}
                              for op, sides in cpu.items()}}


def _lmcache_bench(venv: Path, adapter: _Adapter, w: Workload, out: Path,
                   only: str | None = None) -> dict[str, Any]:
    args = [str(venv / "bin" / "lmcache"), "bench", "l2", "--l2-adapter", json.dumps(adapter.spec),
            "--num-keys", str(w.keys_per_submit), "--data-size-kb", str(w.object_bytes >> 10),
            "--rounds", str(w.rounds), "--warmup-rounds", "1", "--lookup-max-hit-rate", "1.0",
            "--no-skip-verify", "--format", "json", "--output", str(out), "-q"]
    if only is not None:
        args += ["--only", only, "--skip-verify"]
    env = {**os.environ, **MALLOC_ENV, "LMCACHE_TRACK_USAGE": "false",
           "LMCACHE_DISABLE_BANNER": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(args, env=env, cwd=ROOT, capture_output=True, text=True, check=False,
                          timeout=900)
    if done.returncode != 0 or not out.exists():
        raise RuntimeError(f"lmcache bench l2 failed for {adapter.name} ({w.label}):\n"
                           f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    metrics: dict[str, Any] = json.loads(out.read_text())["metrics"]
    return metrics


def _ops(metrics: dict[str, Any], w: Workload) -> dict[str, dict[str, Any]]:
    """LMCache's sections by operation, with GB/s from the median round."""
    per_round = w.object_bytes * w.keys_per_submit
    ops: dict[str, dict[str, Any]] = {}
    for section in metrics.values():
        if not isinstance(section, dict) or "operation" not in section:
            continue
        op = section["operation"].lower()
        p50 = section["duration_p50_ms"] / 1e3
        ops[op] = {"gbps": per_round / p50 / GB if p50 > 0 else 0.0,
                   "success": section["total_success"], "keys": section["total_keys"],
                   "p50_ms": section["duration_p50_ms"],
                   "us_per_key": section["latency_per_key_ms"] * 1e3}
    return ops


def _evict(directory: Path | None) -> None:
    if directory is None:
        return
    subprocess.run(["sync"], check=False)
    for path in directory.rglob("*"):
        if path.is_file():
            drop_file_cache(path)


def _one(venv: Path, adapter: _Adapter, w: Workload, scratch: Path) -> dict[str, Any]:
    warm = _ops(_lmcache_bench(venv, adapter, w, scratch / "all.json"), w)
    _evict(adapter.files)
    # The CPU the serving processes spent on the load-only run, per object (LMCache's own
    # process is not counted: its start-up, torch's import, would swamp it; `plugin_direct`
    # measures the plugin's client side alone).
    servers = [process_cpu_s(pid) for pid in adapter.servers]
    cold = _ops(_lmcache_bench(venv, adapter, w, scratch / "load.json", only="load"), w)
    server = sum(process_cpu_s(pid) - before
                 for pid, before in zip(adapter.servers, servers, strict=True))
    expected = w.keys_per_submit * w.rounds
    for name, op in (("store", warm["store"]), ("load", warm["load"]), ("load", cold["load"])):
        if op["success"] != expected:
            raise RuntimeError(f"{adapter.name} {w.label}: {name} succeeded for "
                               f"{op['success']} of {expected} objects")
    return {"store_gbps": warm["store"]["gbps"], "load_gbps": warm["load"]["gbps"],
            "load_cold_gbps": cold["load"]["gbps"],
            "lookup_us_per_key": warm["lookup"]["us_per_key"],
            "lookup_hits": warm["lookup"]["success"],
            # Every round of the load-only run (warm-up included) loads the task's objects.
            "cold_run_server_cpu_ms_per_object":
                1e3 * server / (w.keys_per_submit * (w.rounds + 1))}


# The daemons' RAM budget, touched at start (--mem-prefault): on these VMs the first touch of
# fresh memory runs at ~0.28 GB/s against ~8.6 GB/s warm, and a daemon that met it on every new
# block measured the machine's memory, not the store (redis's memory is warm by the time it is
# measured: its baseline ran first, and FLUSHALL keeps the allocator's pages).
_DAEMON_MEM = "2GiB"


@contextlib.contextmanager
def _services(tmp: Path) -> Iterator[tuple[RedisServer, list[DaemonProcess]]]:
    """redis, and three daemons: k0 and k1 as deployed (every block fsync'd behind RAM), k2
    with `--disk-fsync off` (page cache only: the durability fs_native and redis give)."""
    with start_redis(tmp) as redis_server:
        daemons: list[DaemonProcess] = []
        try:
            for node, fsync in (("k0", "block"), ("k1", "block"), ("k2", "off")):
                daemons.append(start_daemon(tmp, node, mem_budget=_DAEMON_MEM,
                                            disk_budget="12GiB", wait=False,
                                            extra=("--mem-prefault", "--disk-fsync", fsync)))
            for d in daemons:
                d.wait_healthy(120)
            yield redis_server, daemons
        finally:
            for d in daemons:
                d.terminate()


def _adapters(place: str, tmp: Path, redis: RedisServer, daemons: list[DaemonProcess]
              ) -> list[_Adapter]:
    """The adapters, each storing into a place of its own named `place` (fresh per workload
    and repetition: LMCache's benchmark numbers its keys from 0 in every run)."""
    fs_dir = tmp / f"fs-{place}"
    fs_dir.mkdir()
    kvkeep = {"type": "plugin", "module_path": "connectors.lmcache.adapter",
              "class_name": "KVKeepL2Adapter"}

    def plugin(ds: list[DaemonProcess], label: str) -> dict[str, Any]:
        return {**kvkeep, "adapter_params": {
            "daemons": {d.node_id: d.address for d in ds}, "replicas": len(ds),
            "timeout_ms": 30_000, "model_revision": f"bench-{label}-{place}-{time.time_ns()}"}}

    def pids(ds: list[DaemonProcess]) -> tuple[int, ...]:
        return tuple(proc.pid for d in ds if (proc := d.proc) is not None)

    return [_Adapter("kvkeep", plugin(daemons[:1], "r1"), servers=pids(daemons[:1])),
            _Adapter("kvkeep_r2", plugin(daemons[:2], "r2"), servers=pids(daemons[:2])),
            _Adapter("kvkeep_nofsync", plugin(daemons[2:], "nofsync"),
                     servers=pids(daemons[2:])),
            _Adapter("fs_native", {"type": "fs_native", "base_path": str(fs_dir)}, fs_dir),
            _Adapter("resp", {"type": "resp", "host": "127.0.0.1", "port": redis.port},
                     servers=(redis.proc.pid,))]


def _flush_redis(port: int) -> None:
    import redis

    client = redis.Redis(host="127.0.0.1", port=port)
    try:
        client.flushall()
    finally:
        client.close()


def run(quick: bool, venv: Path) -> dict[str, Any]:
    if not (venv / "bin" / "lmcache").exists():
        raise RuntimeError(f"no LMCache venv at {venv}: run `make bench-lmcache` "
                           f"(or bash benchmarks/lmcache_env.sh {venv})")
    workloads = QUICK if quick else FULL
    repeats = 1 if quick else 3
    samples: dict[str, dict[str, list[dict[str, Any]]]] = {}
    direct: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="kvkeep-lmcache-bench-") as tmp_name:
        tmp = Path(tmp_name)
        with _services(tmp) as (redis, daemons):
            baseline = _baselines(tmp, redis.port, workloads)
            for rep in range(repeats):
                for w in workloads:
                    for adapter in _adapters(f"{w.label}-{rep}", tmp, redis, daemons):
                        _progress(f"repeat {rep + 1}/{repeats}: {adapter.name}, {w.label} "
                                  f"objects x {w.keys_per_submit} per submit")
                        scratch = tmp / f"out-{adapter.name}-{w.label}-{rep}"
                        scratch.mkdir()
                        result = _one(venv, adapter, w, scratch)
                        samples.setdefault(adapter.name, {}).setdefault(w.label, []).append(
                            result)
                        if adapter.files is not None:
                            shutil.rmtree(adapter.files, ignore_errors=True)
                    _flush_redis(redis.port)
                    _progress(f"repeat {rep + 1}/{repeats}: the plugin without LMCache, "
                              f"{w.label}")
                    direct.setdefault(w.label, []).append(_plugin_direct(daemons[0], w))
    adapters = {name: {label: _median(runs) for label, runs in by_size.items()}
                for name, by_size in samples.items()}
    return {"baseline": baseline, "adapters": adapters, "ratios": _ratios(adapters, baseline),
            "plugin_direct": {label: _median(runs) for label, runs in direct.items()},
            "settings": {"repeats": repeats,
                         "workloads": [dataclasses.asdict(w) for w in workloads],
                         "driver": "lmcache bench l2 (LMCache 0.5.6, CPU build), in-flight 1, "
                                   "1 warm-up round; round-trip verification on",
                         "lmcache_venv": str(venv),
                         "kvkeep": "1 daemon, 1 copy; kvkeep_r2: 2 daemons, 2 copies; the "
                                   "daemons serve from RAM and make every block durable "
                                   "(fsync'd file, written behind with back-pressure: acks "
                                   "wait once 512 blocks or 256 MiB are pending); "
                                   "kvkeep_nofsync: 1 daemon, --disk-fsync off (page "
                                   "cache, as fs_native); "
                                   f"every daemon {_DAEMON_MEM} of RAM, --mem-prefault",
                         "fs_native": "C++ fs adapter, 4 workers, no O_DIRECT, no fsync; cold "
                                      "load after evicting its files from the page cache",
                         "resp": "C++ RESP adapter, 8 workers; redis-server --save '' "
                                 "--appendonly no",
                         "malloc_env": MALLOC_ENV}}


def _median(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Field by field (nested mappings too), the median over repetitions."""
    return {k: _median([r[k] for r in runs]) if isinstance(v, dict)
            else statistics.median(r[k] for r in runs) for k, v in runs[0].items()}


def _ratios(adapters: dict[str, dict[str, dict[str, Any]]], baseline: dict[str, Any]
            ) -> dict[str, Any]:
    out: dict[str, Any] = {}
    mine = adapters["kvkeep"]
    pairs = [("kvkeep", other) for other in ("fs_native", "resp", "kvkeep_r2")]
    pairs += [("kvkeep_nofsync", other) for other in ("fs_native", "resp")]
    for ours, other in pairs:
        out[f"{ours}/{other}"] = {
            label: {m: adapters[ours][label][m] / adapters[other][label][m]
                    for m in ("store_gbps", "load_gbps", "load_cold_gbps")
                    if adapters[other][label][m] > 0}
            for label in adapters[ours]}
        out[f"{ours}/{other}_lookup_us"] = {
            label: adapters[ours][label]["lookup_us_per_key"]
            / adapters[other][label]["lookup_us_per_key"]
            for label in adapters[ours] if adapters[other][label]["lookup_us_per_key"] > 0}
    out["kvkeep/tcp_loopback"] = {label: {m: mine[label][m] / baseline["tcp_loopback_gbps"]
                                          for m in ("store_gbps", "load_gbps")}
                                  for label in mine}
    out["kvkeep_store/disk_write_fsync"] = {
        label: mine[label]["store_gbps"] / baseline["disk_write_fsync_gbps_per_object"][label]
        for label in mine}
    out["kvkeep/redis_py"] = {label: {"store": mine[label]["store_gbps"]
                                      / baseline["redis_set_gbps"][label],
                                      "load": mine[label]["load_gbps"]
                                      / baseline["redis_get_gbps"][label]}
                              for label in mine}
    return out


def _table(result: dict[str, Any]) -> str:
    lines: list[str] = []
    add = lines.append
    base = result["baseline"]
    add(f"baselines: memcpy {base['memcpy_gbps']:.1f}, disk write {base['disk_write_gbps']:.2f}"
        f" (+fsync {base['disk_write_fsync_gbps']:.2f}), cold read "
        f"{base['disk_cold_read_gbps']:.2f}, loopback TCP {base['tcp_loopback_gbps']:.2f} GB/s")
    add(f"{'adapter':>10} {'size':>7} {'store':>7} {'load':>7} {'cold':>7} {'lookup us/key':>14}"
        f" {'server CPU ms/object':>21}")
    for name, by_size in result["adapters"].items():
        for label, r in by_size.items():
            add(f"{name:>10} {label:>7} {r['store_gbps']:7.2f} {r['load_gbps']:7.2f} "
                f"{r['load_cold_gbps']:7.2f} {r['lookup_us_per_key']:14.1f} "
                f"{r['cold_run_server_cpu_ms_per_object']:21.3f}")
    for label, r in result["plugin_direct"].items():
        cpu = r["cpu_ms_per_object"]
        add(f"plugin without LMCache {label}: store {r['store_gbps']:.2f} GB/s (CPU ms/object "
            f"client {cpu['store']['client']:.3f}, daemon {cpu['store']['server']:.3f}), load "
            f"{r['load_gbps']:.2f} GB/s (client {cpu['load']['client']:.3f}, daemon "
            f"{cpu['load']['server']:.3f})")
    for label, rs in base["redis_get_gbps"].items():
        add(f"{label}: redis-py SET {base['redis_set_gbps'][label]:.2f}, GET {rs:.2f} GB/s; "
            f"disk write+fsync per object {base['disk_write_fsync_gbps_per_object'][label]:.2f}"
            f" GB/s")
    for pair in ("kvkeep/fs_native", "kvkeep/resp", "kvkeep_nofsync/fs_native",
                 "kvkeep_nofsync/resp"):
        for label, r in result["ratios"][pair].items():
            add(f"{pair} {label}: " + ", ".join(f"{m.removesuffix('_gbps')} x{v:.2f}"
                                                for m, v in r.items()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    def lmcache_venv(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--lmcache-venv", type=Path, default=ROOT / ".venv-lmcache",
                            help="the venv `make bench-lmcache` builds (default .venv-lmcache)")

    return run_benchmark("lmcache", lambda args: run(args.quick, args.lmcache_venv.resolve()),
                         _table, argv, extra_args=lmcache_venv)


if __name__ == "__main__":
    sys.exit(main())
