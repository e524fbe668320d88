"""Real kvstore daemons for tests and benchmarks: `python -m kvstore.daemon` subprocesses on
free loopback ports.

Each daemon gets its own data dir and log file, is waited on until its health service says
SERVING, and is stopped by pid (SIGTERM to drain, SIGKILL to crash). Nothing is mocked.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from deploy.local.processes import ManagedProcess
from deploy.local.services import free_port
from kvstore.commands.store import MALLOC_ENV
from kvstore.errors import KVKeepError
from kvstore.net.daemon_client import DaemonClient

__all__ = ["DaemonProcess", "start_daemon", "running_daemon", "running_daemons", "wait_healthy",
           "REPO_ROOT"]

REPO_ROOT = Path(__file__).resolve().parents[2]
# Tests run from another environment (the LMCache plugin's, which has protobuf < 7) still
# start the daemon from kvkeep's own: KVKEEP_DAEMON_PYTHON names its interpreter.
DAEMON_PYTHON = os.environ.get("KVKEEP_DAEMON_PYTHON") or sys.executable


@dataclass
class DaemonProcess:
    """One daemon: its flags, data dir and log, the running process (a `ManagedProcess`, as
    every process of a local cluster: its own group, stopped by pid) and the clients handed
    out, closed at the end."""

    node_id: str
    port: int
    data_dir: Path
    log_path: Path
    args: list[str]
    process: ManagedProcess | None = None
    clients: list[DaemonClient] = field(default_factory=list)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def proc(self) -> subprocess.Popen[bytes] | None:
        return None if self.process is None else self.process.proc

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.alive

    def client(self, token: str | None = None) -> DaemonClient:
        c = DaemonClient(self.node_id, self.address, token=token)
        self.clients.append(c)
        return c

    def spawn(self) -> None:
        """Start the daemon with its current `args` (a restart appends to the same log)."""
        env = {**os.environ, **MALLOC_ENV, "PYTHONUNBUFFERED": "1"}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT),
                                                          env.get("PYTHONPATH")]))
        self.process = ManagedProcess(
            f"daemon-{self.node_id}", [DAEMON_PYTHON, "-m", "kvstore.daemon", *self.args],
            self.log_path, env, REPO_ROOT).start()

    def wait_healthy(self, timeout: float = 20.0) -> None:
        wait_healthy(self, timeout)

    def kill(self) -> None:
        """SIGKILL: a crash, no draining, no lease revocation."""
        if self.process is not None:
            self.process.kill()

    def terminate(self, timeout: float = 30.0) -> int | None:
        """SIGTERM: a graceful drain (SIGKILL after `timeout`); returns the exit code."""
        return None if self.process is None else self.process.stop(timeout)

    def restart(self, timeout: float = 20.0) -> None:
        self.kill()
        self.spawn()
        self.wait_healthy(timeout)

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def close_clients(self) -> None:
        for c in self.clients:
            c.close()
        self.clients.clear()


def wait_healthy(daemon: DaemonProcess, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    probe = DaemonClient(daemon.node_id, daemon.address)
    try:
        while time.monotonic() < deadline:
            if daemon.process is not None and not daemon.process.alive:
                raise RuntimeError(f"daemon {daemon.node_id} exited with "
                                   f"{daemon.process.returncode}:"
                                   f"\n{daemon.log_text()[-3000:]}")
            with contextlib.suppress(KVKeepError):
                if probe.health(timeout=0.5) == "SERVING":
                    return
            time.sleep(0.05)
    finally:
        probe.close()
    raise TimeoutError(f"daemon {daemon.node_id} not SERVING after {timeout}s:\n"
                       f"{daemon.log_text()[-3000:]}")


def start_daemon(tmp: Path, node_id: str, *, etcd_url: str | None = None,
                 token_file: Path | None = None, extra: Sequence[str] = (),
                 mem_budget: str = "256MiB", disk_budget: str = "1GiB", lease_ttl: int = 2,
                 rereplicate_after: float = 1.0, wait: bool = True) -> DaemonProcess:
    """Start one daemon (and wait until it serves, unless `wait=False`)."""
    port = free_port()
    data_dir = tmp / f"daemon-{node_id}"
    data_dir.mkdir(parents=True, exist_ok=True)
    args = ["--listen", f"127.0.0.1:{port}", "--data-dir", str(data_dir),
            "--mem-budget", mem_budget, "--disk-budget", disk_budget, "--node-id", node_id,
            "--lease-ttl", str(lease_ttl), "--rereplicate-after", str(rereplicate_after),
            "--drain-timeout", "10"]
    if etcd_url:
        args += ["--etcd", etcd_url]
    if token_file:
        args += ["--token-file", str(token_file)]
    args += list(extra)
    daemon = DaemonProcess(node_id, port, data_dir, tmp / f"daemon-{node_id}.log", args)
    daemon.spawn()
    if wait:
        try:
            daemon.wait_healthy()
        except BaseException:
            daemon.kill()
            raise
    return daemon


@contextlib.contextmanager
def running_daemon(tmp: Path, node_id: str, **kwargs: object) -> Iterator[DaemonProcess]:
    """One daemon (`start_daemon`'s arguments), drained with SIGTERM and its clients closed at
    the end: the body of a test module's own `daemon` fixture."""
    daemon = start_daemon(tmp, node_id, **kwargs)  # type: ignore[arg-type]
    try:
        yield daemon
    finally:
        daemon.close_clients()
        daemon.terminate()


@contextlib.contextmanager
def running_daemons(tmp: Path, count: int, **kwargs: object) -> Iterator[list[DaemonProcess]]:
    """`count` daemons started in parallel (node ids d0, d1, ...); all stopped at the end."""
    daemons = [start_daemon(tmp, f"d{i}", wait=False, **kwargs)  # type: ignore[arg-type]
               for i in range(count)]
    try:
        for d in daemons:
            d.wait_healthy()
        yield daemons
    finally:
        for d in daemons:
            d.close_clients()
            d.terminate(15.0)
