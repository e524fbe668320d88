"""Real services for tests and benchmarks: etcd and redis-server (one, or a Redis Cluster of
them) as subprocesses on free loopback ports.

Each is started in its own temp dir, waited on until it answers, and stopped by pid. Nothing
here is a mock: tests talk to the same binaries a deployment runs.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deploy.local.ports import free_port
from deploy.local.processes import ManagedProcess

__all__ = ["free_port", "EtcdServer", "RedisCluster", "RedisClusterNode", "RedisServer",
           "start_etcd", "start_redis", "start_redis_cluster", "stop_process", "wait_for_port"]


def wait_for_port(port: int, timeout: float = 15.0, proc: subprocess.Popen[bytes] | None = None
                  ) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before listening on {port}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        time.sleep(0.02)
    raise TimeoutError(f"nothing listening on 127.0.0.1:{port} after {timeout}s")


def stop_process(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM, timeout: float = 10.0
                 ) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, sig)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()


@dataclass
class EtcdServer:
    process: ManagedProcess
    port: int
    peer_port: int
    data_dir: Path

    @property
    def proc(self) -> subprocess.Popen[bytes]:
        return self.process.started

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def kill(self) -> None:
        self.process.kill()

    def restart(self) -> None:
        """Start etcd again on the same ports and data dir (after kill/stop)."""
        self.process.stop()
        self.process.start()
        wait_for_port(self.port, proc=self.proc)


def _etcd_process(port: int, peer_port: int, data_dir: Path) -> ManagedProcess:
    etcd = shutil.which("etcd")
    if etcd is None:
        raise RuntimeError("etcd not installed: run `make setup`")
    peer = f"http://127.0.0.1:{peer_port}"
    return ManagedProcess(
        "etcd", [etcd, "--name", "t", "--data-dir", str(data_dir),
                 "--listen-client-urls", f"http://127.0.0.1:{port}",
                 "--advertise-client-urls", f"http://127.0.0.1:{port}",
                 "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                 "--initial-cluster", f"t={peer}",
                 # Fast elections keep start-up at ~65 ms; no fsync is for tests only.
                 "--heartbeat-interval", "10", "--election-timeout", "100",
                 "--unsafe-no-fsync", "--log-level", "error"],
        data_dir.with_name(f"{data_dir.name}.log"),
        {**os.environ, "ETCD_UNSUPPORTED_ARCH": os.environ.get("ETCD_UNSUPPORTED_ARCH", "")})


@contextlib.contextmanager
def start_etcd(tmp: Path) -> Iterator[EtcdServer]:
    port, peer_port = free_port(), free_port()
    data_dir = tmp / f"etcd-{port}"
    server = EtcdServer(_etcd_process(port, peer_port, data_dir).start(), port, peer_port,
                        data_dir)
    try:
        wait_for_port(port, proc=server.proc)
        yield server
    finally:
        server.process.stop()


@dataclass
class RedisServer:
    process: ManagedProcess
    port: int

    @property
    def proc(self) -> subprocess.Popen[bytes]:
        return self.process.started

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"


@contextlib.contextmanager
def start_redis(tmp: Path, maxmemory: str = "0") -> Iterator[RedisServer]:
    redis = shutil.which("redis-server")
    if redis is None:
        raise RuntimeError("redis-server not installed: run `make setup`")
    port = free_port()
    server = RedisServer(ManagedProcess(
        "redis", [redis, "--bind", "127.0.0.1", "--port", str(port), "--save", "",
                  "--appendonly", "no", "--dir", str(tmp), "--maxmemory", maxmemory,
                  "--proto-max-bulk-len", "1gb"],
        tmp / f"redis-{port}.log").start(), port)
    try:
        wait_for_port(port, proc=server.proc)
        yield server
    finally:
        server.process.stop()


@dataclass
class RedisClusterNode:
    process: ManagedProcess
    port: int
    bus_port: int
    node_dir: Path

    @property
    def proc(self) -> subprocess.Popen[bytes]:
        return self.process.started

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


@dataclass
class RedisCluster:
    """A real Redis Cluster on loopback: `nodes[:masters]` were created masters, the rest their
    replicas (`redis-cli --cluster create --cluster-replicas`); roles change after a failover,
    so ask `masters()` rather than trusting the order."""

    nodes: list[RedisClusterNode]
    node_timeout_ms: int

    @property
    def seeds(self) -> tuple[str, ...]:
        return tuple(node.address for node in self.nodes)

    def client(self, node: RedisClusterNode) -> Any:
        """A plain (non-cluster) redis-py client of one node: sees MOVED/ASK as errors."""
        import redis

        return redis.Redis(host="127.0.0.1", port=node.port, socket_timeout=5.0)

    def masters(self) -> list[RedisClusterNode]:
        """The live nodes that are masters now, by their own INFO."""
        found = []
        for node in self.nodes:
            if node.proc.poll() is not None:
                continue
            with contextlib.closing(self.client(node)) as r:
                if r.info("replication").get("role") == "master":
                    found.append(node)
        return found

    def node_of_slot(self, slot: int, asking: RedisClusterNode | None = None
                     ) -> RedisClusterNode:
        """The master serving `slot`, by CLUSTER SLOTS of `asking` (default: a live node)."""
        live = asking or next(n for n in self.nodes if n.proc.poll() is None)
        with contextlib.closing(self.client(live)) as r:
            # Each entry: [first slot, last slot, [master host, port, id, ...], replicas...]
            for lo, hi, master, *_ in r.execute_command("CLUSTER SLOTS"):
                if lo <= slot <= hi:
                    return next(n for n in self.nodes if n.port == int(master[1]))
        raise LookupError(f"no master serves slot {slot}")

    def node_id(self, node: RedisClusterNode) -> str:
        with contextlib.closing(self.client(node)) as r:
            return str(r.execute_command("CLUSTER MYID").decode())

    def kill(self, node: RedisClusterNode) -> None:
        """SIGKILL, like a lost machine: no goodbye on the cluster bus."""
        node.process.kill()

    def wait_ok(self, timeout: float = 30.0, replicas_in_sync: bool = True) -> None:
        """Until every live node says cluster_state:ok and agrees on the slot owners, and (by
        default) every live replica's link to its master is up."""
        deadline = time.monotonic() + timeout
        while True:
            if self._healthy(replicas_in_sync):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"the redis cluster did not settle within {timeout}s")
            time.sleep(0.05)

    def _healthy(self, replicas_in_sync: bool) -> bool:
        import redis

        epochs = set()
        replicas, acknowledged = 0, 0
        try:
            for node in self.nodes:
                if node.proc.poll() is not None:
                    continue
                with contextlib.closing(self.client(node)) as r:
                    info = r.cluster("info")
                    if info.get("cluster_state") != "ok":
                        return False
                    epochs.add(str(info.get("cluster_current_epoch")))
                    repl = r.info("replication")
                    if not replicas_in_sync:
                        continue
                    if repl.get("role") == "slave":
                        if repl.get("master_link_status") != "up":
                            return False
                        replicas += 1
                    else:
                        acknowledged += self._live_replicas(repl)
        except redis.RedisError:
            return False
        # Both ends agree: each running replica is linked, and listed online by its master.
        return len(epochs) == 1 and acknowledged == replicas

    def _live_replicas(self, repl: dict[str, Any]) -> int:
        """The online replicas a master's replication INFO lists that are still running (a
        killed one stays listed until the master notices)."""
        live = {n.port for n in self.nodes if n.proc.poll() is None}
        return sum(1 for k, v in repl.items() if k.startswith("slave") and isinstance(v, dict)
                   and v.get("state") == "online" and int(v.get("port", 0)) in live)


