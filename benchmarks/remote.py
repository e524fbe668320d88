"""The remote tier against its baselines, and its two block transports against each other, all
on loopback in one run.

    python -m benchmarks.remote --quick --json OUT.json

Measures, in the same run: raw loopback TCP (the ceiling of any network store here), redis-py +
hiredis GET/SET against a local redis-server (the side-by-side baseline), and the remote tier
(`RemoteTier` -> one `kvkeep store serve` daemon subprocess) get/put at 1, 4 and 16 MiB blocks
over each block transport: the TCP data plane and gRPC (kvstore/net/), plus the p99 latency of
a batched lookup of 1,000 keys (and of the same question asked of redis: a pipeline of 1,000
EXISTS), and the p50 of a one-key lookup over each transport beside one EXISTS. Writes::

    {"baseline": {"tcp_loopback_gbps": f,
                  "redis_get_gbps": {"1MiB": f, "4MiB": f, "16MiB": f}, "redis_set_gbps": {...},
                  "redis_exists_1000_p99_ms": f, "redis_exists_1_p50_us": f},
     "remote":   {"get_gbps": {...}, "put_gbps": {...}, "lookup_p99_ms": f,
                  "lookup_1_p50_us": {"tcp": f, "grpc": f}, "transport": "tcp" | "grpc"},
     "transports": {"tcp":  {"get_gbps": {...}, "put_gbps": {...},
                             "rounds": {"get": {"4MiB": [f, ...], ...}, "put": {...}}},
                    "grpc": {...}},
     "tcp_over_grpc": {"get": {"1MiB": f, ...}, "put": {...}},   # median of per-round ratios
     "grpc_cpu_over_tcp": {"get": {...}, "put": {...}},   # CPU per GB, likewise
     "remote_grpc_only": {"get_gbps": {...}, "put_gbps": {...}},
     "redis_cluster": {"kvkeep_get_gbps": {...}, "kvkeep_put_gbps": {...},
                       "redis_get_gbps": {...}, "redis_set_gbps": {...},
                       "get_over_redis": {...}, "put_over_redis": {...},
                       "kvkeep_lookup_1000_p99_ms": f, "redis_exists_1000_p99_ms": f, ...},
     "batched_256KiB": {"nothing": {"kvkeep_gbps": f, "redis_mget_gbps": f,
                                    "kvkeep_over_redis": f, "kvkeep_put_gbps": f,
                                    "redis_mset_gbps": f, "put_over_redis": f},
                        "busy_thread": {...}},
     "settings": {...}}

GB/s are 10^9 bytes of frame per second, sequential calls from one client thread, median over
rounds. Gets copy into a caller-provided, already-touched buffer, as the connector does.
`remote` is the tier as deployed (blocks over the TCP data plane); `transports` holds both
transports, measured in ABBA order in every round (TCP, gRPC, gRPC, TCP: each transport's
round figure is the mean of its two phases, so machine load that drifts during a round hits
both alike); `tcp_over_grpc` is the median over rounds of each round's TCP / gRPC ratio
(paired, so that a loaded round lowers both sides of its own ratio). Each phase also records
the CPU seconds per GB it cost this process and the daemon together (`*_cpu_s_per_gb`,
`grpc_cpu_over_tcp`): on a machine shared with other work, wall-clock rates mostly measure the
neighbours, while the CPU a transport burns per byte is its own.

`redis_cluster` is the Redis Cluster row: a real cluster of 3 masters and 3 replicas on loopback
(deploy/local/services.py, as in the tests), the redis tier over it (`RedisTier` with seed
nodes: redis-py's `RedisCluster` + hiredis, frames of more than 4 MiB in 4 MiB chunks on one
slot) against redis-py's own `RedisCluster` GET/SET of plain values of the same size on the
same cluster, interleaved round by round (AB, then BA), medians; its `*_over_redis` are the
median of per-round ratios. The kvkeep daemons' figures for the same sizes are `remote` above.

`batched_256KiB` is a batch of 32 blocks of 256 KiB (one LMCache load task's worth) read in
one call, the remote tier's `get_into` (one GET_MANY request) against redis-py's MGET of 32
values of 256 KiB, and written in one call, `put_many` (one PUT_MANY request; the daemon
writes every block behind to its disk, redis keeps it in RAM) against MSET, alternated round
by round: alone, and beside a Python thread in this
process that never waits (as LMCache's or vLLM's own threads can be beside the store's
client). Beside it, every system call that releases the interpreter lock costs a wait to
take it back, so that row measures how few each client makes.

gRPC is measured tuned: the glibc allocator settings the daemon uses apply to this client
process too, messages of 4 MiB with 16 MiB flow-control windows, the zero-copy codec of the
bulk messages, and the daemon encodes Get messages straight from the block's pages and copies
Put data straight into reserved pages. (Other channel options were tried and did not help
here: HTTP/2 frames up to 4 MiB, larger TCP read chunks and write buffers, no BDP probe, 32 MiB
messages; see kvstore/net/grpc_options.py.)

Fairness: the process re-executes itself once with the glibc allocator settings the daemon
also uses (see kvstore/commands/store.py), so redis-py and the remote tier's client run under the
same settings (`settings` in the JSON says so). Redis and the remote tier are measured
interleaved, round by round, and after each remote put phase the run waits until the daemon
has written those blocks to disk (its write-behind), so that persisting them does not steal
CPU from the next measurement, redis's or ours. Redis keeps nothing on disk (--save '',
--appendonly no); the daemon's puts are persisted.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

from benchmarks.baselines import tcp_loopback_gbps
from benchmarks.cli import run_benchmark
from benchmarks.plots import RatioPanel
from benchmarks.processes import bench_daemon, free_port, process_cpu_s, stop_process
from benchmarks.progress import progress
from kvstore.commands.store import MALLOC_ENV
from kvstore.frame import CodecId, Compression, DType, build_frame
from kvstore.keys import BlockKey, ModelFingerprint, Namespace
from kvstore.net.daemon_client import DaemonClient, DaemonStat
from kvstore.net.grpc_options import channel_options
from kvstore.tiers.base import Buffer, Tier
from kvstore.tiers.remote.tier import RemoteConfig, RemoteTier

__all__ = ["main", "run"]

SIZES = {"1MiB": 1 << 20, "4MiB": 4 << 20, "16MiB": 16 << 20}
BATCH = 32  # blocks a batched read asks for (one LMCache load task of 256 KiB objects)
BATCH_BLOCK_BYTES = 256 << 10
BATCH_SECONDS = 0.3  # each timed sample repeats its batch for at least this long
_LAYERS = 32
_FINGERPRINT = ModelFingerprint("bench/model", "w", "float16", _LAYERS, 8, 128, 32, "nhd", "raw")
_NAMESPACE = Namespace("bench")


def _wait_port(port: int, proc: subprocess.Popen[bytes], timeout: float = 20.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited with {proc.returncode}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        time.sleep(0.02)
    raise TimeoutError(f"nothing listening on port {port}")


@contextlib.contextmanager
def _redis_server(tmp: Path) -> Iterator[int]:
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server is not installed (make setup)")
    port = free_port()
    proc = subprocess.Popen([binary, "--bind", "127.0.0.1", "--port", str(port), "--save", "",
                             "--appendonly", "no", "--dir", str(tmp),
                             "--proto-max-bulk-len", "1gb"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_port(port, proc)
        yield port
    finally:
        stop_process(proc)


_PAYLOAD: dict[int, bytes] = {}


def _frame(key: BlockKey, size: int) -> bytes:
    """A frame of about `size` bytes bound to `key`: 32 layers of random (incompressible) bytes,
    the same random bytes for every key of one size so that building frames stays cheap."""
    seg = max((size - 4096) // _LAYERS, 16)
    if seg not in _PAYLOAD:
        _PAYLOAD[seg] = os.urandom(seg)
    segments = [(_PAYLOAD[seg], Compression.NONE, seg) for _ in range(_LAYERS)]
    return build_frame(segments, codec=CodecId.RAW, dtype=DType.FLOAT16, layout_id="nhd",
                       token_count=32, layer_shape=(8, seg // 16), key_digest=key.digest)


def _key(tag: str, i: int) -> BlockKey:
    return BlockKey.of(_FINGERPRINT, _NAMESPACE, f"{tag}-{i}".encode())


class _Rates:
    """Throughput samples per measurement name; medians at the end."""

    def __init__(self) -> None:
        self.samples: dict[str, list[float]] = {}

    def time(self, name: str, nbytes: int, work: Callable[[], None], record: bool) -> None:
        started = time.perf_counter()
        work()
        elapsed = time.perf_counter() - started
        if record:
            self.samples.setdefault(name, []).append(nbytes / elapsed / 1e9)

    def median(self, name: str) -> float:
        return statistics.median(self.samples[name])


def _settle(stat: DaemonClient, timeout: float = 60.0) -> None:
    """Wait until the daemon's write-behind queue is empty (its puts are on disk)."""
    end = time.monotonic() + timeout
    while _stat(stat).pending_writes and time.monotonic() < end:
        time.sleep(0.005)


