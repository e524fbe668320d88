"""Real services for tests: etcd and redis-server as subprocesses on free loopback ports.

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

__all__ = ["free_port", "EtcdServer", "RedisServer", "start_etcd", "start_redis", "stop_process",
           "wait_for_port"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


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
    proc: subprocess.Popen[bytes]
    port: int
    peer_port: int
    data_dir: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def kill(self) -> None:
        stop_process(self.proc, signal.SIGKILL)

    def restart(self) -> None:
        """Start etcd again on the same ports and data dir (after kill/stop)."""
        stop_process(self.proc)
        self.proc = _spawn_etcd(self.port, self.peer_port, self.data_dir)
        wait_for_port(self.port, proc=self.proc)


def _spawn_etcd(port: int, peer_port: int, data_dir: Path) -> subprocess.Popen[bytes]:
    etcd = shutil.which("etcd")
    if etcd is None:
        raise RuntimeError("etcd not installed: run `make setup`")
    peer = f"http://127.0.0.1:{peer_port}"
    return subprocess.Popen(
        [etcd, "--name", "t", "--data-dir", str(data_dir),
         "--listen-client-urls", f"http://127.0.0.1:{port}",
         "--advertise-client-urls", f"http://127.0.0.1:{port}",
         "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
         "--initial-cluster", f"t={peer}",
         # Fast elections keep start-up at ~65 ms; no fsync is for tests only.
         "--heartbeat-interval", "10", "--election-timeout", "100", "--unsafe-no-fsync",
         "--log-level", "error"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env={**os.environ, "ETCD_UNSUPPORTED_ARCH": os.environ.get("ETCD_UNSUPPORTED_ARCH", "")},
    )


@contextlib.contextmanager
def start_etcd(tmp: Path) -> Iterator[EtcdServer]:
    port, peer_port = free_port(), free_port()
    data_dir = tmp / f"etcd-{port}"
    proc = _spawn_etcd(port, peer_port, data_dir)
    server = EtcdServer(proc, port, peer_port, data_dir)
    try:
        wait_for_port(port, proc=proc)
        yield server
    finally:
        stop_process(server.proc)


@dataclass
class RedisServer:
    proc: subprocess.Popen[bytes]
    port: int

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"


@contextlib.contextmanager
def start_redis(tmp: Path, maxmemory: str = "0") -> Iterator[RedisServer]:
    redis = shutil.which("redis-server")
    if redis is None:
        raise RuntimeError("redis-server not installed: run `make setup`")
    port = free_port()
    proc = subprocess.Popen(
        [redis, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no",
         "--dir", str(tmp), "--maxmemory", maxmemory, "--proto-max-bulk-len", "1gb"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        wait_for_port(port, proc=proc)
        yield RedisServer(proc, port)
    finally:
        stop_process(proc)