def _cluster_node(binary: str, node_dir: Path, port: int, bus_port: int,
                  node_timeout_ms: int, maxmemory: str) -> ManagedProcess:
    node_dir.mkdir(parents=True, exist_ok=True)
    return ManagedProcess(
        f"redis-{port}",
        [binary, "--bind", "127.0.0.1", "--port", str(port), "--cluster-enabled", "yes",
         # The bus port is given, not port+10000: a free port above 55535 has no +10000.
         "--cluster-port", str(bus_port), "--cluster-config-file", str(node_dir / "nodes.conf"),
         "--cluster-node-timeout", str(node_timeout_ms), "--dir", str(node_dir),
         "--save", "", "--appendonly", "no", "--maxmemory", maxmemory,
         "--maxmemory-policy", "noeviction", "--proto-max-bulk-len", "1gb",
         # Replicas sync at once (the default waits 5 s for more replicas to share a transfer).
         "--repl-diskless-sync-delay", "0", "--logfile", str(node_dir / "redis.log")],
        node_dir / "stdout.log")


@contextlib.contextmanager
def start_redis_cluster(tmp: Path, masters: int = 3, replicas: int = 1,
                        node_timeout_ms: int = 5000, maxmemory: str = "0"
                        ) -> Iterator[RedisCluster]:
    """`masters` masters with `replicas` replicas each, formed by `redis-cli --cluster create`,
    returned once every node reports the cluster ok and every replica is in sync; all stopped
    by pid on exit. `node_timeout_ms` bounds how long a killed master goes unnoticed (5 s by
    default: long enough that a loaded CI machine's pauses never start a failover)."""
    binary, cli = shutil.which("redis-server"), shutil.which("redis-cli")
    if binary is None or cli is None:
        raise RuntimeError("redis-server / redis-cli not installed: run `make setup`")
    nodes: list[RedisClusterNode] = []
    try:
        for _ in range(masters * (1 + replicas)):
            port, bus_port = free_port(), free_port()
            node_dir = tmp / f"redis-cluster-{port}"
            process = _cluster_node(binary, node_dir, port, bus_port, node_timeout_ms,
                                    maxmemory).start()
            nodes.append(RedisClusterNode(process, port, bus_port, node_dir))
        for node in nodes:
            wait_for_port(node.port, proc=node.proc)
        subprocess.run([cli, "--cluster", "create", *(n.address for n in nodes),
                        "--cluster-replicas", str(replicas), "--cluster-yes"],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                       timeout=60)
        cluster = RedisCluster(nodes, node_timeout_ms)
        cluster.wait_ok()
        yield cluster
    finally:
        # All signalled first, then waited on: one by one, six shutdowns take ~2 s.
        for node in nodes:
            node.process.terminate()
        for node in nodes:
            node.process.stop()