def _stat(stat: DaemonClient) -> DaemonStat:
    return stat.stat(timeout=10.0)


def _bench_config(data_plane: bool) -> RemoteConfig:
    return RemoteConfig(replicas=1, extra_ranks=0, call_timeout=30.0, lookup_timeout=5.0,
                        data_plane=data_plane)


_ABBA = ("tcp", "grpc", "grpc", "tcp")


def _measure(redis_port: int, address: str, daemon_pid: int, total: int, repeats: int
             ) -> tuple[_Rates, list[float], dict[str, float], str,
                        dict[str, dict[str, float]]]:
    """Redis and both transports interleaved round by round, so that all see the same machine
    load (these machines are noisy: a run of one after the other compares two moments)."""
    import redis

    rates = _Rates()
    client = redis.Redis(host="127.0.0.1", port=redis_port)
    tiers = {"tcp": RemoteTier.from_addresses({"bench": address}, _bench_config(True)),
             "grpc": RemoteTier.from_addresses({"bench": address}, _bench_config(False))}
    stat = DaemonClient("bench", address, data_plane=False)
    tcp_samples: list[float] = []
    latency: dict[str, float] = {}
    try:
        for label, size in SIZES.items():
            count = max(total // size, 4)
            progress(f"{label} blocks: redis and both transports, {repeats} ABBA rounds")
            value = os.urandom(size)
            names = [f"bench:{label}:{i}" for i in range(count)]
            frame_bytes = len(_frame(_key(label, 0), size))
            out = bytearray(b"\1" * frame_bytes)  # touched once, reused for every get
            for r in range(repeats + 1):  # round 0 warms up, unrecorded
                record = r > 0

                def redis_set(names: list[str] = names, value: bytes = value) -> None:
                    for name in names:
                        client.set(name, value)

                def redis_get(names: list[str] = names) -> None:
                    for name in names:
                        if client.get(name) is None:
                            raise RuntimeError("redis lost a value")

                rates.time(f"redis_set/{label}", size * count, redis_set, record)
                rates.time(f"redis_get/{label}", size * count, redis_get, record)
                client.delete(*names)
                phases: dict[str, list[dict[str, float]]] = {"tcp": [], "grpc": []}
                for phase, kind in enumerate(_ABBA):
                    keys = [_key(f"{label}-{r}-{phase}", i) for i in range(count)]
                    frames = [(k, _frame(k, size)) for k in keys]
                    nbytes = frame_bytes * count
                    put, put_cpu = _timed(nbytes, partial(_put, tiers[kind], frames), daemon_pid)
                    _settle(stat)
                    get, get_cpu = _timed(nbytes, partial(_get, tiers[kind], keys, out), daemon_pid)
                    phases[kind].append({"get": get, "put": put, "get_cpu": get_cpu,
                                         "put_cpu": put_cpu})
                    tiers[kind].delete(keys)
                    _settle(stat)
                if record:
                    for kind, pair in phases.items():
                        for name in pair[0]:
                            rates.samples.setdefault(f"{kind}_{name}/{label}", []).append(
                                statistics.fmean(p[name] for p in pair))
                    tcp_samples.append(tcp_loopback_gbps(4 << 20, 16, 1))
        tier = tiers["tcp"]
        progress(f"{BATCH} x 256 KiB batched reads and writes: alone and beside a busy Python "
                 "thread")
        batched = _measure_batched(client, tier, stat, repeats)
        # A batched lookup of 1,000 keys, all present; redis answers the same question with a
        # pipeline of 1,000 EXISTS. Interleaved, like the rest.
        keys = [_key("lookup", i) for i in range(1000)]
        tier.put_many([(k, _frame(k, 4096)) for k in keys])
        names = [f"bench:lookup:{i}" for i in range(1000)]
        client.mset({name: b"x" for name in names})
        _settle(stat)
        samples: list[float] = []
        redis_samples: list[float] = []
        for _ in range(300):
            started = time.perf_counter()
            found = tier.contains(keys)
            samples.append((time.perf_counter() - started) * 1e3)
            if not all(found):
                raise RuntimeError("lookup missed stored keys")
            started = time.perf_counter()
            pipe = client.pipeline(transaction=False)
            for name in names:
                pipe.exists(name)
            exists = pipe.execute()
            redis_samples.append((time.perf_counter() - started) * 1e3)
            if not all(exists):
                raise RuntimeError("redis lost lookup keys")
        latency["lookup_p99_ms"] = statistics.quantiles(samples[20:], n=100)[98]
        latency["lookup_p50_ms"] = statistics.median(samples[20:])
        latency["redis_exists_1000_p99_ms"] = statistics.quantiles(redis_samples[20:], n=100)[98]
        # One key's lookup, the call on a request's critical path (a short prompt's prefix, an
        # LMCache lookup-and-lock): over the data plane, over gRPC, and redis' EXISTS,
        # interleaved one by one.
        one: dict[str, list[float]] = {"tcp": [], "grpc": [], "redis": []}
        asks: dict[str, Callable[[], object]] = {"tcp": partial(tiers["tcp"].contains, keys[:1]),
                                                 "grpc": partial(tiers["grpc"].contains, keys[:1]),
                                                 "redis": partial(client.exists, names[0])}
        for i in range(1500):
            for kind, ask in asks.items():
                started = time.perf_counter()
                found_one = ask()
                if not (all(found_one) if isinstance(found_one, list) else found_one):
                    raise RuntimeError(f"a one-key lookup ({kind}) missed a stored key")
                if i >= 100:
                    one[kind].append((time.perf_counter() - started) * 1e6)
        for kind, us in one.items():
            latency[f"lookup_1_{kind}_p50_us"] = statistics.median(us)
        transport = "tcp" if tier.data_plane_addresses().get("bench") else "grpc"
    finally:
        for t in tiers.values():
            t.close()
        stat.close()
        client.close()
    return rates, tcp_samples, latency, transport, batched


def _measure_batched(client: Any, tier: RemoteTier, stat: DaemonClient, repeats: int
                     ) -> dict[str, dict[str, float]]:
    """BATCH x 256 KiB read as one batch (`RemoteTier.get_into`: one GET_MANY request; redis-py:
    one MGET) and written as one (`put_many`: one PUT_MANY; MSET), alone and beside a Python
    thread that never waits, as LMCache's or vLLM's own threads in the caller's process can
    be: both clients then wait for the interpreter lock after each system call that released
    it, so the figure says how few they make."""
    keys = [_key("batch", i) for i in range(BATCH)]
    frames = [(k, _frame(k, BATCH_BLOCK_BYTES)) for k in keys]
    if not all(tier.put_many(frames)):
        raise RuntimeError("the daemon did not admit a block")
    names = [f"bench:batch:{i}" for i in range(BATCH)]
    values = {name: os.urandom(BATCH_BLOCK_BYTES) for name in names}
    client.mset(values)
    _settle(stat)
    outs: list[Buffer | None] = [bytearray(b"\1" * len(frame)) for _, frame in frames]
    nbytes = sum(len(frame) for _, frame in frames)

    def kvkeep() -> None:
        if any(read is None for read in tier.get_into(keys, outs)):
            raise RuntimeError("a stored block was not found")

    def redis_mget() -> None:
        if any(value is None for value in client.mget(names)):
            raise RuntimeError("redis lost a value")

    def kvkeep_put() -> None:  # the same blocks again, as the put rows above
        if not all(tier.put_many(frames)):
            raise RuntimeError("the daemon did not admit a block")

    def redis_mset() -> None:
        client.mset(values)

    works: dict[str, Callable[[], None]] = {"kvkeep": kvkeep, "redis_mget": redis_mget,
                                            "kvkeep_put": kvkeep_put, "redis_mset": redis_mset}
    result: dict[str, dict[str, float]] = {}
    for beside in ("nothing", "busy_thread"):
        stop = threading.Event()
        spinner = threading.Thread(target=_spin, args=(stop,), daemon=True)
        if beside == "busy_thread":
            spinner.start()
        samples: dict[str, list[float]] = {name: [] for name in works}
        try:
            for round_ in range(repeats + 1):  # round 0 warms up, unrecorded
                for name, work in works.items():
                    rate = _repeated_rate(nbytes, work, BATCH_SECONDS)
                    if round_:
                        samples[name].append(rate)
        finally:
            stop.set()
            if spinner.is_alive():
                spinner.join()
        result[beside] = {
            "kvkeep_gbps": statistics.median(samples["kvkeep"]),
            "redis_mget_gbps": statistics.median(samples["redis_mget"]),
            "kvkeep_over_redis": statistics.median(
                ours / theirs for ours, theirs in zip(samples["kvkeep"], samples["redis_mget"],
                                                      strict=True)),
            "kvkeep_put_gbps": statistics.median(samples["kvkeep_put"]),
            "redis_mset_gbps": statistics.median(samples["redis_mset"]),
            "put_over_redis": statistics.median(
                ours / theirs for ours, theirs in zip(samples["kvkeep_put"],
                                                      samples["redis_mset"], strict=True))}
        _settle(stat)  # the puts' writes behind, before the next setting's rounds
    tier.delete(keys)
    client.delete(*names)
    return result


def _spin(stop: threading.Event) -> None:
    while not stop.is_set():
        pass


def _repeated_rate(nbytes: int, work: Callable[[], None], seconds: float) -> float:
    """GB/s of `work` repeated for at least `seconds` (at least once)."""
    started = time.perf_counter()
    calls = 0
    while True:
        work()
        calls += 1
        elapsed = time.perf_counter() - started
        if elapsed >= seconds:
            return nbytes * calls / elapsed / 1e9


def _timed(nbytes: int, work: Callable[[], None], daemon_pid: int) -> tuple[float, float]:
    """GB/s of `work`, and the CPU seconds per GB it cost this process and the daemon."""
    cpu = time.process_time() + process_cpu_s(daemon_pid)
    started = time.perf_counter()
    work()
    elapsed = time.perf_counter() - started
    cpu = time.process_time() + process_cpu_s(daemon_pid) - cpu
    return nbytes / elapsed / 1e9, cpu / (nbytes / 1e9)


def _put(tier: Tier, frames: list[tuple[BlockKey, bytes]]) -> None:
    for key, frame in frames:
        if not tier.put(key, frame):
            raise RuntimeError("the daemon did not admit a block")


def _get(tier: Tier, keys: list[BlockKey], out: bytearray) -> None:
    for key in keys:
        if tier.get(key, out=out) is None:
            raise RuntimeError("a stored block was not found")


def _measure_cluster(tmp: Path, total: int, repeats: int) -> dict[str, Any]:
    """The redis tier over a real Redis Cluster against redis-py's RedisCluster on the same
    cluster: get/put per size, then a 1,000-key lookup, alternating which goes first."""
    import redis
    from redis.cluster import ClusterNode

    from deploy.local.services import start_redis_cluster
    from kvstore.tiers.redis import RedisConfig, RedisTier

    rates = _Rates()
    ratios: dict[str, list[float]] = {}
    with start_redis_cluster(tmp / "redis-cluster") as cluster:
        tier = RedisTier(RedisConfig(nodes=cluster.seeds, prefix="bench", socket_timeout=30.0))
        client = redis.RedisCluster(startup_nodes=[
            ClusterNode("127.0.0.1", n.port) for n in cluster.nodes],  # type: ignore[no-untyped-call]
            socket_timeout=30.0)
        try:
            for label, size in SIZES.items():
                count = max(total // size, 4)
                progress(f"{label} blocks: kvkeep over Redis Cluster and redis-py, {repeats} "
                         "rounds")
                value = os.urandom(size)
                frame_bytes = len(_frame(_key(label, 0), size))
                out = bytearray(b"\1" * frame_bytes)
                for r in range(repeats + 1):
                    record = r > 0
                    names = [f"bench:{{{label}-{r}-{i}}}" for i in range(count)]
                    keys = [_key(f"cluster-{label}-{r}", i) for i in range(count)]
                    frames = [(k, _frame(k, size)) for k in keys]

                    redis_side = [
                        (f"redis_set/{label}", size, partial(_cluster_set, client, names, value)),
                        (f"redis_get/{label}", size, partial(_cluster_get, client, names))]
                    kvkeep_side = [
                        (f"kvkeep_put/{label}", frame_bytes, partial(_put, tier, frames)),
                        (f"kvkeep_get/{label}", frame_bytes, partial(_get, tier, keys, out))]
                    sides = (redis_side, kvkeep_side) if r % 2 else (kvkeep_side, redis_side)
                    for name, nbytes, work in (*sides[0], *sides[1]):
                        rates.time(name, nbytes * count, work, record)
                    client.delete(*names)
                    tier.delete(keys)
                    if record:
                        for op, base in (("get", "get"), ("put", "set")):
                            ratios.setdefault(f"{op}/{label}", []).append(
                                rates.samples[f"kvkeep_{op}/{label}"][-1]
                                / rates.samples[f"redis_{base}/{label}"][-1])
            progress("a lookup of 1,000 keys on the cluster: kvkeep contains vs 1,000 EXISTS")
            keys = [_key("cluster-lookup", i) for i in range(1000)]
            for k in keys:
                tier.put(k, _frame(k, 4096))
            names = [f"bench:lookup:{i}" for i in range(1000)]
            client.mset_nonatomic({name: b"x" for name in names})
            ours: list[float] = []
            theirs: list[float] = []
            for _ in range(100 if repeats < 9 else 300):
                started = time.perf_counter()
                if not all(tier.contains(keys)):
                    raise RuntimeError("lookup missed stored keys")
                ours.append((time.perf_counter() - started) * 1e3)
                started = time.perf_counter()
                pipe = client.pipeline(transaction=False)  # type: ignore[no-untyped-call]
                for name in names:
                    pipe.exists(name)
                if not all(pipe.execute()):
                    raise RuntimeError("redis lost lookup keys")
                theirs.append((time.perf_counter() - started) * 1e3)
        finally:
            tier.close()
            client.close()
    return {
        "kvkeep_get_gbps": {s: rates.median(f"kvkeep_get/{s}") for s in SIZES},
        "kvkeep_put_gbps": {s: rates.median(f"kvkeep_put/{s}") for s in SIZES},
        "redis_get_gbps": {s: rates.median(f"redis_get/{s}") for s in SIZES},
        "redis_set_gbps": {s: rates.median(f"redis_set/{s}") for s in SIZES},
        "get_over_redis": {s: statistics.median(ratios[f"get/{s}"]) for s in SIZES},
        "put_over_redis": {s: statistics.median(ratios[f"put/{s}"]) for s in SIZES},
        "kvkeep_lookup_1000_p99_ms": statistics.quantiles(ours[10:], n=100)[98],
        "kvkeep_lookup_1000_p50_ms": statistics.median(ours[10:]),
        "redis_exists_1000_p99_ms": statistics.quantiles(theirs[10:], n=100)[98],
        "cluster": "3 masters + 3 replicas (redis-server cluster mode, loopback, no "
                   "persistence), one client thread",
        "kvkeep_client": "RedisTier(nodes=seeds): redis-py RedisCluster + hiredis, "
                         "puts in one MULTI/EXEC per block, gets into a caller buffer",
        "redis_client": "redis-py RedisCluster + hiredis, plain GET/SET of the same size",
        "rounds": {f"{side}_{op}": {s: rates.samples[f"{side}_{op}/{s}"] for s in SIZES}
                   for side, op in (("kvkeep", "get"), ("kvkeep", "put"), ("redis", "get"),
                                    ("redis", "set"))},
    }


def _cluster_set(client: Any, names: list[str], value: bytes) -> None:
    for name in names:
        client.set(name, value)


def _cluster_get(client: Any, names: list[str]) -> None:
    for name in names:
        if client.get(name) is None:
            raise RuntimeError("redis cluster lost a value")


def run(quick: bool) -> dict[str, object]:
    total = (64 << 20) if quick else (512 << 20)
    repeats = 5 if quick else 9
    with tempfile.TemporaryDirectory(prefix="kvkeep-bench-") as tmp_name:
        tmp = Path(tmp_name)
        daemon = bench_daemon(tmp / "daemon", mem_budget="3GiB", disk_budget="8GiB")
        with _redis_server(tmp) as port, daemon as (address, pid):
            rates, tcp, latency, transport, batched = _measure(port, address, pid, total,
                                                               repeats)
        progress("starting a Redis Cluster (3 masters, 3 replicas)")
        cluster = _measure_cluster(tmp, total, repeats)
    kinds = {kind: {op: {s: rates.median(f"{kind}_{op}/{s}") for s in SIZES}
                    for op in ("get", "put")} for kind in ("tcp", "grpc")}
    deployed = kinds[transport]
    return {
        "baseline": {"tcp_loopback_gbps": statistics.median(tcp),
                     "redis_get_gbps": {s: rates.median(f"redis_get/{s}") for s in SIZES},
                     "redis_set_gbps": {s: rates.median(f"redis_set/{s}") for s in SIZES},
                     "redis_exists_1000_p99_ms": latency["redis_exists_1000_p99_ms"],
                     "redis_exists_1_p50_us": latency["lookup_1_redis_p50_us"]},
        "remote": {"get_gbps": deployed["get"], "put_gbps": deployed["put"],
                   "lookup_p99_ms": latency["lookup_p99_ms"],
                   "lookup_p50_ms": latency["lookup_p50_ms"],
                   "lookup_1_p50_us": {kind: latency[f"lookup_1_{kind}_p50_us"]
                                       for kind in ("tcp", "grpc")},
                   "transport": transport},
        "transports": {kind: {
            "get_gbps": figures["get"], "put_gbps": figures["put"],
            "get_cpu_s_per_gb": {s: rates.median(f"{kind}_get_cpu/{s}") for s in SIZES},
            "put_cpu_s_per_gb": {s: rates.median(f"{kind}_put_cpu/{s}") for s in SIZES},
            "rounds": {op: {s: rates.samples[f"{kind}_{op}/{s}"] for s in SIZES}
                       for op in ("get", "put", "get_cpu", "put_cpu")}}
            for kind, figures in kinds.items()},
        "grpc_cpu_over_tcp": {op: {s: statistics.median(
            g / t for t, g in zip(rates.samples[f"tcp_{op}_cpu/{s}"],
                                  rates.samples[f"grpc_{op}_cpu/{s}"], strict=True))
            for s in SIZES} for op in ("get", "put")},
        "tcp_over_grpc": {op: {s: statistics.median(
            t / g for t, g in zip(rates.samples[f"tcp_{op}/{s}"], rates.samples[f"grpc_{op}/{s}"],
                                  strict=True)) for s in SIZES} for op in ("get", "put")},
        "remote_grpc_only": {"get_gbps": kinds["grpc"]["get"], "put_gbps": kinds["grpc"]["put"]},
        "redis_cluster": cluster,
        "batched_256KiB": batched,
        "settings": {
            "malloc_env": {k: os.environ.get(k) for k in MALLOC_ENV},
            "malloc_env_applied_to": ["this process (redis-py client, remote tier client)",
                                      "the kvstore daemon"],
            "grpc_channel_options": dict(channel_options()),
            "order": "per round: redis set/get, then the transports in ABBA order "
                     f"{'/'.join(_ABBA)}, each phase a put of every block then a get",
            "redis_server": "C, unaffected; --save '' --appendonly no (nothing on disk)",
            "daemon_write_behind": "puts persisted to its nvme tier; each put phase is "
                                   "followed by a wait for the write-behind to finish",
            "rounds": repeats, "bytes_per_size_per_phase": total,
            "tcp_loopback_rounds": tcp,
        },
    }


def plots(result: dict[str, Any]) -> list[RatioPanel]:
    """The remote tier against redis-py (same machine, same run), and TCP against gRPC."""
    base, remote = result["baseline"], result["remote"]
    vs_redis = {f"get {s}": remote["get_gbps"][s] / base["redis_get_gbps"][s] for s in SIZES}
    vs_redis |= {f"put {s}": remote["put_gbps"][s] / base["redis_set_gbps"][s] for s in SIZES}
    loopback = {f"{op} {s}": remote[f"{op}_gbps"][s] / base["tcp_loopback_gbps"]
                for op in ("get", "put") for s in SIZES}
    transports = {f"{op} {s}": result["tcp_over_grpc"][op][s]
                  for op in ("get", "put") for s in SIZES}
    panels = [RatioPanel(f"remote tier ({remote['transport']}) over redis-py + hiredis",
                         vs_redis, baseline="redis-py"),
              RatioPanel("remote tier over raw loopback TCP", loopback,
                         baseline="loopback TCP"),
              RatioPanel("TCP data plane over gRPC (median of per-round ratios)", transports,
                         baseline="gRPC")]
    cluster = result.get("redis_cluster")
    if cluster is not None:  # results from before the Redis Cluster row have none
        on_cluster = {f"get {s}": cluster["get_over_redis"][s] for s in SIZES}
        on_cluster |= {f"put {s}": cluster["put_over_redis"][s] for s in SIZES}
        panels.append(RatioPanel("redis tier over Redis Cluster, over redis-py RedisCluster "
                                 "(same cluster)", on_cluster, baseline="redis-py"))
    return panels


def _table(result: dict[str, object]) -> str:
    lines: list[str] = []
    add = lines.append
    base = result["baseline"]
    remote = result["remote"]
    assert isinstance(base, dict) and isinstance(remote, dict)
    tcp = base["tcp_loopback_gbps"]
    add(f"loopback TCP: {tcp:.2f} GB/s")
    add(f"{'size':>6} {'get':>7} {'redis get':>10} {'ratio':>6} {'put':>7} "
        f"{'redis set':>10} {'ratio':>6} {'get/tcp':>8}")
    for label in SIZES:
        g, rg = remote["get_gbps"][label], base["redis_get_gbps"][label]
        p, rs = remote["put_gbps"][label], base["redis_set_gbps"][label]
        add(f"{label:>6} {g:7.2f} {rg:10.2f} {g / rg:6.2f} {p:7.2f} {rs:10.2f} {p / rs:6.2f} "
            f"{g / tcp:8.2f}")
    add(f"lookup of 1,000 keys: p99 {remote['lookup_p99_ms']:.2f} ms "
        f"(p50 {remote['lookup_p50_ms']:.2f}; redis 1,000 EXISTS pipelined: p99 "
        f"{base['redis_exists_1000_p99_ms']:.2f} ms); transport: {remote['transport']}")
    one = remote["lookup_1_p50_us"]
    add(f"lookup of 1 key, p50: data plane {one['tcp']:.0f} us, gRPC {one['grpc']:.0f} us, "
        f"redis EXISTS {base['redis_exists_1_p50_us']:.0f} us")
    kinds = result["transports"]
    ratio = result["tcp_over_grpc"]
    assert isinstance(kinds, dict) and isinstance(ratio, dict)
    add("block transports, ABBA rounds (GB/s, medians; ratio: median of per-round TCP/gRPC):")
    add(f"{'size':>6} {'tcp get':>8} {'grpc get':>9} {'ratio':>6} {'tcp put':>8} "
        f"{'grpc put':>9} {'ratio':>6}")
    for label in SIZES:
        tg, gg = kinds["tcp"]["get_gbps"][label], kinds["grpc"]["get_gbps"][label]
        tp, gp = kinds["tcp"]["put_gbps"][label], kinds["grpc"]["put_gbps"][label]
        add(f"{label:>6} {tg:8.2f} {gg:9.2f} {ratio['get'][label]:6.2f} {tp:8.2f} {gp:9.2f} "
            f"{ratio['put'][label]:6.2f}")
    cpu = result["grpc_cpu_over_tcp"]
    assert isinstance(cpu, dict)
    add("CPU s per GB (this process + the daemon), gRPC / TCP, median of rounds: "
        + ", ".join(f"{label} get {cpu['get'][label]:.2f} put {cpu['put'][label]:.2f}"
                    for label in SIZES))
    batched = result["batched_256KiB"]
    assert isinstance(batched, dict)
    add(f"{BATCH} x 256 KiB as one batch (kvkeep get_into / redis-py MGET, and put_many / "
        "MSET, GB/s, medians):")
    for beside, figures in batched.items():
        add(f"  beside {beside.replace('_', ' ')}: get kvkeep {figures['kvkeep_gbps']:.2f}, "
            f"redis {figures['redis_mget_gbps']:.2f}, ratio {figures['kvkeep_over_redis']:.2f}; "
            f"put kvkeep {figures['kvkeep_put_gbps']:.2f}, redis "
            f"{figures['redis_mset_gbps']:.2f}, ratio {figures['put_over_redis']:.2f}")
    cluster = result["redis_cluster"]
    assert isinstance(cluster, dict)
    add("Redis Cluster (3 masters + 3 replicas), GB/s, medians; ratio: median of per-round "
        "kvkeep/redis-py; daemons: the remote tier above:")
    add(f"{'size':>6} {'kvkeep get':>11} {'redis get':>10} {'ratio':>6} {'daemons':>8} "
        f"{'kvkeep put':>11} {'redis set':>10} {'ratio':>6} {'daemons':>8}")
    for label in SIZES:
        add(f"{label:>6} {cluster['kvkeep_get_gbps'][label]:11.2f} "
            f"{cluster['redis_get_gbps'][label]:10.2f} "
            f"{cluster['get_over_redis'][label]:6.2f} {remote['get_gbps'][label]:8.2f} "
            f"{cluster['kvkeep_put_gbps'][label]:11.2f} "
            f"{cluster['redis_set_gbps'][label]:10.2f} "
            f"{cluster['put_over_redis'][label]:6.2f} {remote['put_gbps'][label]:8.2f}")
    add(f"lookup of 1,000 keys on the cluster: kvkeep p99 "
        f"{cluster['kvkeep_lookup_1000_p99_ms']:.2f} ms (p50 "
        f"{cluster['kvkeep_lookup_1000_p50_ms']:.2f}); redis-py 1,000 EXISTS pipelined: p99 "
        f"{cluster['redis_exists_1000_p99_ms']:.2f} ms")
    return "\n".join(lines)


def _reexec_with_allocator_settings() -> None:
    if os.environ.get("KVKEEP_NO_MALLOC_TUNING") == "1":
        return
    if all(os.environ.get(k) == v for k, v in MALLOC_ENV.items()):
        return
    os.execve(sys.executable, [sys.executable, "-m", "benchmarks.remote", *sys.argv[1:]],
              {**os.environ, **MALLOC_ENV})


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        _reexec_with_allocator_settings()

    def measure(args: argparse.Namespace) -> dict[str, Any]:
        progress("starting redis-server and a kvstore daemon")
        return dict(run(args.quick))

    return run_benchmark("remote", measure, _table, argv, plots=plots)


if __name__ == "__main__":
    sys.exit(main())
